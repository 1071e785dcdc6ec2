"""The MoE layer's output epilogue as one elementwise Triton kernel (GPU path of `moe_output_ref`).

out = residual + (routed rounded to the residual's dtype + shared), with the reference's roundings
in its order: the fp32 routed sum rounded once, then each add an fp32 add of the upcast operands
rounded once to the residual's dtype, as torch's eager add does for bf16. Adds and round-to-nearest
casts are correctly rounded, so every element has exactly the bits of the three torch launches it
replaces, whatever its offset or the batch. Under TRITON_INTERPRET=1 it runs on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from moe_kernels.triton_pdl import pdl_launch, pdl_start

BLOCK = 1024


@triton.jit
def moe_output_value(routed, shared_ptr, residual_ptr, offs, ok, HAS_SHARED: tl.constexpr, dtype):
    """The output of elements `offs` (mask ok) from their routed sums (fp32 or dtype, loaded):
    routed rounded to dtype, + shared (HAS_SHARED), + residual, each add in fp32 rounded once.
    Shared by the MoE output and the fused combine kernels, so they cannot drift."""
    moe = routed.to(dtype)
    if HAS_SHARED:
        shared = tl.load(shared_ptr + offs, mask=ok, other=0.0)
        moe = (moe.to(tl.float32) + shared.to(tl.float32)).to(dtype)
    residual = tl.load(residual_ptr + offs, mask=ok, other=0.0)
    return (residual.to(tl.float32) + moe.to(tl.float32)).to(dtype)


@triton.jit
def _moe_output_kernel(
    routed_ptr,
    shared_ptr,
    residual_ptr,
    out_ptr,
    num_elems,
    HAS_SHARED: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_elems
    routed = tl.load(routed_ptr + offs, mask=ok, other=0.0)
    out = moe_output_value(
        routed, shared_ptr, residual_ptr, offs, ok, HAS_SHARED, out_ptr.dtype.element_ty
    )
    tl.store(out_ptr + offs, out, mask=ok)


def moe_output_triton(
    routed: torch.Tensor, shared: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """moe_output_ref's contract: routed [T, D] (fp32 combine output, or already in residual's
    dtype), shared [T, D] in residual's dtype or None, residual [T, D] -> [T, D] in residual's
    dtype, one launch."""
    check_moe_output(routed, shared, residual)
    routed, residual = routed.contiguous(), residual.contiguous()
    out = torch.empty_like(residual)
    num_elems = out.numel()
    if num_elems:
        _moe_output_kernel[(triton.cdiv(num_elems, BLOCK),)](
            routed,
            residual if shared is None else shared.contiguous(),  # never read without shared
            residual,
            out,
            num_elems,
            HAS_SHARED=shared is not None,
            BLOCK=BLOCK,
            **pdl_launch(routed.device),
        )
    return out


def check_moe_output(
    routed: torch.Tensor | None, shared: torch.Tensor | None, residual: torch.Tensor
) -> None:
    """moe_output_ref's operands as the Triton kernels take them (routed None: summed in the
    kernel), or a ValueError naming the bad one."""
    allowed = ("cpu", "cuda") if isinstance(_moe_output_kernel, InterpretedFunction) else ("cuda",)
    if residual.device.type not in allowed:
        raise ValueError(f"residual must be on a device of type {allowed}, got {residual.device}")
    named = {"routed": routed, "shared": shared}
    for name, t in named.items():
        if t is not None and (t.shape != residual.shape or t.device != residual.device):
            raise ValueError(
                f"{name} must be {tuple(residual.shape)} on {residual.device} like residual, got "
                f"{tuple(t.shape)} on {t.device}"
            )
    if shared is not None and shared.dtype != residual.dtype:
        raise ValueError(f"shared must be {residual.dtype} like residual, got {shared.dtype}")
    if routed is not None and routed.dtype not in (torch.float32, residual.dtype):
        raise ValueError(f"routed must be fp32 or {residual.dtype}, got {routed.dtype}")
