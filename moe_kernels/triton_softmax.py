"""Batch-invariant softmax and log-softmax over the last dim as one Triton kernel (GPU path).

One program per row: an online pass keeps a per-lane running max and rescaled sum over
blocks of a fixed width chosen from V alone, reduces them once, then a second pass writes
fp32 outputs. From SPLIT_MIN_V columns (an LM head's vocabulary) a row is cut into parts of
PART_V columns, a program each: each part's (max, sum) as above, then every part's program
combines all parts' in part order (the same tree each time) and writes its columns; a row
alone had kept one program busy for the whole vocabulary (26 us at 102400 on the H200). Every
reduction order is fixed by V, never by the number of rows.
Oracles: `softmax_ref` / `log_softmax_ref` (moe_kernels/softmax.py), always fp32 output.
Under TRITON_INTERPRET=1 the kernel runs on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from moe_kernels.triton_pdl import pdl_launch, pdl_start

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_BLOCK_V = 4096
SPLIT_MIN_V = 32768  # rows at least this wide are cut into parts (a function of V only)
PART_V = 8192  # columns of a part: a multiple of MAX_BLOCK_V


@triton.jit
def _lane_stats(x_row, start, end, BLOCK_V: tl.constexpr):
    """(max, sum of exp(x - max)) of x_row[start:end]: lane i folds elements start + i,
    start + i + BLOCK_V, ... in order, then one tree reduction. An all -inf range: (-inf, 0)."""
    offs = tl.arange(0, BLOCK_V)
    lane_max = tl.full((BLOCK_V,), float("-inf"), dtype=tl.float32)
    lane_sum = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for v0 in range(start, end, BLOCK_V):
        x = tl.load(x_row + v0 + offs, mask=v0 + offs < end, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        # A lane that has seen only -inf keeps sum 0 (exp(-inf - 0) == 0, no NaN).
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
    part_max = tl.max(lane_max, axis=0)
    shift = tl.where(part_max == float("-inf"), 0.0, part_max)
    part_sum = tl.sum(lane_sum * tl.exp(lane_max - shift), axis=0)
    return part_max, part_sum


@triton.jit
def _write_range(
    x_row, out_row, start, end, row_max, row_sum, IS_LOG: tl.constexpr, BLOCK_V: tl.constexpr
):
    """out_row[start:end]: log-softmax (x - max - log(sum)) or softmax (exp(x - max) / sum)."""
    log_sum = tl.log(row_sum)
    offs = tl.arange(0, BLOCK_V)
    for v0 in range(start, end, BLOCK_V):
        mask = v0 + offs < end
        x = tl.load(x_row + v0 + offs, mask=mask, other=0.0).to(tl.float32)
        if IS_LOG:
            y = x - row_max - log_sum
        else:
            y = tl.exp(x - row_max) / row_sum
        tl.store(out_row + v0 + offs, y, mask=mask)


@triton.jit
def _softmax_kernel(
    x_ptr, out_ptr, V, IS_LOG: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr = False
):
    pdl_start(PDL)
    # Why: lane i folds elements i, i + BLOCK_V, ... in order, then one tree reduction;
    # all of it is fixed by V and BLOCK_V, and a row is never split across programs.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * V
    row_max, row_sum = _lane_stats(x_row, 0, V, BLOCK_V)
    _write_range(x_row, out_ptr + row * V, 0, V, row_max, row_sum, IS_LOG, BLOCK_V)


@triton.jit
def _part_stats_kernel(
    x_ptr,
    stats_ptr,
    V,
    num_parts,
    PART_V: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """stats[row, part] = (max, sum) of the row's columns [part * PART_V, + PART_V)."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    start = part * PART_V
    part_max, part_sum = _lane_stats(x_ptr + row * V, start, tl.minimum(start + PART_V, V), BLOCK_V)
    slot = stats_ptr + (row * num_parts + part) * 2
    tl.store(slot, part_max)
    tl.store(slot + 1, part_sum)


@triton.jit
def _part_write_kernel(
    x_ptr,
    stats_ptr,
    out_ptr,
    V,
    num_parts,
    IS_LOG: tl.constexpr,
    PART_V: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The row's max and sum from every part's stats (in one fixed tree: each of the row's
    programs gets the same), then this part's outputs."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.arange(0, BLOCK_P)
    parts_ok = parts < num_parts
    slots = stats_ptr + (row * num_parts + parts) * 2
    part_max = tl.load(slots, mask=parts_ok, other=float("-inf"))
    part_sum = tl.load(slots + 1, mask=parts_ok, other=0.0)
    row_max = tl.max(part_max, axis=0)
    scale = tl.where(part_max == float("-inf"), 0.0, tl.exp(part_max - row_max))
    row_sum = tl.sum(part_sum * scale, axis=0)
    start = part * PART_V
    end = tl.minimum(start + PART_V, V)
    _write_range(x_ptr + row * V, out_ptr + row * V, start, end, row_max, row_sum, IS_LOG, BLOCK_V)


def _run(x: torch.Tensor, is_log: bool) -> torch.Tensor:
    allowed = ("cpu", "cuda") if isinstance(_softmax_kernel, InterpretedFunction) else ("cuda",)
    if x.device.type not in allowed:
        raise ValueError(f"x must be on a device of type {allowed}, got {x.device}")
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"x must be [T, V] with V >= 1, got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x dtype must be one of {_DTYPES}, got {x.dtype}")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return out
    num_rows, vocab = x.shape
    block_v = min(triton.next_power_of_2(vocab), MAX_BLOCK_V)  # a function of V only
    num_warps = 8 if block_v >= 2048 else 4
    if vocab < SPLIT_MIN_V:
        _softmax_kernel[(num_rows,)](
            x,
            out,
            vocab,
            IS_LOG=is_log,
            BLOCK_V=block_v,
            num_warps=num_warps,
            **pdl_launch(x.device),
        )
        return out
    num_parts = triton.cdiv(vocab, PART_V)
    stats = torch.empty((num_rows, num_parts, 2), dtype=torch.float32, device=x.device)
    grid = (num_rows, num_parts)
    _part_stats_kernel[grid](
        x,
        stats,
        vocab,
        num_parts,
        PART_V=PART_V,
        BLOCK_V=block_v,
        num_warps=num_warps,
        **pdl_launch(x.device),
    )
    _part_write_kernel[grid](
        x, stats, out, vocab, num_parts, IS_LOG=is_log, PART_V=PART_V, BLOCK_V=block_v,
        BLOCK_P=max(triton.next_power_of_2(num_parts), 2), num_warps=num_warps,
        **pdl_launch(x.device),
    )  # fmt: skip
    return out


def softmax_triton(x: torch.Tensor) -> torch.Tensor:
    """x [T, V] any float dtype -> fp32 [T, V]."""
    return _run(x, is_log=False)


def log_softmax_triton(x: torch.Tensor) -> torch.Tensor:
    """x [T, V] any float dtype -> fp32 [T, V] log-probabilities."""
    return _run(x, is_log=True)
