"""RMSNorm with HF DeepSeek semantics: fp32 statistics, weight applied in the input dtype.

`rms_norm_ref` reduces each row inside a fixed-shape tile, so the mean's summation order
(vectorisation, thread split) is chosen by `tile_rows`, never by the batch. `rms_norm_fast`
is the same math on the whole batch: with several threads torch splits a long single-row
reduction across threads but not a many-row one, which the negative control shows.
"""

from __future__ import annotations

import torch

from kernels.tiling import map_row_tiles


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
