"""Row-parallel linear with a fixed K split: the same bits at every tensor-parallel degree.

A row-parallel weight [N, K] is split along K over the TP ranks, so each rank's partial sum,
and the order the partials are added in, would follow the TP degree. Here K is always cut into
`tp_max` chunks of K / tp_max columns; each chunk's product is an fp32 partial from a
fixed-shape computation, and the chunk partials are added in one fixed binary tree (adjacent
pairs, level by level). A rank at degree tp holds tp_max / tp adjacent chunks, a whole subtree
(tp_max / tp is a power of two), and sums it locally; the TP reduction gathers the fp32 subtree
sums and finishes the same tree in rank order; the result is rounded to the activation dtype
once. At tp 1 one rank runs the whole tree, so every degree gives the same bits by construction.
No collective runs here: comm/ hands in its all_gather and all_reduce (see moe_kernels/combine.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from moe_kernels.linear import linear_ref

Collective = Callable[[torch.Tensor], torch.Tensor]
Gather = Callable[[torch.Tensor], list[torch.Tensor]]


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def local_num_chunks(tp_max: int, tp_size: int, in_local: int) -> int:
    """Chunks a rank holds (tp_max / tp_size), after checking the split fits the weight."""
    if tp_max % tp_size or not is_power_of_two(tp_max // tp_size):
        raise ValueError(
            f"kernels.tp_max ({tp_max}) / parallel.tp_size ({tp_size}) must be a power of two"
        )
    num_chunks = tp_max // tp_size
    if in_local % num_chunks:
        raise ValueError(
            f"a row-parallel weight's {in_local} local input features do not split into "
            f"kernels.tp_max / parallel.tp_size = {num_chunks} chunks"
        )
    return num_chunks


def tree_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of fp32 parts [C] x [T, N] in a fixed binary tree: adjacent pairs, level by level
    ((p0 + p1) + (p2 + p3)) + ...; a level's odd last part moves up unchanged. For C a power of
    two, the tree over parts i*c .. (i+1)*c - 1 is a whole subtree of the tree over all C."""
    if not parts:
        raise ValueError("tree_sum needs at least one part")
    level = list(parts)
    while len(level) > 1:
        # Why: one fixed order for every element, whatever the batch or the TP degree.
        pairs = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        level = pairs + level[len(level) - len(level) % 2 :]
    return level[0]


def chunk_partials_ref(
    x: torch.Tensor, weight: torch.Tensor, num_chunks: int, *, tile_rows: int
) -> list[torch.Tensor]:
    """x [T, K] @ weight [N, K]^T as num_chunks fp32 partials [T, N], chunk c over columns
    c*K/C .. (c+1)*K/C - 1.

    Each partial is linear_ref in fp32 of one [tile_rows, K/C] x [K/C, N] shape, on a fresh
    contiguous copy of the weight chunk: its bits ignore the batch, the other chunks, and where
    the chunk sits in the rank's weight (which would follow the TP degree)."""
    chunk = x.shape[1] // num_chunks
    parts = []
    for c in range(num_chunks):
        cols = slice(c * chunk, (c + 1) * chunk)
        w = weight[:, cols].to(torch.float32, copy=True, memory_format=torch.contiguous_format)
        parts.append(linear_ref(x[:, cols].float(), w, tile_rows=tile_rows))
    return parts


def tp_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, num_chunks: int, *, tile_rows: int
) -> torch.Tensor:
    """This rank's fp32 subtree sum [T, N] of x [T, K_local] @ weight [N, K_local]^T, K_local
    holding num_chunks (a power of two) adjacent chunks of the full K split."""
    if x.shape[1] != weight.shape[1] or x.shape[1] % num_chunks:
        raise ValueError(
            f"x {tuple(x.shape)} and weight {tuple(weight.shape)} need equal input features "
            f"divisible by {num_chunks} chunks"
        )
    return tree_sum(chunk_partials_ref(x, weight, num_chunks, tile_rows=tile_rows))


def finish_tree(subtree: torch.Tensor, all_gather: Gather, out_dtype: torch.dtype):
    """Gather every TP rank's fp32 subtree sum (rank order), finish the tree, round once."""
    return tree_sum(all_gather(subtree)).to(out_dtype)


def row_parallel_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    tp_size: int,
    all_gather: Gather,
    all_reduce: Collective,
    *,
    tp_max: int,
    tile_rows: int,
    tp_rank: int = 0,
) -> torch.Tensor:
    """sum over the TP group of x [T, K_local] @ weight [N, K_local]^T -> [T, N] in x's dtype,
    the same bits at every tp_size dividing tp_max. Collective (all_gather) when tp_size > 1:
    every TP rank calls it in the same order. tp_rank (the rank's place in the group) is part
    of the op's signature for the GPU kernel's K grid; each chunk here is a fresh copy whose
    sum ignores where it sits."""
    num_chunks = local_num_chunks(tp_max, tp_size, x.shape[1])
    return finish_tree(
        tp_linear_ref(x, weight, num_chunks, tile_rows=tile_rows), all_gather, x.dtype
    )


def row_parallel_linear_fast(
    x: torch.Tensor,
    weight: torch.Tensor,
    tp_size: int,
    all_gather: Gather,
    all_reduce: Collective,
    tp_rank: int = 0,
) -> torch.Tensor:
    """The plain engine: one GEMM over the local K, then the backend's all_reduce of the
    partials in the activation dtype (its ring/tree chosen by message size); tp_rank unused."""
    return all_reduce(F.linear(x, weight))
