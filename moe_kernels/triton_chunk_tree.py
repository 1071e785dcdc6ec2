"""The fixed K split in one program per tile (GPU path): the chunk sums added in the fixed
binary tree (the TP row-parallel linear at prefill sizes) or in chunk order (the linear's split
from CHAIN_MIN_ROWS rows) as the one K loop reaches each chunk's end, with no fp32 parts in
memory. The same chunk sums and adds as the chunk launch (moe_kernels/triton_split_k.py), so the
same bits at any row count.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from moe_kernels.triton_dot import check_pair, dot_step, kernel_consts, tile_of, tree_push
from moe_kernels.triton_linear_config import BLOCK_K_16BIT, LinearConfig, block_k_of, k_split_chunk
from moe_kernels.triton_pdl import pdl_launch, pdl_start


@triton.jit(do_not_specialize=["num_rows"])
def _chunk_tree_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    num_rows,
    N,
    K,
    stride_xm,
    STEPS_PER_CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    IS_TREE: tl.constexpr,
    CHUNK_K: tl.constexpr,
    IS_GRID: tl.constexpr,
    IS_CHUNK_LOOP: tl.constexpr,
    IS_PAIRED: tl.constexpr,
    K_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out tile = the binary tree (adjacent pairs, level by level; IS_TREE) or the chunk-order
    chain (((c0 + c1) + c2) + ...) of the NUM_CHUNKS chunk sums of x @ w^T, chunk c over
    columns [c * CHUNK_K, (c + 1) * CHUNK_K), each an fp32 sum from zero in BLOCK_K steps
    ascending, rounded to out's dtype once: CHUNK_K = STEPS_PER_CHUNK * BLOCK_K, or (IS_GRID)
    STEPS_PER_CHUNK steps on the grid of BLOCK_K columns from column 0, each masked to its
    chunk (every chunk spans the same number of grid steps; K_ALIGN, a power of two dividing
    CHUNK_K, keeps the masked loads full-width vectors): the chunk launch's steps
    (dot_k_grid), so chunks off the grid need no shorter step. One K loop over all chunks
    (no pipeline drain at each chunk's end); at a chunk's last step its sum joins the tree as
    a binary counter (tree_push: the finished subtrees wait in s0..s2, so at most four fp32
    tiles are live) or the chain's running total in s0 (two live tiles), and the accumulator
    restarts from zero. Every add is one of sum_parts': the bits of the partials path.
    IS_CHUNK_LOOP: a loop over chunks around a loop over each chunk's steps instead, so the
    accumulator's only use inside the inner loop is the next dot (the same dots and adds):
    wide tiles' MMAs then overlap across steps (pipeline drained at each chunk's end).
    IS_PAIRED (the tree): chunks 2p and 2p + 1 summed side by side in one inner loop (two
    accumulators, two independent chains of MMAs in flight), the loop over pairs unrolled so
    every tree_push is known at compile time (no branches over the waiting tiles); the same
    dots and adds. At most four fp32 tiles live still: while the last pair runs, its two
    accumulators and the subtrees of 4 and 2 chunks.
    """
    pdl_start(PDL)
    pid_m, pid_n = tile_of(
        tl.program_id(0), tl.cdiv(num_rows, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M
    )
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < num_rows
    col_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The waiting subtrees; each is written before it is read (the zeros are never added).
    s0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s1 = s0
    s2 = s0
    s3 = s0  # never written below 16 chunks: compiled away
    if IS_PAIRED:
        for pair in tl.static_range(NUM_CHUNKS // 2):
            left = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            right = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in range(STEPS_PER_CHUNK):
                left = _chunk_step(
                    x_ptr, w_ptr, offs_m, offs_n, offs_k, row_ok, col_ok, stride_xm, K, left,
                    2 * pair * STEPS_PER_CHUNK + i, STEPS_PER_CHUNK, CHUNK_K, IS_GRID, K_ALIGN,
                    BLOCK_K, INPUT_PRECISION, UPCAST_DOT,
                )  # fmt: skip
                right = _chunk_step(
                    x_ptr, w_ptr, offs_m, offs_n, offs_k, row_ok, col_ok, stride_xm, K, right,
                    (2 * pair + 1) * STEPS_PER_CHUNK + i, STEPS_PER_CHUNK, CHUNK_K, IS_GRID,
                    K_ALIGN, BLOCK_K, INPUT_PRECISION, UPCAST_DOT,
                )  # fmt: skip
            acc, s0, s1, s2, s3 = tree_push(left, s0, s1, s2, s3, 2 * pair, NUM_CHUNKS)
            acc, s0, s1, s2, s3 = tree_push(right, s0, s1, s2, s3, 2 * pair + 1, NUM_CHUNKS)
    elif IS_CHUNK_LOOP:
        for chunk in range(NUM_CHUNKS):
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in range(STEPS_PER_CHUNK):
                acc = _chunk_step(
                    x_ptr, w_ptr, offs_m, offs_n, offs_k, row_ok, col_ok, stride_xm, K, acc,
                    chunk * STEPS_PER_CHUNK + i, STEPS_PER_CHUNK, CHUNK_K, IS_GRID, K_ALIGN,
                    BLOCK_K, INPUT_PRECISION, UPCAST_DOT,
                )  # fmt: skip
            acc, s0, s1, s2, s3 = _join_chunk(acc, s0, s1, s2, s3, chunk, NUM_CHUNKS, IS_TREE)
    else:
        for step in range(NUM_CHUNKS * STEPS_PER_CHUNK):
            acc = _chunk_step(
                x_ptr, w_ptr, offs_m, offs_n, offs_k, row_ok, col_ok, stride_xm, K, acc,
                step, STEPS_PER_CHUNK, CHUNK_K, IS_GRID, K_ALIGN, BLOCK_K, INPUT_PRECISION,
                UPCAST_DOT,
            )  # fmt: skip
            if step % STEPS_PER_CHUNK == STEPS_PER_CHUNK - 1:
                chunk = step // STEPS_PER_CHUNK
                acc, s0, s1, s2, s3 = _join_chunk(acc, s0, s1, s2, s3, chunk, NUM_CHUNKS, IS_TREE)
                if chunk < NUM_CHUNKS - 1:
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if not IS_TREE:
        acc = s0
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + offs_m[:, None] * N + offs_n[None, :],
        out,
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _join_chunk(acc, s0, s1, s2, s3, chunk, NUM_CHUNKS: tl.constexpr, IS_TREE: tl.constexpr):
    """Chunk `chunk`'s finished sum (acc) joins the tree (tree_push) or the chain's running
    total in s0. Returns (acc, s0, s1, s2, s3)."""
    if IS_TREE:
        acc, s0, s1, s2, s3 = tree_push(acc, s0, s1, s2, s3, chunk, NUM_CHUNKS)
    elif chunk == 0:
        s0 = acc
    else:
        s0 = s0 + acc
    return acc, s0, s1, s2, s3


@triton.jit
def _chunk_step(
    x_ptr, w_ptr, offs_m, offs_n, offs_k, row_ok, col_ok, stride_xm, K, acc, step,
    STEPS_PER_CHUNK: tl.constexpr, CHUNK_K: tl.constexpr, IS_GRID: tl.constexpr,
    K_ALIGN: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """acc + the dot of global K step `step` (chunk step // STEPS_PER_CHUNK): on the grid of
    BLOCK_K columns from column 0 masked to the chunk (IS_GRID), else BLOCK_K columns from
    step * BLOCK_K."""
    if IS_GRID:
        k_lo = tl.multiple_of((step // STEPS_PER_CHUNK) * CHUNK_K, K_ALIGN)
        k_start = tl.multiple_of(k_lo - k_lo % BLOCK_K, BLOCK_K)
        k = k_start + (step % STEPS_PER_CHUNK) * BLOCK_K + offs_k
        k_ok = (k >= k_lo) & (k < k_lo + CHUNK_K)
    else:
        k = step * BLOCK_K + offs_k
        k_ok = None
    return dot_step(
        x_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, stride_xm, K, k, k_ok, acc,
        INPUT_PRECISION, UPCAST_DOT, IS_GRID,
    )  # fmt: skip


def tree_block_k(chunk_k: int, dtype: torch.dtype) -> int:
    """The in-program tree's K step: the largest power of two from the dtype's BLOCK_K down to
    16 dividing the chunk (0: none), so steps never cross a chunk's end and need no k mask. A
    chunk's sum is the same chain of 16-column MMAs onto one fp32 accumulator at any of them:
    the full-step path's bits (tests/test_gpu_tp_linear.py checks it on the GPU)."""
    block_k = block_k_of(dtype)
    while block_k >= 16 and chunk_k % block_k:
        block_k //= 2
    return block_k if block_k >= 16 else 0


def grid_steps(chunk_k: int, num_chunks: int, block_k: int) -> int:
    """Steps of block_k columns on the grid from column 0 that each of num_chunks chunks of
    chunk_k columns spans, where that count is the same for every chunk (0 otherwise): the
    in-program tree's masked full-width steps (chunk_k a multiple of 16, so each 16-column
    MMA of a masked step is all the chunk's columns or all zeros)."""
    counts = {triton.cdiv(c * chunk_k % block_k + chunk_k, block_k) for c in range(num_chunks)}
    return counts.pop() if len(counts) == 1 and chunk_k % 16 == 0 else 0


MAX_TREE_CHUNKS = 8  # the in-program tree keeps subtrees of 1, 2 and 4 chunks


# Its launch: 64 x 64 tiles keep the four fp32 tiles in 4 warps' registers; 4 stages. The
# fastest of the shapes tried on the H200 (128 x 64 and 64 x 128 on 8 warps, 256 x 64;
# BENCHMARKS.md, row-parallel section) for chunks off the K step grid (masked steps). The K
# step is the tree's own (tree_block_k).
TREE_CONFIG = LinearConfig(64, 64, BLOCK_K_16BIT, 8, 4, 4)
# The paired form's (IS_PAIRED), for 16-bit chunks of whole K steps from PAIRED_MIN_ROWS
# rows: 128 x 64 tiles on 8 warps, 3 stages. H200, graph replay, o_proj (2048 x 2048, 8
# chunks), against TREE_CONFIG's one loop: 200.5 vs 221.5 us at 8192 rows, 402.3 vs 442.4 at
# 16384, 29.5 vs 29.3 at 1024, 15.6 vs 15.6 at 512, 15.2 vs 13.3 at 256 (BENCHMARKS.md,
# tree_pairs).
PAIRED_TREE_CONFIG = LinearConfig(128, 64, BLOCK_K_16BIT, 8, 8, 3)
PAIRED_MIN_ROWS = 512


# From this many rows a 16-bit linear with a fixed K split sums its chunks in one program per
# tile (the in-program chain) instead of the chunk launch and its fp32 parts. H200, graph
# replay, kv_a (576 x 2048, 4 chunks): 12.4 vs 16.5 us at 1024 rows, 51.7 vs 91.4 at 8192,
# 11.7 vs 10.2 at 512; 64 x 64 tiles, 4 warps, 4 stages the fastest of six shapes. fp32
# weights (the routers' CUDA-core products) keep the chunk launch: the chain was 1.1-3.6x
# slower on every tile shape tried (BENCHMARKS.md, linear section).
CHAIN_MIN_ROWS = 1024
CHAIN_CONFIG_16BIT = LinearConfig(64, 64, BLOCK_K_16BIT, 8, 4, 4)
# Weights of CHAIN_WIDE_OUT outputs and more (the shared experts' down, o_proj at
# kernels.tp_max 1): 128 x 128 tiles, 8 warps, in the chunk loop. H200, graph replay, o_proj
# (2048 x 2048, 4 chunks): 138.0 vs 192.9 us at 8192 rows, 20.9 vs 25.6 at 1024 (cuBLAS 101.3,
# 14.0); kv_a's 576 outputs stay fastest on 64 x 64 in one loop (BENCHMARKS.md, tree_loops).
CHAIN_WIDE_OUT = 2048
CHAIN_WIDE_CONFIG = LinearConfig(128, 128, BLOCK_K_16BIT, 8, 8, 3)
# Those weights' chain in the TMA persistent kernel (moe_kernels/triton_linear.py, NUM_CHUNKS),
# where the tensors suit TMA: the same chunk sums and adds. H200, graph replay, µs, pointer
# chain above -> this (cuBLAS; bench/gpu_kernels.py chain_tma, BENCHMARKS.md): o_proj of 128
# heads (2048 x 16384, 8 chunks) at 1024 / 2048 / 8192 rows 138.0 / 278.3 / 1103.0 -> 105.9 /
# 208.7 / 870.0 (88.6 / 177.2 / 688.3); shared_down (2048 x 2816, 4 chunks) at 8192 rows 192.7
# -> 164.5 (122.3); o_proj of 16 heads 138.1 -> 129.8 (96.0). 3 stages ran as the pointer
# chain; 128 x 256, 256 x 128 and 64-wide tiles slower. kv_a's 576 outputs keep 64 x 64 pointer
# tiles (50.5 against 53.2 at 8192 rows).
CHAIN_TMA_CONFIG = LinearConfig(128, 128, BLOCK_K_16BIT, 8, 8, 4, is_persistent=True)


def chain_config(
    out_dim: int, in_dim: int, k_splits: int, dtype: torch.dtype, num_rows: int
) -> LinearConfig | None:
    """The in-program chain's tiles for the linear's fixed K split (k_splits chunks of a
    weight [out_dim, in_dim] of dtype) at num_rows, or None where it does not run: fp32, fewer
    rows than CHAIN_MIN_ROWS, or chunks that are not whole K steps (k_split_chunk's last
    chunk short of the others). Its chunk sums take the chunk launch's K steps (BLOCK_K from
    each chunk's first column)."""
    chunk_k = k_split_chunk(in_dim, k_splits)
    if (
        dtype == torch.float32
        or num_rows < CHAIN_MIN_ROWS
        or chunk_k * k_splits != in_dim
        or chunk_k % BLOCK_K_16BIT
    ):
        return None
    return CHAIN_TMA_CONFIG if out_dim >= CHAIN_WIDE_OUT else CHAIN_CONFIG_16BIT


def linear_chunk_tree(
    x: torch.Tensor,
    weight: torch.Tensor,
    num_chunks: int,
    out_dtype: torch.dtype,
    config: LinearConfig | None = None,
    *,
    is_tree: bool = True,
    out: torch.Tensor | None = None,
    is_grid: bool | None = None,
    is_chunk_loop: bool | None = None,
    is_paired: bool | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T summed as num_chunks (a power of two <= 8, dividing K) chunk
    sums added in the fixed binary tree (is_tree) or in chunk order, in one launch with no
    fp32 partials in memory -> [M, N] in out_dtype, into `out` (contiguous) when given. The
    same bits as computing the chunk partials and adding them with sum_parts
    (moe_kernels/triton_tp_linear.py; the linear's fixed K split), for any M: the prefill path of
    that sum. x may be 16-bit against an fp32 weight (upcast in registers, as the linear).
    Chunks off the dtype's K step grid walk it in masked full steps (grid_steps) where they
    can, else in the largest step dividing them (tree_block_k); is_grid forces either
    (a comparison for the benchmarks; the same bits). is_chunk_loop: the kernel's loop over
    chunks around each chunk's steps (IS_CHUNK_LOOP; the same bits); None: on the chain with
    CHAIN_WIDE_CONFIG's tiles, where it measured faster (BENCHMARKS.md). is_paired: the tree
    two chunks at a time (IS_PAIRED; the same bits; not on masked grid steps); None: on
    PAIRED_TREE_CONFIG's tiles. config None: the tree's default, PAIRED_TREE_CONFIG for 16-bit
    chunks of whole K steps from PAIRED_MIN_ROWS rows, else TREE_CONFIG."""
    check_pair(x, weight, 2, is_upcast_ok=True)
    num_rows, in_dim = x.shape
    out_dim = weight.shape[0]
    if num_chunks > MAX_TREE_CHUNKS or num_chunks & (num_chunks - 1) or in_dim % num_chunks:
        raise ValueError(
            f"num_chunks must be a power of two <= {MAX_TREE_CHUNKS} dividing K = {in_dim}, "
            f"got {num_chunks}"
        )
    chunk_k = in_dim // num_chunks
    block_k = tree_block_k(chunk_k, weight.dtype)
    if not block_k:
        raise ValueError(f"chunks of {chunk_k} columns need a multiple of 16")
    steps_per_chunk = chunk_k // block_k
    full_k = block_k_of(weight.dtype)
    on_grid = grid_steps(chunk_k, num_chunks, full_k) if block_k < full_k else 0
    if is_grid is None:
        # Why: half-width steps ran the shared experts' down (352-column chunks) at 1.1-1.15x
        # the linear at prefill; full steps with a masked edge are the chunk launch's own.
        is_grid = bool(on_grid)
    elif is_grid and not on_grid:
        raise ValueError(f"{num_chunks} chunks of {chunk_k} columns span unequal grid steps")
    if is_grid:
        block_k, steps_per_chunk = full_k, on_grid
    can_pair = is_tree and not is_grid and num_chunks > 1
    if config is None:
        is_16bit = weight.dtype != torch.float32
        is_paired_size = can_pair and is_16bit and num_rows >= PAIRED_MIN_ROWS
        config = PAIRED_TREE_CONFIG if is_paired_size else TREE_CONFIG
    if is_paired is None:
        is_paired = can_pair and config == PAIRED_TREE_CONFIG
    if is_paired and not can_pair:
        raise ValueError("the paired form runs the tree of 2 or more chunks of whole K steps")
    if is_chunk_loop is None:
        is_chunk_loop = not is_tree and config == CHAIN_WIDE_CONFIG
    x, weight = x.contiguous(), weight.contiguous()
    if out is None:
        out = torch.empty((num_rows, out_dim), dtype=out_dtype, device=x.device)
    elif out.shape != (num_rows, out_dim) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {(num_rows, out_dim)} {out_dtype}")
    if num_rows == 0:
        return out
    num_tiles = triton.cdiv(num_rows, config.block_m) * triton.cdiv(out_dim, config.block_n)
    _chunk_tree_kernel[(num_tiles,)](
        x,
        weight,
        out,
        num_rows,
        out_dim,
        in_dim,
        x.stride(0),
        STEPS_PER_CHUNK=steps_per_chunk,
        NUM_CHUNKS=num_chunks,
        IS_TREE=is_tree,
        CHUNK_K=chunk_k,
        IS_GRID=is_grid,
        IS_CHUNK_LOOP=is_chunk_loop,
        IS_PAIRED=is_paired,
        K_ALIGN=chunk_k & -chunk_k if is_grid else block_k,
        **kernel_consts(dataclasses.replace(config, block_k=block_k), x.dtype, weight.dtype),
        **pdl_launch(x.device),
    )
    return out
