"""Batch-invariant linear and grouped (per-expert) linear as Triton kernels (GPU path).

Each output tile is a plain tiled matmul: a program per [BLOCK_M, BLOCK_N] tile (or a
persistent program walking tiles, with TMA loads) walks K in steps of BLOCK_K, accumulating in
fp32. BLOCK_K, the K loop order and the fixed K split (`k_split_count`: K cut into S chunks,
each summed from zero, the chunk sums added in chunk order) are functions of the weight shape
(N, K) and dtype only, never of the row count: each output element is one fixed sequence of
fp32 multiply-adds whatever the other rows are. The chunks run in parallel programs and the
last of a tile's programs to finish adds their fp32 partials. The tile shape (BLOCK_M,
BLOCK_N, warps, stages, persistent or not) is chosen by a bucket of the row count; it moves
work between programs, not the order of any element's sum, and tests/test_gpu_kernels.py
checks every bucket's config bitwise against every other on the model's shapes. No
autotuning.
Oracles: `linear_ref` / `grouped_linear_ref` (kernels/linear.py). Under TRITON_INTERPRET=1
the kernels run on CPU tensors (tests); compiled, they need CUDA tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.linear import _group_slices

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
# Row-count buckets (measured on the H200 against cuBLAS, BENCHMARKS.md). A bucket picks only
# the tile shape; every config shares BLOCK_K = 64 and the ascending K loop, and all of them
# gave bit-identical outputs on every DeepSeek-V2-Lite weight.
DECODE_ROWS = 16
SMALL_ROWS = 64
MEDIUM_ROWS = 512
WIDE_N_TILES = 264  # out_dim / 64 at least this: enough 64-wide column programs for 132 SMs
TMA_MIN_FLOPS = 30e9  # below this the persistent TMA kernel's fixed cost outweighs its speed


FP32_PREFILL_ROWS = 1024  # fp32 weights' prefill tiles from here (measured at 1024 and 4096)


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
            return LinearConfig(16, 16, 32, 8, 4, 4)
        if num_rows <= SMALL_ROWS:
            return LinearConfig(32, 16, 32, 8, 4, 4)
        if num_rows >= FP32_PREFILL_ROWS and out_dim < 8192:
            # H200, graph replay, the V2-Lite router's chunk launch: 33.4 vs 61.8 us at 1024
            # rows, 91.3 vs 98.2 at 4096 (the fastest of nine tiles; BENCHMARKS.md).
            return LinearConfig(32, 64, 32, 8, 2, 3)
        return LinearConfig(64, 128 if out_dim >= 8192 else 64, 32, 8, 4, 2)
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
        return LinearConfig(64, 64, bk, 8, 4, 4)
    if 2 * num_rows * out_dim * in_dim >= TMA_MIN_FLOPS:
        return LinearConfig(128, 256, bk, 8, 8, 3, is_persistent=True)
    return POINTER_CONFIG_16BIT


# The pointer kernel's large-M config; also stands in for the persistent one where TMA can't
# run (unaligned tensors, batched or grouped launches).
POINTER_CONFIG_16BIT = LinearConfig(128, 128, BLOCK_K_16BIT, 8, 8, 3)

# Fixed K split of the linears whose decode launch has too few column programs (the fp32 router
# too: CUDA-core FMAs, 64 experts = 2 column tiles): K is cut
# into S chunks (S and the chunks a function of the weight's shape alone), each summed from
# zero in fp32, and the chunk sums added in chunk order, at EVERY row count, so a row's bits
# never follow the batch. The chunks run in parallel programs; the last of a tile's programs to
# finish adds the fp32 partials in chunk order (launch_split_k: the same adds whoever it is).
MAX_K_SPLITS = 8
MIN_CHUNK_K = 512
SPLIT_TARGET_PROGRAMS = 2 * 132  # two column programs per SM of an H200 (a constant, not a query)
# Only narrow weights split: every row count pays S x M x N fp32 partials written and read, a
# prefill tax that grows with N (measured: adding the chunks inside each program instead needs
# a second accumulator and ran 6-9x slower than cuBLAS at M >= 1024).
SPLIT_MAX_OUT = 2048
SPLIT_ROW_CHUNK = 4096  # rows per split launch: bounds the partials to S x 4096 x N fp32


def k_split_count(out_dim: int, in_dim: int, dtype: torch.dtype) -> int:
    """S for weight [out_dim, in_dim]: doubled while the decode launch (32-column tiles) has
    fewer than SPLIT_TARGET_PROGRAMS programs and each chunk keeps >= MIN_CHUNK_K columns."""
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


@triton.jit(do_not_specialize=["num_rows"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    partial_ptr,
    counts_ptr,
    num_groups,
    num_rows,
    N,
    K,
    stride_xb,
    stride_xm,
    stride_ob,
    stride_om,
    IS_GROUPED: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """out[r] = x[r] @ w[g]^T. Plain: rows tiled from 0, g = 0. Grouped: rows sorted by group,
    counts [num_groups] on the device; tile i is the i-th BLOCK_M-row tile of the groups (no
    tile crosses a group; each starts at its group's first row + a multiple of BLOCK_M) and
    tiles past the last do nothing; num_rows is the launch's tile bound. Batched (plain only):
    program axis 1 is the batch b, with x, w and out offset by b's strides (w contiguous
    [B, N, K])."""
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    x_ptr += batch * stride_xb
    w_ptr += batch * N * K
    out_ptr += batch * stride_ob
    if IS_GROUPED:
        num_pid_m = num_rows
    else:
        num_pid_m = tl.cdiv(num_rows, BLOCK_M)
    pid_m, pid_n = _tile_of(pid, num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)

    if IS_GROUPED:
        # Tile pid_m of the groups' row tiles, from the device counts alone: the group is the
        # number of groups whose tiles end at or before it (integer scans, exact).
        g = tl.arange(0, BLOCK_G)
        g_ok = g < num_groups
        counts = tl.load(counts_ptr + g, mask=g_ok, other=0).to(tl.int64)
        tiles = (counts + BLOCK_M - 1) // BLOCK_M
        tile_end = tl.cumsum(tiles, 0)
        group_rows_end = tl.cumsum(counts, 0)
        group_id = tl.sum(((tile_end <= pid_m) & g_ok).to(tl.int64), 0)
        is_mine = g == group_id
        first_tile = tl.sum(tl.where(is_mine, tile_end - tiles, 0), 0)
        row_start = tl.sum(tl.where(is_mine, group_rows_end - counts, 0), 0)
        row_start += (pid_m - first_tile) * BLOCK_M
        row_end = tl.minimum(row_start + BLOCK_M, tl.sum(tl.where(is_mine, group_rows_end, 0), 0))
        row_end = tl.where(group_id < num_groups, row_end, row_start)  # past the last tile
        w_ptr += group_id * N * K
    else:
        row_start = pid_m * BLOCK_M
        row_end = num_rows
    offs_m = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < row_end
    col_ok = offs_n < N

    # A grouped launch sized for the worst case has empty tiles: they read no weight.
    if row_start < row_end:
        acc = _dot_k_range(
            x_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, stride_xm, K, 0, K, BLOCK_M, BLOCK_N,
            BLOCK_K, INPUT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
        out = acc.to(out_ptr.dtype.element_ty)
        tl.store(
            out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
            out,
            mask=row_ok[:, None] & col_ok[None, :],
        )


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
    first and last is aligned."""
    NUM_PARTS: tl.constexpr = NUM_CHUNKS // CHUNKS_PER_PROGRAM
    tile = tl.program_id(0)
    program = tl.program_id(1)
    pid_m, pid_n = _tile_of(tile, tl.cdiv(num_rows, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
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
        chunk_sum = _dot_k_grid(
            x_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, stride_xm, K,
            k_lo - (k_lo + k_phase) % BLOCK_K, k_lo, tl.minimum(k_lo + CHUNK_K, K), BLOCK_M,
            BLOCK_N, BLOCK_K, INPUT_PRECISION, UPCAST_DOT, K_ALIGN,
        )  # fmt: skip
        acc, s0, s1, s2, s3 = tree_push(chunk_sum, s0, s1, s2, s3, g, CHUNKS_PER_PROGRAM)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if NUM_PARTS == 1:
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
def sum_parts(parts_ptr, offs, part_elems, mask, NUM_PARTS: tl.constexpr, IS_TREE: tl.constexpr):
    """The fp32 parts at parts_ptr + c * part_elems + offs, c < NUM_PARTS, added in chunk order
    (((p0 + p1) + p2) + ...) or in the fixed binary tree (IS_TREE; NUM_PARTS a power of two);
    masked lanes give zeros."""
    total = tl.load(parts_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
    # The tree's waiting subtrees (tree_push); each is written before it is read.
    s0 = total
    s1 = total
    s2 = total
    s3 = total
    if IS_TREE:
        total, s0, s1, s2, s3 = tree_push(total, s0, s1, s2, s3, 0, NUM_PARTS)
    for c in tl.static_range(1, NUM_PARTS):
        part = tl.load(
            parts_ptr + c * part_elems + offs, mask=mask, other=0.0, cache_modifier=".cg"
        )
        if IS_TREE:
            total, s0, s1, s2, s3 = tree_push(part, s0, s1, s2, s3, c, NUM_PARTS)
        else:
            total = total + part
    return total


@triton.jit
def _sum_parts_kernel(
    parts_ptr, out_ptr, num_elems, NUM_PARTS: tl.constexpr, IS_TREE: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """out = sum_parts of the fp32 parts [NUM_PARTS, num_elems], rounded to out's dtype once."""
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
            BLOCK=SUM_PARTS_BLOCK,
        )  # fmt: skip
    return out


@triton.jit
def _dot_step(
    x_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, stride_xm, K, k, k_ok, acc,
    INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, IS_K_MASKED: tl.constexpr,
):  # fmt: skip
    """acc + x[m, k] @ w[n, k]^T for one K step k; masked rows and columns load exact zeros.
    IS_K_MASKED: lanes where k_ok is false load zeros too (their products add nothing), for a
    step partly outside [k_lo, k_hi); otherwise k_ok is unread and the step's BLOCK_K columns
    all lie inside K: no k mask, so the loads stay full-width vectors."""
    x_mask = row_ok[:, None]
    w_mask = col_ok[None, :]
    if IS_K_MASKED:
        x_mask = x_mask & k_ok[None, :]
        w_mask = w_mask & k_ok[:, None]
    a = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
    b = tl.load(w_ptr + offs_n[None, :] * K + k[:, None], mask=w_mask, other=0.0)
    if UPCAST_DOT:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def _dot_k_range(
    x_ptr,
    w_ptr,
    offs_m,
    offs_n,
    row_ok,
    col_ok,
    stride_xm,
    K,
    k_lo,
    k_hi,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """fp32 sum over k in [k_lo, k_hi) of x[m, k] * w[n, k], from zero, in steps of BLOCK_K
    ascending from k_lo. Masked lanes load exact zeros."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    num_whole = (k_hi - k_lo) // BLOCK_K
    # Why two loops: a mask along k that the compiler cannot prove aligned (k_hi of a chunk)
    # turns every load into scalar loads; whole steps need none, the tail step keeps it. The
    # steps and their dots are the same as one masked loop's: the same bits.
    for i in range(num_whole):
        acc = _dot_step(
            x_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, stride_xm, K,
            k_lo + i * BLOCK_K + offs_k, None, acc, INPUT_PRECISION, UPCAST_DOT, False,
        )  # fmt: skip
    k0 = k_lo + num_whole * BLOCK_K
    if k0 < k_hi:
        k = k0 + offs_k
        acc = _dot_step(
            x_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, stride_xm, K, k, k < k_hi, acc,
            INPUT_PRECISION, UPCAST_DOT, True,
        )  # fmt: skip
    return acc


@triton.jit
def _dot_k_grid(
    x_ptr,
    w_ptr,
    offs_m,
    offs_n,
    row_ok,
    col_ok,
    stride_xm,
    K,
    k_start,
    k_lo,
    k_hi,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    K_ALIGN: tl.constexpr,
):
    """fp32 sum over k in [k_lo, k_hi) of x[m, k] * w[n, k], from zero, in steps of BLOCK_K
    ascending from k_start (<= k_lo, > k_lo - BLOCK_K: a step grid the chunk need not start
    on), every step masked to [k_lo, k_hi) in one loop, which the compiler pipelines whole: a
    partial first step written apart compiled to 16-bit scalar loads outside the pipeline on
    the H200 (the shared experts' down at 64 rows 10.9 -> 9.4 us in one loop). K_ALIGN: a power
    of two dividing k_start, k_lo and k_hi (the caller's promise), so the masked loads stay
    full-width vectors."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = tl.multiple_of(k_lo, K_ALIGN)
    k_hi = tl.multiple_of(k_hi, K_ALIGN)
    for i in range(tl.cdiv(k_hi - k_start, BLOCK_K)):
        k = tl.multiple_of(k_start + i * BLOCK_K, K_ALIGN) + offs_k
        acc = _dot_step(
            x_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, stride_xm, K, k,
            (k >= k_lo) & (k < k_hi), acc, INPUT_PRECISION, UPCAST_DOT, True,
        )  # fmt: skip
    return acc


@triton.jit
def _tile_of(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program pid's (row tile, column tile), in an order grouped along M for L2 reuse: it moves
    tiles between programs only."""
    pids_per_group = GROUP_M * num_pid_n
    first_m = (pid // pids_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % pids_per_group) % group_rows, (pid % pids_per_group) // group_rows


@triton.jit
def tree_push(acc, s0, s1, s2, s3, C, NUM_PARTS: tl.constexpr):
    """Part C (counting from 0, a constexpr or a runtime int) of a fixed binary tree over
    NUM_PARTS (a power of two, <= 16) parts, evaluated as a binary counter: acc (part C) is
    added to the finished left siblings waiting in s0..s3 (subtrees of 1, 2, 4, 8 parts; bit l
    of C set: one of 2**l waits), then the subtree it now holds is parked at its level. Every
    add is one of the tree's (left + right, adjacent pairs level by level), so the sum's bits
    are the level-by-level tree's. After the last part, acc holds the whole tree (it parks
    nowhere; levels the tree does not have are never written, so they are no loop state).
    Returns (acc, s0, s1, s2, s3)."""
    if C % 2 == 1:
        acc = s0 + acc
    if C % 4 == 3:
        acc = s1 + acc
    if C % 8 == 7:
        acc = s2 + acc
    if C % 16 == 15:
        acc = s3 + acc
    if NUM_PARTS > 1 and (C + 1) % 2 == 1:
        s0 = acc
    elif NUM_PARTS > 2 and (C + 1) % 4 == 2:
        s1 = acc
    elif NUM_PARTS > 4 and (C + 1) % 8 == 4:
        s2 = acc
    elif NUM_PARTS > 8 and (C + 1) % 16 == 8:
        s3 = acc
    return acc, s0, s1, s2, s3


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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """out tile = the binary tree (adjacent pairs, level by level; IS_TREE) or the chunk-order
    chain (((c0 + c1) + c2) + ...) of the NUM_CHUNKS chunk sums of x @ w^T, chunk c over
    columns [c * C, (c + 1) * C) with C = STEPS_PER_CHUNK * BLOCK_K, each an fp32 sum from
    zero in BLOCK_K steps ascending, rounded to out's dtype once. One K loop over all chunks
    (no pipeline drain at each chunk's end); at a chunk's last step its sum joins the tree as
    a binary counter (tree_push: the finished subtrees wait in s0..s2, so at most four fp32
    tiles are live) or the chain's running total in s0 (two live tiles), and the accumulator
    restarts from zero. Every add is one of sum_parts': the bits of the partials path."""
    pid_m, pid_n = _tile_of(
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
    for step in range(NUM_CHUNKS * STEPS_PER_CHUNK):
        acc = _dot_step(
            x_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, stride_xm, K, step * BLOCK_K + offs_k,
            None, acc, INPUT_PRECISION, UPCAST_DOT, False,
        )  # fmt: skip
        if step % STEPS_PER_CHUNK == STEPS_PER_CHUNK - 1:
            chunk = step // STEPS_PER_CHUNK
            if IS_TREE:
                acc, s0, s1, s2, s3 = tree_push(acc, s0, s1, s2, s3, chunk, NUM_CHUNKS)
            elif chunk == 0:
                s0 = acc
            else:
                s0 = s0 + acc
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


def tree_block_k(chunk_k: int, dtype: torch.dtype) -> int:
    """The in-program tree's K step: the largest power of two from the dtype's BLOCK_K down to
    16 dividing the chunk (0: none), so steps never cross a chunk's end and need no k mask. A
    chunk's sum is the same chain of 16-column MMAs onto one fp32 accumulator at any of them:
    the full-step path's bits (tests/test_gpu_tp_linear.py checks it on the GPU)."""
    block_k = linear_config(1, 1, dtype, 1).block_k
    while block_k >= 16 and chunk_k % block_k:
        block_k //= 2
    return block_k if block_k >= 16 else 0


MAX_TREE_CHUNKS = 8  # the in-program tree keeps subtrees of 1, 2 and 4 chunks
# Its launch: 64 x 64 tiles keep the four fp32 tiles in 4 warps' registers; 4 stages. The
# fastest of the shapes tried on the H200 (128 x 64 and 64 x 128 on 8 warps, 256 x 64;
# BENCHMARKS.md, row-parallel section). The K step is the tree's own (tree_block_k).
TREE_CONFIG = LinearConfig(64, 64, BLOCK_K_16BIT, 8, 4, 4)


# From this many rows a 16-bit linear with a fixed K split sums its chunks in one program per
# tile (the in-program chain) instead of the chunk launch and its fp32 parts. H200, graph
# replay, kv_a (576 x 2048, 4 chunks): 12.4 vs 16.5 us at 1024 rows, 51.7 vs 91.4 at 8192,
# 11.7 vs 10.2 at 512; 64 x 64 tiles, 4 warps, 4 stages the fastest of six shapes. fp32
# weights (the routers' CUDA-core products) keep the chunk launch: the chain was 1.1-3.6x
# slower on every tile shape tried (BENCHMARKS.md, linear section).
CHAIN_MIN_ROWS = 1024
CHAIN_CONFIG_16BIT = LinearConfig(64, 64, BLOCK_K_16BIT, 8, 4, 4)


def chain_config(
    in_dim: int, k_splits: int, dtype: torch.dtype, num_rows: int
) -> LinearConfig | None:
    """The in-program chain's tiles for the linear's fixed K split (k_splits chunks of a
    weight of in_dim columns, dtype) at num_rows, or None where it does not run: fp32, fewer
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
    return CHAIN_CONFIG_16BIT


def linear_chunk_tree(
    x: torch.Tensor,
    weight: torch.Tensor,
    num_chunks: int,
    out_dtype: torch.dtype,
    config: LinearConfig = TREE_CONFIG,
    *,
    is_tree: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T summed as num_chunks (a power of two <= 8, dividing K) chunk
    sums added in the fixed binary tree (is_tree) or in chunk order, in one launch with no
    fp32 partials in memory -> [M, N] in out_dtype, into `out` (contiguous) when given. The
    same bits as computing the chunk partials and adding them with sum_parts
    (kernels/triton_tp_linear.py; the linear's fixed K split), for any M: the prefill path of
    that sum. x may be 16-bit against an fp32 weight (upcast in registers, as the linear)."""
    _check_pair(x, weight, 2, is_upcast_ok=True)
    num_rows, in_dim = x.shape
    out_dim = weight.shape[0]
    if num_chunks > MAX_TREE_CHUNKS or num_chunks & (num_chunks - 1) or in_dim % num_chunks:
        raise ValueError(
            f"num_chunks must be a power of two <= {MAX_TREE_CHUNKS} dividing K = {in_dim}, "
            f"got {num_chunks}"
        )
    block_k = tree_block_k(in_dim // num_chunks, weight.dtype)
    if not block_k:
        raise ValueError(f"chunks of {in_dim // num_chunks} columns need a multiple of 16")
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
        STEPS_PER_CHUNK=in_dim // num_chunks // block_k,
        NUM_CHUNKS=num_chunks,
        IS_TREE=is_tree,
        **_kernel_consts(dataclasses.replace(config, block_k=block_k), x.dtype, weight.dtype),
    )
    return out


@triton.jit(do_not_specialize=["num_rows"])
def _linear_persistent_kernel(
    x_desc,
    w_desc,
    out_desc,
    num_rows,
    N,
    K,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """out = x @ w^T with TMA tiles; program p computes tiles p, p + NUM_PROGRAMS, ..."""
    num_pid_m = tl.cdiv(num_rows, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    pids_per_group = GROUP_M * num_pid_n
    # Which program computes a tile depends on the row count; the tile's sums do not.
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
        first_m = (tile // pids_per_group) * GROUP_M
        group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % pids_per_group) % group_rows
        pid_n = (tile % pids_per_group) // group_rows
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # Why: the same ascending K loop with the same BLOCK_K as _linear_kernel; TMA fills
        # out-of-range rows and K columns with exact zeros, as the masked loads there do.
        for ki in range(num_k):
            a = x_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
            if UPCAST_DOT:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b.T, acc)
        out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(out_desc.dtype))


def _is_interpreted() -> bool:
    return isinstance(_linear_kernel, InterpretedFunction)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned base addresses and row strides."""
    return all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors
    )


def _launch_persistent(x, weight, out, config: LinearConfig) -> torch.Tensor:
    num_rows, (out_dim, in_dim) = x.shape[0], weight.shape
    num_tiles = triton.cdiv(num_rows, config.block_m) * triton.cdiv(out_dim, config.block_n)
    sms = 4 if _is_interpreted() else _num_sms(x.device.index or 0)
    num_programs = min(num_tiles, sms)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    _linear_persistent_kernel[(num_programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(weight, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]),
        num_rows,
        out_dim,
        in_dim,
        NUM_PROGRAMS=num_programs,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=config.group_m,
        UPCAST_DOT=_is_interpreted(),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def _check_tensor(name: str, t: torch.Tensor, ndim: int, dtype: torch.dtype | None) -> None:
    allowed = ("cpu", "cuda") if _is_interpreted() else ("cuda",)
    if t.device.type not in allowed:
        raise ValueError(f"{name} must be on a device of type {allowed}, got {t.device}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES or (dtype is not None and t.dtype != dtype):
        want = dtype if dtype is not None else _DTYPES
        raise ValueError(f"{name} dtype must be {want}, got {t.dtype}")


def _check_pair(
    x: torch.Tensor, weight: torch.Tensor, weight_ndim: int, is_upcast_ok: bool = False
) -> None:
    """is_upcast_ok: an fp32 weight may meet a 16-bit x (upcast in registers, exact)."""
    _check_tensor("x", x, 2, None)
    is_upcast = is_upcast_ok and weight.dtype == torch.float32
    _check_tensor("weight", weight, weight_ndim, None if is_upcast else x.dtype)
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if weight.shape[-1] != x.shape[1]:
        raise ValueError(
            f"x has {x.shape[1]} input features but weight {tuple(weight.shape)} "
            f"expects {weight.shape[-1]}"
        )


def _launch(
    x,
    weight,
    out,
    counts,
    num_rows,
    config: LinearConfig,
    whole_out_dim: int | None = None,
    arrivals: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch over row tiles: `counts` is None (plain) or the grouped GEMM's device counts,
    num_rows then the tile bound. whole_out_dim, arrivals: see linear_triton.

    x [M, K] / out [M, N] (row strides free, unit column stride), or batched x [B, M, K],
    out [B, M, N] with weight [B, N, K] (plain only). Plain 2-D launches of a weight with a
    fixed K split (k_split_count) go through launch_split_k (chunk order)."""
    out_dim, in_dim = weight.shape[-2:]
    is_plain = counts is None and x.dim() == 2
    k_splits = k_split_count(whole_out_dim or out_dim, in_dim, weight.dtype) if is_plain else 1
    if k_splits > 1:
        chunk_k = k_split_chunk(in_dim, k_splits)
        chain = chain_config(in_dim, k_splits, weight.dtype, num_rows)
        if chain is not None and x.is_contiguous() and out.is_contiguous():
            # Prefill sizes: the same chunk sums and adds in one launch, no fp32 parts.
            return linear_chunk_tree(x, weight, k_splits, out.dtype, chain, is_tree=False, out=out)
        launch_split_k(x, weight, out, chunk_k, config, is_tree=False, arrivals=arrivals)
        return out
    if config.is_persistent and is_plain:
        if not _tma_ok(x, weight, out):
            x, weight = x.clone(), weight.clone()  # fresh allocations are 16-byte aligned
        if _tma_ok(x, weight, out):
            return _launch_persistent(x, weight, out, config)
    if config.is_persistent:
        config = POINTER_CONFIG_16BIT
    x3, out3 = (x, out) if x.dim() == 3 else (x[None], out[None])
    num_pid_n = triton.cdiv(out_dim, config.block_n)
    num_pid_m = triton.cdiv(num_rows, config.block_m) if counts is None else num_rows
    num_groups = 0 if counts is None else counts.numel()
    _linear_kernel[(num_pid_m * num_pid_n, x3.shape[0], 1)](
        x3,
        weight,
        out3,
        out,  # partials: unread without a K split
        out if counts is None else counts,  # unread when IS_GROUPED is False
        num_groups,
        num_rows,
        out_dim,
        in_dim,
        x3.stride(0),
        x3.stride(1),
        out3.stride(0),
        out3.stride(1),
        IS_GROUPED=counts is not None,
        BLOCK_G=max(triton.next_power_of_2(num_groups), 2),
        **_kernel_consts(config, x.dtype, weight.dtype),
    )
    return out


def _kernel_consts(config: LinearConfig, x_dtype: torch.dtype, w_dtype: torch.dtype) -> dict:
    return dict(
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        # Why: fp32 weights (the router) use exact fp32 products, not tf32.
        INPUT_PRECISION="ieee" if w_dtype == torch.float32 else "tf32",
        # The interpreter hands 16-bit floats to numpy's matmul as raw bits: feed it fp32
        # (exact for bf16/fp16 products). Compiled kernels keep the 16-bit MMA. A 16-bit x
        # against an fp32 weight is upcast in registers: the values x.float() would load.
        UPCAST_DOT=(_is_interpreted() and w_dtype != torch.float32) or x_dtype != w_dtype,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


# Up to this many rows a split-K launch's last program per tile adds the parts (one launch
# fewer); above, the tiles' finishing programs serialise at the kernel's end and a separate
# elementwise launch is faster (H200, graph replay: o_proj 6.5 vs 7.1 us at 1 row, 9.8 vs
# 8.5 at 64; BENCHMARKS.md, row-parallel section).
FOLD_MAX_ROWS = 16
NUM_ARRIVAL_COUNTS = 4096  # tiles of a folded launch: <= 16 rows x N / 32 columns, N <= 131072


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
    this call (a memset; inside a CUDA graph capture, a memset node)."""
    num_rows, (out_dim, in_dim) = x.shape[0], weight.shape
    num_chunks = triton.cdiv(in_dim, chunk_k)
    num_parts = num_chunks // chunks_per_program
    if chunks_per_program > 1 and (not is_tree or num_parts * chunks_per_program != num_chunks):
        raise ValueError(
            f"{chunks_per_program} chunks a program need the tree and must divide {num_chunks}"
        )
    if config.is_persistent:
        config = POINTER_CONFIG_16BIT  # the pointer kernel's K loop, with the chunk axis
    k_phase = k_origin % config.block_k
    # Chunk bounds and step starts (congruent to -k_phase) are multiples of this.
    align = k_align(math.gcd(chunk_k, in_dim, k_phase or config.block_k))
    for start in range(0, num_rows, SPLIT_ROW_CHUNK):
        rows = min(SPLIT_ROW_CHUNK, num_rows - start)
        parts = torch.empty((num_parts, rows, out_dim), dtype=torch.float32, device=x.device)
        num_tiles = triton.cdiv(rows, config.block_m) * triton.cdiv(out_dim, config.block_n)
        is_folded = rows <= FOLD_MAX_ROWS or num_parts == 1
        counts = parts  # unread unless folded
        if is_folded and num_parts > 1:
            counts = arrivals
            if counts is None or counts.numel() < num_tiles or counts.device != x.device:
                counts = torch.zeros(num_tiles, dtype=torch.int32, device=x.device)
        part_out = out[start : start + rows]
        _split_k_kernel[(num_tiles, num_parts)](
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
            **_kernel_consts(config, x.dtype, weight.dtype),
        )
        if not is_folded:
            if part_out.is_contiguous():
                sum_parts_triton(parts, part_out, is_tree=is_tree)
            else:
                part_out.copy_(sum_parts_triton(parts, torch.empty_like(part_out), is_tree=is_tree))
    return out


def linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    whole_out_dim: int | None = None,
    arrivals: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, IN] @ weight [OUT, IN]^T -> [T, OUT] in weight's dtype; fp32 accumulation. x has
    weight's dtype, or is 16-bit against an fp32 weight (the router): then it is upcast in
    registers, exactly, and the result has linear_triton(x.float(), weight)'s bits without
    the copy launch.

    whole_out_dim: the OUT of the whole weight when `weight` is one TP rank's column slice of
    it (None: weight is whole). The fixed K split follows the whole weight's shape, so each
    output column gets the same sum at every TP degree. arrivals: the fixed K split's arrival
    counts (arrival_counts; None: fresh zeros when a launch needs them).
    """
    _check_pair(x, weight, 2, is_upcast_ok=True)
    if whole_out_dim is not None and whole_out_dim < weight.shape[0]:
        raise ValueError(
            f"whole_out_dim {whole_out_dim} is smaller than the slice's {weight.shape[0]} rows"
        )
    x, weight = x.contiguous(), weight.contiguous()
    out = x.new_empty((x.shape[0], weight.shape[0]), dtype=weight.dtype)
    if x.shape[0] == 0:
        return out
    config = linear_config(weight.shape[0], weight.shape[1], weight.dtype, x.shape[0])
    return _launch(x, weight, out, None, x.shape[0], config, whole_out_dim, arrivals)


def batched_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [B, M, IN] (any batch and row strides) @ weight [B, OUT, IN]^T -> [B, M, OUT].

    One launch for every b; each b gets exactly the bits `linear_triton(x[b], weight[b])`
    gives (the same BLOCK_K and K order; the row bucket picks only the tile shape). `out`:
    where to write them, e.g. a slice of a wider buffer (batch and row strides free, unit
    column stride, x's dtype); the strides move only the stores, never the arithmetic.
    """
    if x.dim() != 3 or weight.dim() != 3 or x.shape[0] != weight.shape[0]:
        raise ValueError(
            f"need x [B, M, IN] and weight [B, OUT, IN], got {tuple(x.shape)}, "
            f"{tuple(weight.shape)}"
        )
    _check_pair(x[0], weight[0], 2)
    if x.stride(2) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    batch, num_rows = x.shape[:2]
    if out is None:
        out = x.new_empty((batch, num_rows, weight.shape[1]))
    elif (
        out.shape != (batch, num_rows, weight.shape[1])
        or out.dtype != x.dtype
        or out.device != x.device
        or out.stride(2) != 1
    ):
        raise ValueError(
            f"out must be [{batch}, {num_rows}, {weight.shape[1]}] {x.dtype} on {x.device} with "
            f"a unit column stride, got {tuple(out.shape)} {out.dtype} on {out.device}, "
            f"strides {out.stride()}"
        )
    if num_rows == 0 or batch == 0:
        return out
    config = linear_config(weight.shape[1], weight.shape[2], x.dtype, num_rows)
    return _launch(x, weight, out, None, num_rows, config)


def grouped_config(
    out_dim: int, in_dim: int, dtype: torch.dtype, num_rows: int, num_groups: int
) -> LinearConfig:
    """The grouped GEMM's tile config, bucketed by the mean rows per group (a host shape).

    The linear's buckets, pointer kernel only (tiles come from a device table); every config
    has BLOCK_K 64 and the ascending K loop, so a row's bits never follow the bucket.
    """
    mean_rows = triton.cdiv(num_rows, max(num_groups, 1))
    return linear_config(out_dim, in_dim, dtype, mean_rows)


def grouped_tile_bound(num_rows: int, num_groups: int, block_m: int) -> int:
    """Most row tiles N rows in L groups can need: sum of ceil(c / block_m) <= N / block_m + L,
    and every tile holds a row. At decode sizes (N <= L) it is N: no program is idle."""
    return min(triton.cdiv(num_rows, block_m) + num_groups, num_rows)


def grouped_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, group_sizes: Sequence[int] | torch.Tensor
) -> torch.Tensor:
    """Rows of x [N, IN], sorted by group, times their group's weight [L, OUT, IN] -> [N, OUT].

    group_sizes: host ints summing to N, or an int tensor [L] on x's device (no host sync:
    the launch covers the worst case and empty tiles return at once, so CUDA graphs can
    capture it; rows past the counts' sum are left unwritten). Every tile holds rows of one
    group; a row's bits never depend on how many rows its group (or any other) received.
    """
    _check_pair(x, weight, 3)
    if isinstance(group_sizes, torch.Tensor):
        if group_sizes.shape != (weight.shape[0],) or group_sizes.device != x.device:
            raise ValueError(
                f"group_sizes must be [{weight.shape[0]}] on {x.device}, got "
                f"{tuple(group_sizes.shape)} on {group_sizes.device}"
            )
        counts = group_sizes
    else:
        _group_slices(group_sizes, x.shape[0], weight.shape[0])
        counts = torch.tensor(list(group_sizes), dtype=torch.int64).to(x.device)
    x, weight = x.contiguous(), weight.contiguous()
    out = x.new_empty((x.shape[0], weight.shape[1]))
    if x.shape[0] == 0:
        return out
    config = grouped_config(weight.shape[1], weight.shape[2], x.dtype, *x.shape[:1], len(counts))
    bound = grouped_tile_bound(x.shape[0], counts.numel(), config.block_m)
    return _launch(x, weight, out, counts, bound, config)
