"""Fixed-shape row tiles: the one trick behind every invariant CPU kernel.

CPU BLAS and torch's reduction kernels pick their code path from the tensor shape, so a
row's bits can depend on how many other rows share the call. Running every call on tiles of
exactly `tile_rows` rows (the last one zero-padded) fixes the shape, and with it each row's
result. This module only slices and pads; it computes nothing itself.
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
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_rows: int
) -> torch.Tensor:
    """Apply fn to [tile_rows, ...] tiles of x [T, ...]; return the first T output rows.

    fn must treat rows independently. With T == 0, fn still runs once on a zero tile so the
    empty result has fn's trailing shape and dtype.
    """
    num_rows = x.shape[0]
    tiles = pad_rows(x, tile_rows).split(tile_rows)
    return torch.cat([fn(tile) for tile in tiles])[:num_rows]
