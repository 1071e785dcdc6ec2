"""Tile configs of the invariant linear kernels and the fixed K split of narrow weights.

BLOCK_K and the K split (`k_split_count`: S chunks of whole BLOCK_K steps, each summed from
zero, the sums added in chunk order) are functions of the weight's shape and dtype only. A
bucket of the row count picks only the tile shape (`linear_config`): it moves work between
programs, never the order of any element's sum, and tests/test_gpu_kernels.py checks every
bucket's config bitwise against every other on the model's shapes. No autotuning; host code only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton


@dataclass(frozen=True)
class LinearConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    is_persistent: bool = False  # TMA loads, one program per SM walking tiles


BLOCK_K_16BIT = 64  # the one K step of every bf16/fp16 weight: fixes each element's sum order
BLOCK_K_FP32 = 32  # the one K step of every fp32 weight (the routers' CUDA-core products)


# Row-count buckets (measured on the H200 against cuBLAS, BENCHMARKS.md). A bucket picks only
# the tile shape; every config shares BLOCK_K = 64 and the ascending K loop, and all of them
# gave bit-identical outputs on every DeepSeek-V2-Lite weight.
DECODE_ROWS = 16
SMALL_ROWS = 64
MEDIUM_ROWS = 512
WIDE_N_TILES = 264  # out_dim / 64 at least this: enough 64-wide column programs for 132 SMs
TMA_MIN_FLOPS = 30e9  # below this the persistent TMA kernel's fixed cost outweighs its speed
FP32_PREFILL_ROWS = 1024  # fp32 weights' prefill tiles from here (measured at 1024 and 4096)


def block_k_of(dtype: torch.dtype) -> int:
    """The one K step of every weight of this dtype (every config and path uses it)."""
    return BLOCK_K_FP32 if dtype == torch.float32 else BLOCK_K_16BIT


def linear_config(out_dim: int, in_dim: int, dtype: torch.dtype, num_rows: int) -> LinearConfig:
    """Block config for x [num_rows, in_dim] @ weight [out_dim, in_dim]^T.

    BLOCK_K is a function of the weight's dtype only (fp32: 32, 16-bit: 64); num_rows and the
    weight shape choose the tiles.
    """
    if dtype == torch.float32:
        # The router (ieee fp32 products, CUDA-core FMAs). One 64x64 program walking K alone
        # took ~230 us for a decode step's 64 experts; small tiles spread it over programs.
        # Every fp32 config shares BLOCK_K 32 and the K loop (checked bitwise on the GPU).
        if num_rows <= DECODE_ROWS:
            return LinearConfig(16, 16, BLOCK_K_FP32, 8, 4, 4)
        if num_rows <= SMALL_ROWS:
            return LinearConfig(32, 16, BLOCK_K_FP32, 8, 4, 4)
        if num_rows >= FP32_PREFILL_ROWS and out_dim < 8192:
            # H200, graph replay, the V2-Lite router's chunk launch vs 64 x 64 tiles: 33.4 vs
            # 61.8 us at 1024 rows, 91.3 vs 98.2 at 4096 (four chunks in order; the fastest of
            # nine tiles); on the tree split 35.6 vs 59.6 and 95.1 vs 96.4 (BENCHMARKS.md).
            return LinearConfig(32, 64, BLOCK_K_FP32, 8, 2, 3)
        return LinearConfig(64, 128 if out_dim >= 8192 else 64, BLOCK_K_FP32, 8, 4, 2)
    bk = BLOCK_K_16BIT
    is_wide = triton.cdiv(out_dim, 64) >= WIDE_N_TILES
    if num_rows <= DECODE_ROWS:
        # Narrow column tiles: more programs stream the weight (no split-K to add them).
        return LinearConfig(16, 64, bk, 8, 4, 4) if is_wide else LinearConfig(16, 32, bk, 8, 4, 6)
    if num_rows <= SMALL_ROWS:
        if is_wide:
            return LinearConfig(64, 64, bk, 8, 4, 4)
        # Why: 16-row tiles read a narrow weight once per 16 rows; they pay only where 64-row
        # ones would leave SMs idle (a narrow weight without enough K chunks to fill them).
        column_programs = triton.cdiv(out_dim, 32) * k_split_count(out_dim, in_dim, dtype)
        if out_dim <= 2048 and column_programs < SPLIT_TARGET_PROGRAMS // 2:
            return LinearConfig(16, 32, bk, 8, 4, 6)
        return LinearConfig(64, 32, bk, 8, 4, 4)
    if num_rows <= MEDIUM_ROWS:
        if is_wide:
            return LinearConfig(128, 128, bk, 8, 8, 4, is_persistent=True)
        splits = k_split_count(out_dim, in_dim, dtype)
        if splits > 1 and in_dim // splits >= LONG_CHUNK_K:
            # A fixed K split of long chunks (o_proj of 128 heads into V2-Lite's 2048 hidden,
            # K = 16384 in 8 chunks of 2048; V3's 7168 is too wide to split): wider tiles
            # amortize the chunk's K loop. H200, graph replay, 2048 x 16384: 128
            # rows 38.7 -> 30.4 us, 256 rows 60.6 -> 45.4 (cuBLAS 27.0, 33.4; BENCHMARKS.md).
            if num_rows <= 128:
                return LinearConfig(64, 128, bk, 8, 4, 4)
            return LinearConfig(128, 128, bk, 8, 8, 3)
        return LinearConfig(64, 64, bk, 8, 4, 4)
    if 2 * num_rows * out_dim * in_dim >= TMA_MIN_FLOPS:
        return LinearConfig(128, 256, bk, 8, 8, 3, is_persistent=True)
    return POINTER_CONFIG_16BIT


# Batched launches (MLA's absorbed W_UK / W_UV, one matrix a head) of more than DECODE_ROWS
# rows take these tiles where the whole launch still has BATCHED_MIN_PROGRAMS programs (about
# one an SM of an H200): a head's matrix is small (K 128 or 512), and the plain bucket's
# narrow tiles, sized to spread one weight over the SMs, leave thousands of tiny programs.
# H200, graph replay (BENCHMARKS.md), us, plain bucket -> these tiles (cuBLAS): 128 heads,
# W_UK at 64 / 128 / 256 rows 30.3 / 19.3 / 33.8 -> 11.7 / 15.2 / 25.5 (10.4 / 13.5 / 21.5),
# W_UV 17.6 / 15.8 / 23.9 -> 10.2 / 13.7 / 20.0 (10.5 / 13.5 / 19.0); 16 heads, W_UK at 64 and
# 256 rows 6.2 / 7.2 -> 3.9 / 5.8 (4.1 / 5.4). At up to 16 rows the plain 16 x 32 tiles were
# the fastest at both head counts; elsewhere below BATCHED_MIN_PROGRAMS the plain bucket was
# within 0.3 us of the best.
BATCHED_TILES = (
    (SMALL_ROWS, LinearConfig(64, 64, BLOCK_K_16BIT, 8, 4, 4)),  # (up to this many rows, tiles)
    (MEDIUM_ROWS, LinearConfig(128, 128, BLOCK_K_16BIT, 8, 8, 3)),
)
BATCHED_MIN_PROGRAMS = 128
# Past MEDIUM_ROWS a batched launch takes the persistent TMA kernel (the launch falls back to
# the pointer kernel where a view is not TMA-ready): 256-wide column tiles where the product has
# 256 outputs, else 128-wide with a fourth stage. H200, graph replay, engine layout
# (`bench/gpu_kernels.py heads_prefill`, BENCHMARKS.md), us, pointer 128 x 128 -> this (cuBLAS):
# 128 heads, W_UK at 1024 / 8192 rows 88.4 / 652.6 -> 61.3 / 435.3 (60.1 / 430.1), W_UV 57.6 /
# 389.1 -> 54.3 / 387.6 (55.2 / 380.6); 16 heads, W_UK 12.7 / 84.8 -> 10.0 / 58.8 (10.1 /
# 57.9), W_UV 10.2 / 54.5 -> 9.2 / 51.5 (9.8 / 51.8). Every tile gave the same bits.
BATCHED_WIDE_TMA = LinearConfig(128, 256, BLOCK_K_16BIT, 8, 8, 3, is_persistent=True)
BATCHED_NARROW_TMA = LinearConfig(128, 128, BLOCK_K_16BIT, 8, 8, 4, is_persistent=True)


def batched_config(
    out_dim: int, in_dim: int, dtype: torch.dtype, num_rows: int, batch: int
) -> LinearConfig:
    """Block config of a batched launch of `batch` products x [num_rows, in_dim] @ weight
    [out_dim, in_dim]^T: BATCHED_TILES where the launch keeps BATCHED_MIN_PROGRAMS programs,
    the persistent TMA tiles past MEDIUM_ROWS, else linear_config's (every one shares BLOCK_K,
    so each product keeps its bits)."""
    if dtype != torch.float32 and num_rows > MEDIUM_ROWS:
        return BATCHED_WIDE_TMA if out_dim >= BATCHED_WIDE_TMA.block_n else BATCHED_NARROW_TMA
    if dtype != torch.float32 and num_rows > DECODE_ROWS:
        for max_rows, config in BATCHED_TILES:
            if num_rows <= max_rows:
                tiles = triton.cdiv(num_rows, config.block_m) * triton.cdiv(out_dim, config.block_n)
                if batch * tiles >= BATCHED_MIN_PROGRAMS:
                    return config
                break
    return linear_config(out_dim, in_dim, dtype, num_rows)


# The pointer kernel's large-M config; also stands in for the persistent one where TMA can't
# run (unaligned tensors, batched or grouped launches).
POINTER_CONFIG_16BIT = LinearConfig(128, 128, BLOCK_K_16BIT, 8, 8, 3)


# Fixed K split of the linears whose decode launch has too few column programs (the fp32
# router too: CUDA-core FMAs, 64 experts = 4 column tiles): K is cut into S chunks (S and the
# chunks a function of the weight's shape alone), each summed from zero in fp32, and the chunk
# sums added in chunk order (fp32: in the binary tree), at EVERY row count, so a row's bits
# never follow the batch. The chunks run in parallel programs; the last of a tile's programs
# to finish adds the fp32 partials (launch_split_k: the same adds whoever it is).
MAX_K_SPLITS = 8
MIN_CHUNK_K = 512
SPLIT_TARGET_PROGRAMS = 2 * 132  # two column programs per SM of an H200 (a constant, not a query)


# Only narrow weights split: every row count pays S x M x N fp32 partials written and read, a
# prefill tax that grows with N (measured: adding the chunks inside each program instead needs
# a second accumulator and ran 6-9x slower than cuBLAS at M >= 1024).
SPLIT_MAX_OUT = 2048
LONG_CHUNK_K = 2048  # K split chunks at least this long take wider tiles at medium rows


# fp32 weights (the routers: CUDA-core FMAs, one dependent chain per output along its chunk)
# split K into up to FP32_K_SPLITS chunks added in the fixed binary tree: at decode each chunk
# is a program of a few K steps. H200, graph replay, the V2-Lite router (64 x 2048; 16 chunks
# of 128 vs the earlier 4 of 512 in chunk order): 6.2 vs 14.1 us at 1 row, 9.9 vs 24.6 at 64,
# 27.4 vs 33.5 at 1024, 95.1 vs 91.2 at 4096 (BENCHMARKS.md). From FP32_PREFILL_ROWS rows a
# program sums FP32_PREFILL_CHUNKS adjacent chunks as their subtree (a quarter of the fp32
# parts in memory; the tree's adds, so the same bits).
FP32_K_SPLITS = 16
FP32_PREFILL_CHUNKS = 4


def k_split_is_tree(dtype: torch.dtype) -> bool:
    """Whether a weight of this dtype adds its fixed K split's chunk sums in the binary tree
    (fp32) rather than in chunk order (16-bit)."""
    return dtype == torch.float32


def k_split_chunks_per_program(dtype: torch.dtype, num_chunks: int, num_rows: int) -> int:
    """Adjacent chunks one program of the chunk launch sums as their subtree: a launch shape
    of the tree (fp32 only, from FP32_PREFILL_ROWS rows), never an order."""
    if k_split_is_tree(dtype) and num_rows >= FP32_PREFILL_ROWS:
        return min(FP32_PREFILL_CHUNKS, num_chunks)
    return 1


def k_split_count(out_dim: int, in_dim: int, dtype: torch.dtype) -> int:
    """S for weight [out_dim, in_dim] (1: no split above SPLIT_MAX_OUT outputs). fp32: the
    largest power of two <= FP32_K_SPLITS whose chunks (k_split_chunk) number exactly S, the
    binary tree's leaves. 16-bit: doubled while the decode launch (32-column tiles) has fewer
    than SPLIT_TARGET_PROGRAMS programs and each chunk keeps >= MIN_CHUNK_K columns."""
    if k_split_is_tree(dtype):
        if out_dim > SPLIT_MAX_OUT:
            return 1
        splits = FP32_K_SPLITS
        while splits > 1 and triton.cdiv(in_dim, k_split_chunk(in_dim, splits)) != splits:
            splits //= 2
        return splits
    num_tiles, splits = triton.cdiv(out_dim, 32), 1
    while (
        out_dim <= SPLIT_MAX_OUT
        and splits < MAX_K_SPLITS
        and num_tiles * splits < SPLIT_TARGET_PROGRAMS
        and in_dim // (2 * splits) >= MIN_CHUNK_K
    ):
        splits *= 2
    return splits


def k_align(chunk_k: int) -> int:
    """The K_ALIGN a kernel may assume of chunk bounds (multiples of chunk_k, or of a gcd of
    it and K): the largest power of two up to 16 dividing chunk_k (16 bf16 values: two 16-byte
    vectors)."""
    return min(16, chunk_k & -chunk_k) if chunk_k else 16


def k_split_chunk(in_dim: int, k_splits: int) -> int:
    """Columns per chunk: whole BLOCK_K steps, the last chunk taking the remainder."""
    return triton.cdiv(triton.cdiv(in_dim, BLOCK_K_16BIT), k_splits) * BLOCK_K_16BIT
