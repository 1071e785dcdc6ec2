"""The fixed K split as parallel programs (GPU path): each chunk sums from zero in its own
program (`_split_k_kernel`), and the fp32 chunk sums are added in chunk order or in the fixed
binary tree, by the last program of each tile to finish (up to FOLD_MAX_ROWS rows, a per-tile
arrival count) or by an elementwise launch (`sum_parts_triton`), or (the tree, any row count)
handed up the tree by the programs as they finish (`_hand_off`); every way the same adds.
Serves the linear's split of narrow weights (moe_kernels/triton_linear.py) and the TP row-parallel
linear (moe_kernels/triton_tp_linear.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from moe_kernels.triton_dot import dot_k_grid, kernel_consts, sum_parts, tile_of, tree_push
from moe_kernels.triton_linear_config import POINTER_CONFIG_16BIT, LinearConfig, k_align
from moe_kernels.triton_pdl import pdl_launch, pdl_start


@triton.jit(do_not_specialize=["num_rows"])
def _split_k_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    parts_ptr,
    arrivals_ptr,
    num_rows,
    N,
    K,
    stride_xm,
    stride_om,
    k_phase,
    CHUNK_K: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_PER_PROGRAM: tl.constexpr,
    IS_TREE: tl.constexpr,
    K_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    FINISH: tl.constexpr,
    HANDOFF: tl.constexpr,
    NUM_LEVELS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Chunks p * G .. p * G + G - 1 (G = CHUNKS_PER_PROGRAM, p = program_id(1)) of a fixed K
    split for out's tile program_id(0): chunk c's fp32 sum from zero over columns
    [c * CHUNK_K, min((c + 1) * CHUNK_K, K)) in BLOCK_K steps, the G sums added as the binary
    tree's subtree (G > 1 needs IS_TREE), stored to parts[p]. The tile's last program to
    arrive (a count per tile, `arrivals`) adds the NUM_CHUNKS / G parts in the fixed order --
    chunk order, or the rest of the binary tree (IS_TREE) -- rounds once to out's dtype, and
    zeroes the count for the next launch (FINISH; otherwise a second launch adds them).
    Which program finishes depends on timing; which adds it makes, and their order, do not.
    The K steps lie on a grid of BLOCK_K columns fixed in the whole weight's
    columns: local column k is whole column k + k_phase (mod BLOCK_K), so a chunk's sum is the
    same chain of steps whichever TP rank holds it, and at k_phase 0 every step but a chunk's
    first and last is aligned. HANDOFF (the tree): a tile's programs are adjacent in launch
    order (program_id(0) is the program) and add their subtrees level by level as they finish
    (_hand_off), each fp32 part written once and read once, no second launch."""
    pdl_start(PDL)
    NUM_PARTS: tl.constexpr = NUM_CHUNKS // CHUNKS_PER_PROGRAM
    if HANDOFF:
        tile = tl.program_id(1)
        program = tl.program_id(0)
    else:
        tile = tl.program_id(0)
        program = tl.program_id(1)
    pid_m, pid_n = tile_of(tile, tl.cdiv(num_rows, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < num_rows
    col_ok = offs_n < N
    mask = row_ok[:, None] & col_ok[None, :]
    # The subtree's waiting halves (tree_push); each is written before it is read.
    s0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s1 = s0
    s2 = s0
    s3 = s0
    for g in tl.static_range(CHUNKS_PER_PROGRAM):
        k_lo = (program * CHUNKS_PER_PROGRAM + g) * CHUNK_K
        chunk_sum = dot_k_grid(
            x_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, stride_xm, K,
            k_lo - (k_lo + k_phase) % BLOCK_K, k_lo, tl.minimum(k_lo + CHUNK_K, K), BLOCK_M,
            BLOCK_N, BLOCK_K, INPUT_PRECISION, UPCAST_DOT, K_ALIGN,
        )  # fmt: skip
        acc, s0, s1, s2, s3 = tree_push(chunk_sum, s0, s1, s2, s3, g, CHUNKS_PER_PROGRAM)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if NUM_PARTS == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    elif HANDOFF:
        tile_offs = offs_m[:, None] * N + offs_n[None, :]
        acc, holds = _hand_off(
            acc, parts_ptr, arrivals_ptr, tile, program, tile_offs,
            num_rows.to(tl.int64) * N, mask, NUM_PARTS, NUM_LEVELS,
        )  # fmt: skip
        if holds:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part_elems = num_rows.to(tl.int64) * N
        tile_offs = offs_m[:, None] * N + offs_n[None, :]
        tl.store(parts_ptr + program * part_elems + tile_offs, acc, mask=mask)
        if FINISH:
            # Every thread's part is in memory before the count says so (release); the
            # finisher reads the others' parts after its count (acquire), past the SM's L1.
            tl.debug_barrier()
            arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == NUM_PARTS - 1:
                total = sum_parts(parts_ptr, tile_offs, part_elems, mask, NUM_PARTS, IS_TREE)
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(arrivals_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _hand_off(
    acc, parts_ptr, nodes_ptr, tile, program, tile_offs, part_elems, mask,
    NUM_PARTS: tl.constexpr, NUM_LEVELS: tl.constexpr,
):  # fmt: skip
    """The top NUM_LEVELS levels of the binary tree over a tile's NUM_PARTS programs, each
    holding its subtree's fp32 sum in acc. At each level the two holders of sibling subtrees
    meet at their node (an arrival count and a flag a node, tile-major in nodes_ptr): the
    first to arrive stores its sum to parts[program], publishes its program id in the flag
    and drops out; the second waits for the flag, loads that sum and adds the pair left +
    right (by program id, not by arrival), then climbs. Returns (acc, holds): holds is 1 in
    the program left holding the whole tree, which zeroes the tile's nodes for the next
    launch. Why no deadlock: a program only waits for one that has already arrived, so is
    resident and stores without waiting. Which program climbs depends on timing; the adds
    and their order do not."""
    NUM_NODES: tl.constexpr = NUM_PARTS - 1
    tile_nodes = nodes_ptr + tile.to(tl.int64) * (2 * NUM_NODES)
    holds = 1
    for level in tl.static_range(NUM_LEVELS):
        if holds == 1:
            node = NUM_PARTS - (NUM_PARTS >> level) + (program >> (level + 1))
            arrived = tl.atomic_add(tile_nodes + 2 * node, 1, sem="acq_rel", scope="gpu")
            if arrived == 0:
                tl.store(parts_ptr + program * part_elems + tile_offs, acc, mask=mask)
                # Every thread's store is in memory before the flag says so (release).
                tl.debug_barrier()
                tl.atomic_xchg(tile_nodes + 2 * node + 1, program + 1, sem="release", scope="gpu")
                holds = 0
            else:
                sibling = 0  # the flag: the first's program id + 1 once its sum is stored
                while sibling == 0:
                    sibling = tl.atomic_add(
                        tile_nodes + 2 * node + 1, 0, sem="acquire", scope="gpu"
                    )
                other = tl.load(
                    parts_ptr + (sibling - 1) * part_elems + tile_offs, mask=mask, other=0.0,
                    cache_modifier=".cg",
                )  # fmt: skip
                if sibling - 1 < program:
                    acc = other + acc
                else:
                    acc = acc + other
    if holds == 1:
        for i in tl.static_range(2 * NUM_NODES):
            tl.atomic_xchg(tile_nodes + i, 0, sem="relaxed", scope="gpu")
    return acc, holds


@triton.jit
def _sum_parts_kernel(
    parts_ptr, out_ptr, num_elems, NUM_PARTS: tl.constexpr, IS_TREE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """out = sum_parts of the fp32 parts [NUM_PARTS, num_elems], rounded to out's dtype once."""
    pdl_start(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_elems
    total = sum_parts(parts_ptr, offs, num_elems, ok, NUM_PARTS, IS_TREE)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


SUM_PARTS_BLOCK = 1024  # elements per _sum_parts_kernel program: a launch shape, not an order


def sum_parts_triton(parts: torch.Tensor, out: torch.Tensor, *, is_tree: bool) -> torch.Tensor:
    """out (contiguous, [T, N]) = the fp32 parts [C, T, N] (contiguous) added by sum_parts."""
    num_elems = out.numel()
    if num_elems:
        _sum_parts_kernel[(triton.cdiv(num_elems, SUM_PARTS_BLOCK),)](
            parts, out, num_elems, NUM_PARTS=parts.shape[0], IS_TREE=is_tree,
            BLOCK=SUM_PARTS_BLOCK, **pdl_launch(parts.device)
        )  # fmt: skip
    return out


SPLIT_ROW_CHUNK = 4096  # rows per split launch: bounds the partials to S x 4096 x N fp32


# Up to this many rows a split-K launch's last program per tile adds the parts (one launch
# fewer); above, the tiles' finishing programs serialise at the kernel's end and a separate
# elementwise launch is faster (H200, graph replay: o_proj 6.5 vs 7.1 us at 1 row, 9.8 vs
# 8.5 at 64; BENCHMARKS.md, row-parallel section).
FOLD_MAX_ROWS = 16
# Counts for a folded launch's tiles (<= 16 rows x N / 32 columns, N <= 131072) or a
# hand-off launch's tree nodes (2 x (parts - 1) a tile: 2 parts on 128 x 128 tiles of 4096
# rows cover N <= 32768); a launch that needs more gets fresh zeros.
NUM_ARRIVAL_COUNTS = 16384


def arrival_counts(device: torch.device | str) -> torch.Tensor:
    """Zeroed per-tile arrival counts for folded split-K launches (launch_split_k's
    `arrivals`). Each launch leaves them at zero, so one buffer serves every launch of one
    stream (the op table holds one); made outside any CUDA graph capture, it is the address
    every captured step reuses."""
    return torch.zeros(NUM_ARRIVAL_COUNTS, dtype=torch.int32, device=device)


def launch_split_k(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    chunk_k: int,
    config: LinearConfig,
    *,
    is_tree: bool,
    k_origin: int = 0,
    chunks_per_program: int = 1,
    arrivals: torch.Tensor | None = None,
    is_handoff: bool = False,
) -> torch.Tensor:
    """out [M, N] (unit column stride) = x [M, K] @ weight [N, K]^T through a fixed K split:
    chunks of chunk_k columns (the last may be shorter), each an fp32 sum from zero, added in
    chunk order or in the binary tree (is_tree; the chunk count a power of two) and rounded
    once to out's dtype. k_origin: the whole weight's column of weight's first one (a TP
    rank's offset): the K steps' grid is fixed in whole-weight columns. chunks_per_program
    (a power of two dividing the chunk count; > 1 only for the tree): adjacent chunks one
    program sums as their subtree, fewer parts in memory. One launch per
    SPLIT_ROW_CHUNK rows (launch boundaries only): chunk programs in parallel; up to
    FOLD_MAX_ROWS rows the last one of each tile adds the fp32 parts, above a second launch
    does (the same adds). arrivals: zeroed counts (arrival_counts) the folded launch uses and
    leaves at zero, shared only by launches of one stream; None or too few: fresh zeros for
    this call (a memset; inside a CUDA graph capture, a memset node). is_handoff (the tree
    only): at any row count a tile's programs add their subtrees as they finish (_hand_off:
    one fp32 part stored and loaded per program but the last, no second launch), with two
    counts per tree node and tile from `arrivals`."""
    num_rows, (out_dim, in_dim) = x.shape[0], weight.shape
    num_chunks = triton.cdiv(in_dim, chunk_k)
    num_parts = num_chunks // chunks_per_program
    if chunks_per_program > 1 and (not is_tree or num_parts * chunks_per_program != num_chunks):
        raise ValueError(
            f"{chunks_per_program} chunks a program need the tree and must divide {num_chunks}"
        )
    if is_handoff and not is_tree:
        raise ValueError("the hand-off adds subtrees in arrival pairs: it needs the tree")
    if config.is_persistent:
        config = POINTER_CONFIG_16BIT  # the pointer kernel's K loop, with the chunk axis
    k_phase = k_origin % config.block_k
    # Chunk bounds and step starts (congruent to -k_phase) are multiples of this.
    align = k_align(math.gcd(chunk_k, in_dim, k_phase or config.block_k))
    for start in range(0, num_rows, SPLIT_ROW_CHUNK):
        rows = min(SPLIT_ROW_CHUNK, num_rows - start)
        parts = torch.empty((num_parts, rows, out_dim), dtype=torch.float32, device=x.device)
        num_tiles = triton.cdiv(rows, config.block_m) * triton.cdiv(out_dim, config.block_n)
        is_folded = rows <= FOLD_MAX_ROWS or num_parts == 1 or is_handoff
        counts = parts  # unread unless folded
        if is_folded and num_parts > 1:
            num_counts = num_tiles * (2 * (num_parts - 1) if is_handoff else 1)
            counts = arrivals
            if counts is None or counts.numel() < num_counts or counts.device != x.device:
                counts = torch.zeros(num_counts, dtype=torch.int32, device=x.device)
        part_out = out[start : start + rows]
        grid = (num_parts, num_tiles) if is_handoff else (num_tiles, num_parts)
        _split_k_kernel[grid](
            x[start:],
            weight,
            part_out,
            parts,
            counts,
            rows,
            out_dim,
            in_dim,
            x.stride(0),
            out.stride(0),
            k_phase,
            CHUNK_K=chunk_k,
            NUM_CHUNKS=num_chunks,
            CHUNKS_PER_PROGRAM=chunks_per_program,
            IS_TREE=is_tree,
            K_ALIGN=align,
            FINISH=is_folded,
            HANDOFF=is_handoff and num_parts > 1,
            NUM_LEVELS=num_parts.bit_length() - 1,
            **kernel_consts(config, x.dtype, weight.dtype),
            **pdl_launch(x.device),
        )
        if not is_folded:
            if part_out.is_contiguous():
                sum_parts_triton(parts, part_out, is_tree=is_tree)
            else:
                part_out.copy_(sum_parts_triton(parts, torch.empty_like(part_out), is_tree=is_tree))
    return out
