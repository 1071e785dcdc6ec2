"""`rope_ref` (moe_kernels/rope.py) as one Triton kernel: one program per token, all its heads.

Every intermediate is rounded to x's dtype as torch's eager ops round it (products, then the
difference / sum), so no multiply and add can fuse into an FMA; a token's bits depend on its
values and position only (tests/test_gpu_kernels.py checks them against torch's within one
rounding). Under TRITON_INTERPRET=1 it runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels.triton_dot import stored_value
from moe_kernels.triton_pdl import pdl_launch, pdl_start


@triton.jit
def rope_row(
    x_row,
    stride_xh,
    position,
    cos_ptr,
    sin_ptr,
    out_row,
    stride_oh,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_INTERLEAVED: tl.constexpr,
):
    """One token's heads: out_row[h] = rotated x_row[h] (halves: first, second) at `position`,
    in out_row's dtype; pointers to head 0's first channel, unit channel stride. Shared by
    every kernel that rotates rope channels, so they cannot drift."""
    heads = tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_R)
    ok = (heads[:, None] < num_heads) & (pairs[None, :] < HALF)
    dtype = out_row.dtype.element_ty
    cos = tl.load(cos_ptr + position * HALF + pairs, mask=pairs < HALF, other=0.0).to(dtype)
    sin = tl.load(sin_ptr + position * HALF + pairs, mask=pairs < HALF, other=0.0).to(dtype)
    cos, sin = cos[None, :].to(tl.float32), sin[None, :].to(tl.float32)
    row = x_row + heads[:, None] * stride_xh
    if IS_INTERLEAVED:
        x1 = tl.load(row + 2 * pairs[None, :], mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(row + 2 * pairs[None, :] + 1, mask=ok, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(row + pairs[None, :], mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(row + HALF + pairs[None, :], mask=ok, other=0.0).to(tl.float32)
    # Why each rounding: torch rounds every elementwise result to the tensor's dtype.
    a1 = stored_value(x1 * cos, dtype).to(tl.float32)
    b1 = stored_value(x2 * sin, dtype).to(tl.float32)
    a2 = stored_value(x2 * cos, dtype).to(tl.float32)
    b2 = stored_value(x1 * sin, dtype).to(tl.float32)
    out = out_row + heads[:, None] * stride_oh + pairs[None, :]
    tl.store(out, (a1 - b1).to(dtype), mask=ok)
    tl.store(out + HALF, (a2 + b2).to(dtype), mask=ok)


@triton.jit
def _rope_kernel(
    x_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    num_heads,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_INTERLEAVED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + t)
    rope_row(
        x_ptr + t * stride_xt,
        stride_xh,
        position,
        cos_ptr,
        sin_ptr,
        out_ptr + t * stride_ot,
        stride_oh,
        num_heads,
        HALF,
        BLOCK_H,
        BLOCK_R,
        IS_INTERLEAVED,
    )


def rope_triton(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    is_interleaved: bool,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """rope_ref's contract: x [T, H, R] (token and head strides free), positions [T] int64,
    cos/sin [S, R/2] fp32 -> [T, H, R] in x's dtype, contiguous, or written into `out`
    (token and head strides free, unit channel stride) and returned."""
    num_tokens, num_heads, rope_dim = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((num_tokens, num_heads, rope_dim), dtype=x.dtype, device=x.device)
    elif (
        out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or out.stride(2) != 1
    ):
        raise ValueError(
            f"out must be {tuple(x.shape)} {x.dtype} on {x.device} with a unit channel stride, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}, strides {out.stride()}"
        )
    if num_tokens:
        half = rope_dim // 2
        _rope_kernel[(num_tokens,)](
            x,
            positions,
            cos_table,
            sin_table,
            out,
            num_heads,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            HALF=half,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_R=triton.next_power_of_2(half),
            IS_INTERLEAVED=is_interleaved,
            **pdl_launch(x.device),
        )
    return out
