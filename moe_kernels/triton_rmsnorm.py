"""Batch-invariant RMSNorm as a Triton kernel (GPU path), HF DeepSeek semantics.

One program per row walks the row in blocks of a fixed width chosen from D alone, keeping a
per-lane fp32 sum of squares that is reduced once at the end: the order of every addition is
fixed by D, never by how many rows share the launch. Oracle: `rms_norm_ref`
(moe_kernels/rmsnorm.py): fp32 statistics, the normalised row rounded to x's dtype, then times
the weight in the promoted dtype. `add_rms_norm_triton` is the residual add before a norm and
that norm in one launch, the row math shared (`rms_norm_row`). Under TRITON_INTERPRET=1 it
runs on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from moe_kernels.triton_pdl import pdl_launch, pdl_start

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_BLOCK_D = 4096


@triton.jit
def rms_norm_row(x_row, w_ptr, out_row, D, eps, BLOCK_D: tl.constexpr):
    """One row: out_row[:D] = w * rms_normed(x_row[:D]) (pointers to the row's first element,
    unit column stride). Shared by every kernel that normalises a row, so they cannot drift:
    with the same D, BLOCK_D and num_warps (`norm_launch_config`) they give the same bits."""
    offs = tl.arange(0, BLOCK_D)
    # Why: lane i accumulates elements i, i + BLOCK_D, ... in order; one tree sum at the end.
    # Both depend on D and BLOCK_D only: one program per row, nothing split across programs.
    sum_sq = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        x = tl.load(x_row + d0 + offs, mask=d0 + offs < D, other=0.0).to(tl.float32)
        sum_sq += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / D + eps)
    for d0 in range(0, D, BLOCK_D):
        mask = d0 + offs < D
        x = tl.load(x_row + d0 + offs, mask=mask, other=0.0)
        normed = (x.to(tl.float32) * rstd).to(x_row.dtype.element_ty)
        w = tl.load(w_ptr + d0 + offs, mask=mask, other=0.0)
        y = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_row + d0 + offs, y.to(out_row.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, D, eps, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False
):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    rms_norm_row(x_ptr + row * D, w_ptr, out_ptr + row * D, D, eps, BLOCK_D)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    delta_ptr,
    w_ptr,
    sum_ptr,
    out_ptr,
    D,
    eps,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        mask = d0 + offs < D
        x = tl.load(x_ptr + row * D + d0 + offs, mask=mask, other=0.0).to(tl.float32)
        delta = tl.load(delta_ptr + row * D + d0 + offs, mask=mask, other=0.0).to(tl.float32)
        # Why: torch's add of two bf16 tensors is this: an fp32 sum rounded once.
        tl.store(sum_ptr + row * D + d0 + offs, (x + delta).to(sum_ptr.dtype.element_ty), mask=mask)
    # Why: the norm reads the rounded sums back, some written by other threads of the program;
    # the barrier makes them visible (and the norm reads exactly what the unfused one would).
    tl.debug_barrier()
    rms_norm_row(sum_ptr + row * D, w_ptr, out_ptr + row * D, D, eps, BLOCK_D)


def norm_launch_config(dim: int) -> dict:
    """BLOCK_D and num_warps of a row norm over `dim` channels: functions of dim only (the
    reduction tree of `rms_norm_row` follows them, so every kernel calling it takes these)."""
    block_d = min(triton.next_power_of_2(dim), MAX_BLOCK_D)
    return {"BLOCK_D": block_d, "num_warps": 8 if block_d >= 2048 else 4}


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Raise ValueError unless x [T, D] and weight [D] share a device (CUDA, or CPU when
    interpreted) and have float dtypes."""
    allowed = ("cpu", "cuda") if isinstance(_rms_norm_kernel, InterpretedFunction) else ("cuda",)
    if x.device.type not in allowed:
        raise ValueError(f"x must be on a device of type {allowed}, got {x.device}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if x.dim() != 2 or weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"x must be [T, D] and weight [D], got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype must be one of {_DTYPES}, got {t.dtype}")


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D], weight [D] -> [T, D] in the promoted dtype of weight and x."""
    _check(x, weight)
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x.shape[0] == 0:
        return out
    _rms_norm_kernel[(x.shape[0],)](
        x, weight, out, x.shape[1], eps, **norm_launch_config(x.shape[1]), **pdl_launch(x.device)
    )
    return out


def add_rms_norm_triton(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_composed's contract (moe_kernels/rmsnorm.py) with rms_norm_triton's bits, one
    launch: x, delta [T, D] of one dtype, weight [D] -> (x + delta [T, D] in x's dtype, its
    norm [T, D] in the promoted dtype of weight and x)."""
    _check(x, weight)
    if delta.shape != x.shape or delta.dtype != x.dtype or delta.device != x.device:
        raise ValueError(
            f"delta must match x's shape, dtype and device, got {tuple(delta.shape)} "
            f"{delta.dtype} {delta.device} for x {tuple(x.shape)} {x.dtype} {x.device}"
        )
    x, delta, weight = x.contiguous(), delta.contiguous(), weight.contiguous()
    total = torch.empty_like(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x.shape[0]:
        _add_rms_norm_kernel[(x.shape[0],)](
            x,
            delta,
            weight,
            total,
            out,
            x.shape[1],
            eps,
            **norm_launch_config(x.shape[1]),
            **pdl_launch(x.device),
        )
    return total, out
