"""Fixed-shape row tiles: the one trick behind every invariant CPU kernel.

CPU BLAS and torch's reduction kernels pick their code path from the tensor shape, so a
row's bits can depend on how many other rows share the call. Running every call on tiles of
exactly `tile_rows` rows (the last one zero-padded) fixes the shape, and with it each row's
result. Each tile is copied into a fresh buffer, so a row's memory alignment never follows its
offset in the batch. This module only slices and pads; it computes nothing itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def pad_rows(x: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """Zero-pad x [T, ...] along dim 0 up to a multiple of tile_rows (at least one tile)."""
    num_pad = -x.shape[0] % tile_rows if x.shape[0] else tile_rows
    if num_pad == 0:
        return x
    return torch.cat([x, x.new_zeros((num_pad, *x.shape[1:]))])


def map_row_tiles(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    tile_rows: int,
    *,
    num_cols: int | None = None,
) -> torch.Tensor:
    """Apply fn to [tile_rows, ...] tiles of x [T, ...]; return the first T output rows.

    fn must treat rows independently. num_cols (x 2-D only) zero-pads the last dim to that
    width. With T == 0, fn still runs once on a zero tile so the empty result has fn's
    trailing shape and dtype.
    """
    num_rows, *trailing = x.shape
    if num_cols is not None:
        trailing[-1] = num_cols
    outs = []
    for start in range(0, max(num_rows, 1), tile_rows):
        rows = x[start : start + tile_rows]
        # Why: a fresh, allocator-aligned buffer of one fixed shape per tile. A view into x
        # would start at an address set by the batch (an expert's first row, an odd width),
        # and on some BLAS paths alignment changes bits.
        tile = x.new_zeros((tile_rows, *trailing))
        tile[: rows.shape[0], ..., : x.shape[-1]] = rows
        outs.append(fn(tile))
    return torch.cat(outs)[:num_rows]
