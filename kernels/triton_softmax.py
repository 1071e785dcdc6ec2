"""Batch-invariant softmax and log-softmax over the last dim as one Triton kernel (GPU path).

One program per row: an online pass keeps a per-lane running max and rescaled sum over
blocks of a fixed width chosen from V alone, reduces them once, then a second pass writes
fp32 outputs. Every reduction order is fixed by V, never by the number of rows.
Oracles: `softmax_ref` / `log_softmax_ref` (kernels/softmax.py), always fp32 output.
Under TRITON_INTERPRET=1 the kernel runs on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_BLOCK_V = 4096


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, V, IS_LOG: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * V
    out_row = out_ptr + row * V
    offs = tl.arange(0, BLOCK_V)
    # Why: lane i folds elements i, i + BLOCK_V, ... in order, then one tree reduction;
    # all of it is fixed by V and BLOCK_V, and a row is never split across programs.
    lane_max = tl.full((BLOCK_V,), float("-inf"), dtype=tl.float32)
    lane_sum = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(x_row + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        # A lane that has seen only -inf keeps sum 0 (exp(-inf - 0) == 0, no NaN).
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    row_sum = tl.sum(lane_sum * tl.exp(lane_max - row_max), axis=0)
    log_sum = tl.log(row_sum)
    for v0 in range(0, V, BLOCK_V):
        mask = v0 + offs < V
        x = tl.load(x_row + v0 + offs, mask=mask, other=0.0).to(tl.float32)
        if IS_LOG:
            y = x - row_max - log_sum
        else:
            y = tl.exp(x - row_max) / row_sum
        tl.store(out_row + v0 + offs, y, mask=mask)


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
    block_v = min(triton.next_power_of_2(x.shape[1]), MAX_BLOCK_V)  # a function of V only
    _softmax_kernel[(x.shape[0],)](
        x, out, x.shape[1], IS_LOG=is_log, BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4
    )
    return out


def softmax_triton(x: torch.Tensor) -> torch.Tensor:
    """x [T, V] any float dtype -> fp32 [T, V]."""
    return _run(x, is_log=False)


def log_softmax_triton(x: torch.Tensor) -> torch.Tensor:
    """x [T, V] any float dtype -> fp32 [T, V] log-probabilities."""
    return _run(x, is_log=True)
