"""Softmax and log-softmax over the last dim, always returning fp32.

The invariant versions run torch's row kernels on fixed-shape tiles so that the max/sum
reductions follow a plan chosen by `tile_rows` alone. On the 2-core CPU plain torch was
measured batch-invariant for these ops too (its kernels parallelise over rows only), so the
fast versions have no CPU negative control; the tiling is kept for the uniform contract and
for the GPU kernels it is the oracle of.
"""

from __future__ import annotations

import torch

from moe_kernels.tiling import map_row_tiles


def softmax_fast(x: torch.Tensor) -> torch.Tensor:
    """x [T, V] any float dtype -> fp32 [T, V]."""
    return torch.softmax(x, dim=-1, dtype=torch.float32)


def log_softmax_fast(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x, dim=-1, dtype=torch.float32)


def softmax_ref(x: torch.Tensor, *, tile_rows: int) -> torch.Tensor:
    # Why: fixed [tile_rows, V] shape, so the row max and row sum never see the batch size.
    return map_row_tiles(softmax_fast, x, tile_rows)


def log_softmax_ref(x: torch.Tensor, *, tile_rows: int) -> torch.Tensor:
    return map_row_tiles(log_softmax_fast, x, tile_rows)
