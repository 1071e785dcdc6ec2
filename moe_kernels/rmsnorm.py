"""RMSNorm with HF DeepSeek semantics: fp32 statistics, weight applied in the input dtype.

`rms_norm_ref` reduces each row inside a fixed-shape tile, so the mean's summation order
(vectorisation, thread split) is chosen by `tile_rows`, never by the batch. `rms_norm_fast`
is the same math on the whole batch: with several threads torch splits a long single-row
reduction across threads but not a many-row one, which the negative control shows.
`add_rms_norm_*`: the residual add before a norm and the norm as one op of the table (on CUDA
one launch, moe_kernels/triton_rmsnorm.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from moe_kernels.tiling import map_row_tiles


def rms_norm_fast(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D], weight [D] -> [T, D] (promoted dtype of weight and x), as HF DeepSeek."""
    x32 = x.float()
    var = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(var + eps)).to(x.dtype)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, tile_rows: int
) -> torch.Tensor:
    # Why: the row mean runs on a [tile_rows, D] tensor, so its reduction plan is fixed.
    return map_row_tiles(lambda tile: rms_norm_fast(tile, weight, eps), x, tile_rows)


def add_rms_norm_composed(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *, rms_norm: Callable
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm after it: x, delta [T, D] (one dtype), weight [D] ->
    (x + delta, rms_norm(x + delta)); rms_norm: the table's op (rms_norm_ref's contract)."""
    total = x + delta
    return total, rms_norm(total, weight, eps)


def add_rms_norm_ref(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *, tile_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    norm = partial(rms_norm_ref, tile_rows=tile_rows)
    return add_rms_norm_composed(x, delta, weight, eps, rms_norm=norm)


def add_rms_norm_fast(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rms_norm_composed(x, delta, weight, eps, rms_norm=rms_norm_fast)
