"""Row-parallel linear with the fixed tp_max K split as Triton kernels (GPU path).

The chunk partials come from moe_kernels/triton_split_k.launch_split_k, one program axis per chunk:
each chunk's fp32 sum starts from zero and walks its K / tp_max columns in BLOCK_K steps
ascending on a grid fixed in the whole weight's columns (a rank passes its K offset), the same
sequence whichever rank or TP degree holds the chunk; at tp 1 every step but a chunk's first
and last loads aligned columns (chunk bounds need not be: the dense mlp_down's 1368). The fp32
parts are added in moe_kernels/tp_linear.py's fixed binary tree (adjacent pairs, level by level)
and rounded once. `tree_sum_triton` makes the same adds over the ranks' gathered subtree sums.
Oracle: `row_parallel_linear_ref`; the tree adds match it bitwise given the same partials.
Under TRITON_INTERPRET=1 the kernels run on CPU tensors (tests); compiled, they need CUDA.
"""

from __future__ import annotations

import torch

from moe_kernels.config import MAX_TP_MAX
from moe_kernels.tp_linear import Collective, Gather, is_power_of_two, local_num_chunks
from moe_kernels.triton_chunk_tree import MAX_TREE_CHUNKS, linear_chunk_tree, tree_block_k
from moe_kernels.triton_dot import check_pair
from moe_kernels.triton_linear import linear_triton
from moe_kernels.triton_linear_config import (
    BLOCK_K_16BIT,
    POINTER_CONFIG_16BIT,
    LinearConfig,
    linear_config,
)
from moe_kernels.triton_split_k import launch_split_k, sum_parts_triton

# Where the in-program tree (moe_kernels/triton_chunk_tree.linear_chunk_tree) replaces the chunk
# launch: short chunks (o_proj 256, shared experts' down 352 columns at tp_max 8) from TREE_MIN_ROWS
# rows, measured on the H200 under graph replay (BENCHMARKS.md, row-parallel section): there
# the fp32 parts' traffic outweighs the chunks' parallelism. Chunks of whole 64-column steps
# cross over at 256 rows (o_proj 13.2 vs 14.1 us), others at 512 (32-column steps: twice the
# loop; shared down 28.7 vs 33.7 us at 512, 26.8 vs 18.9 at 256). Long chunks (the dense
# mlp_down, 1368) keep the chunk launch. Both paths make the same adds.
TREE_MIN_ROWS = {64: 256, 32: 512, 16: 512}  # by the tree's K step (tree_block_k)
TREE_MAX_CHUNK_K = 512


# The kernel's waiting subtrees (tree_push) hold up to 8 parts: 16 in all, the largest
# kernels.tp_max (one bound, kept in the config the user sets).
MAX_TREE_SUM_PARTS = MAX_TP_MAX


def tree_sum_triton(
    parts: torch.Tensor, out_dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """parts [C, T, N] fp32, C a power of two -> [T, N] in out_dtype: the fixed tree of
    moe_kernels/tp_linear.tree_sum, rounded once; written into `out` (contiguous) when given."""
    num_parts = parts.shape[0]
    if (
        parts.dtype != torch.float32
        or parts.dim() != 3
        or not is_power_of_two(num_parts)
        or num_parts > MAX_TREE_SUM_PARTS
    ):
        raise ValueError(
            f"parts must be fp32 [C, T, N] with C a power of two <= {MAX_TREE_SUM_PARTS}, got "
            f"{parts.dtype} {tuple(parts.shape)}"
        )
    parts = parts.contiguous()
    if out is None:
        out = torch.empty(parts.shape[1:], dtype=out_dtype, device=parts.device)
    elif out.shape != parts.shape[1:] or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {tuple(parts.shape[1:])} {out_dtype}")
    return sum_parts_triton(parts, out, is_tree=True)


def tp_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, num_chunks: int, *, k_origin: int = 0
) -> torch.Tensor:
    """This rank's fp32 subtree sum [T, N] of x [T, K_local] @ weight [N, K_local]^T, K_local
    holding num_chunks (a power of two) adjacent chunks of the full K split, the first at the
    whole weight's column k_origin (rank * K_local)."""
    return _tp_linear(x, weight, num_chunks, torch.float32, k_origin)


def chunk_launch(
    out_dim: int, in_dim: int, dtype: torch.dtype, num_rows: int
) -> tuple[LinearConfig, int]:
    """(tiles, chunks a program sums) of the chunk-parallel launch, by row count: the chunks
    already give every weight tp_max times the column programs, and from 129 to 512 rows a
    program sums two adjacent chunks (half the fp32 parts in memory). The fastest of a sweep on the
    row-parallel V2-Lite weights under graph replay (BENCHMARKS.md, row-parallel section).
    Neither moves a sum's order. fp32 keeps the linear's tiles (its own K step)."""
    if dtype == torch.float32:
        return linear_config(out_dim, in_dim, dtype, num_rows), 1
    if num_rows <= 16:
        return LinearConfig(16, 32, BLOCK_K_16BIT, 8, 4, 6), 1
    if num_rows <= 64:
        return LinearConfig(64, 64, BLOCK_K_16BIT, 8, 4, 4), 1
    if num_rows <= 512:
        return LinearConfig(128, 64, BLOCK_K_16BIT, 8, 8, 3), 1 if num_rows <= 128 else 2
    return POINTER_CONFIG_16BIT, 1  # the dense mlp_down at prefill (2 a program: 1.1-1.3x)


def _tp_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    num_chunks: int,
    out_dtype: torch.dtype,
    k_origin: int,
    arrivals: torch.Tensor | None = None,
) -> torch.Tensor:
    check_pair(x, weight, 2)
    if x.shape[1] % num_chunks or not is_power_of_two(num_chunks):
        raise ValueError(
            f"{x.shape[1]} input features need a power-of-two chunk count dividing them, "
            f"got {num_chunks}"
        )
    x, weight = x.contiguous(), weight.contiguous()
    num_rows, chunk_k = x.shape[0], x.shape[1] // num_chunks
    block_k = tree_block_k(chunk_k, x.dtype)
    if (
        block_k
        and num_rows >= TREE_MIN_ROWS[block_k]
        and chunk_k <= TREE_MAX_CHUNK_K
        and num_chunks <= MAX_TREE_CHUNKS
    ):
        # The same adds in one launch: prefill-sized calls skip the fp32 partials' traffic.
        return linear_chunk_tree(x, weight, num_chunks, out_dtype)
    return launch_tp_chunks(x, weight, num_chunks, out_dtype, k_origin=k_origin, arrivals=arrivals)


def launch_tp_chunks(
    x: torch.Tensor,
    weight: torch.Tensor,
    num_chunks: int,
    out_dtype: torch.dtype,
    *,
    k_origin: int = 0,
    arrivals: torch.Tensor | None = None,
) -> torch.Tensor:
    """The chunk-launch path of the tp_max split (x, weight contiguous; num_chunks a power of
    two dividing K): the chunk programs and their tree, on chunk_launch's tiles -> [T, N] in
    out_dtype. The in-program tree (linear_chunk_tree) makes the same adds."""
    num_rows, chunk_k = x.shape[0], x.shape[1] // num_chunks
    out = torch.empty((num_rows, weight.shape[0]), dtype=out_dtype, device=x.device)
    if num_rows:
        config, per_program = chunk_launch(weight.shape[0], x.shape[1], x.dtype, num_rows)
        launch_split_k(
            x,
            weight,
            out,
            chunk_k,
            config,
            is_tree=True,
            k_origin=k_origin,
            chunks_per_program=min(per_program, num_chunks),
            arrivals=arrivals,
        )
    return out


def row_parallel_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    tp_size: int,
    all_gather: Gather,
    all_reduce: Collective,
    *,
    tp_max: int,
    tp_rank: int = 0,
    arrivals: torch.Tensor | None = None,
) -> torch.Tensor:
    """row_parallel_linear_ref's contract on the GPU: the same tree at every tp_size dividing
    tp_max, rounded to x's dtype once. tp_rank: this rank's place in the group (its K slice
    starts at tp_rank * K_local); arrivals: see launch_split_k. Collective (all_gather) when
    tp_size > 1."""
    if tp_max == 1:
        # No K split promised (TP degree 1 only: batch invariance without TP invariance): the
        # plain invariant linear, its own shape-fixed tiles and K split.
        return linear_triton(x, weight, arrivals=arrivals)
    num_chunks = local_num_chunks(tp_max, tp_size, x.shape[1])
    if tp_size == 1:  # the whole tree on this rank: round inside the tree launch
        return _tp_linear(x, weight, num_chunks, x.dtype, 0, arrivals)
    subtree = _tp_linear(x, weight, num_chunks, torch.float32, tp_rank * x.shape[1], arrivals)
    return tree_sum_triton(torch.stack(all_gather(subtree)), x.dtype)
