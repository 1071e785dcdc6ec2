"""The gated MLP's silu(gate) * up as one elementwise Triton kernel (GPU path of `silu_mul_ref`).

The reference's steps, element by element: silu in fp32 (x / (1 + exp(-x))), rounded to the
input dtype, times up, rounded again. One scalar formula per element, so an element's bits
never depend on its offset, the tensor size or the batch; Triton's exp is not torch's, so the
bits are this kernel's own, the same on every CUDA path. Under TRITON_INTERPRET=1 it runs on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels.triton_pdl import pdl_launch, pdl_start

BLOCK = 1024


@triton.jit
def silu_mul_value(gate, up):
    """silu(gate) * up of values in up's dtype (gate: that dtype, or fp32 values exactly
    representable in it): silu in fp32 rounded to up's dtype, the product rounded again.
    Shared by every kernel that applies the gated MLP's activation, so they cannot drift."""
    gate = gate.to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype)


@triton.jit
def _silu_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    cols,
    gate_stride,
    up_stride,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < cols
    gate = tl.load(gate_ptr + row * gate_stride + offs, mask=ok, other=0.0)
    up = tl.load(up_ptr + row * up_stride + offs, mask=ok, other=0.0)
    tl.store(out_ptr + row * cols + offs, silu_mul_value(gate, up), mask=ok)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [N, I] (same shape and dtype; row strides free, e.g. halves of one gate_up
    output) -> silu(gate) * up [N, I], contiguous."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dim() != 2:
        raise ValueError(
            f"need gate and up of one [N, I] shape and dtype, got {tuple(gate.shape)} "
            f"{gate.dtype}, {tuple(up.shape)} {up.dtype}"
        )
    if gate.stride(1) != 1 or up.stride(1) != 1:
        gate, up = gate.contiguous(), up.contiguous()
    rows, cols = gate.shape
    out = torch.empty((rows, cols), dtype=up.dtype, device=up.device)
    if rows and cols:
        _silu_mul_kernel[(rows, triton.cdiv(cols, BLOCK))](
            gate, up, out, cols, gate.stride(0), up.stride(0), BLOCK=BLOCK, **pdl_launch(out.device)
        )
    return out
