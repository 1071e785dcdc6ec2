"""Batch-invariant linear and grouped (per-expert) linear as Triton kernels (GPU path).

Each output tile is a plain tiled matmul: a program per [BLOCK_M, BLOCK_N] tile (or a
persistent program walking tiles, with TMA loads) walks K in steps of BLOCK_K, accumulating in
fp32. BLOCK_K, the K loop order and the fixed K split of narrow weights (chosen in
triton_linear_config.py; run by triton_split_k.py's chunk launch, or from CHAIN_MIN_ROWS rows
by triton_chunk_tree.py's in-program chain) are functions of the weight shape and dtype only,
never of the row count: each output element is one fixed sequence of fp32 multiply-adds
whatever the other rows are. Oracles: `linear_ref` / `grouped_linear_ref` (moe_kernels/linear.py).
Under TRITON_INTERPRET=1 the kernels run on CPU tensors (tests).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moe_kernels.linear import _group_slices, check_row_index
from moe_kernels.triton_activation import silu_mul_triton, silu_mul_value
from moe_kernels.triton_chunk_tree import CHAIN_WIDE_CONFIG, chain_config, linear_chunk_tree
from moe_kernels.triton_dot import (
    check_pair,
    dot_k_range,
    is_interpreted,
    kernel_consts,
    stored_value,
    tile_of,
)
from moe_kernels.triton_linear_config import (
    BLOCK_K_16BIT,
    MEDIUM_ROWS,
    POINTER_CONFIG_16BIT,
    SMALL_ROWS,
    LinearConfig,
    batched_config,
    k_split_chunk,
    k_split_chunks_per_program,
    k_split_count,
    k_split_is_tree,
    linear_config,
)
from moe_kernels.triton_pdl import pdl_launch, pdl_start
from moe_kernels.triton_split_k import launch_split_k


@triton.jit
def _group_tiles(counts_ptr, num_groups, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr):
    """The groups' row counts [BLOCK_G] from the device (0 past num_groups), their BLOCK_M-row
    tile counts and the running ends of both: what _tile_rows reads."""
    g = tl.arange(0, BLOCK_G)
    counts = tl.load(counts_ptr + g, mask=g < num_groups, other=0).to(tl.int64)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    return counts, tl.cumsum(counts, 0), tiles, tl.cumsum(tiles, 0)


@triton.jit
def _tile_rows(pid_m, counts, rows_end, tiles, tile_end, BLOCK_M: tl.constexpr):
    """Row tile pid_m of the groups' tiles, from the device counts alone: its group (the number
    of groups whose tiles end at or before it; >= num_groups past the last tile), its first row
    (its group's first row + a multiple of BLOCK_M) and its end (at most its group's end).
    Integer scans, exact."""
    group_id = tl.sum((tile_end <= pid_m).to(tl.int64), 0)
    first_tile = tile_end - tiles
    is_mine = (first_tile <= pid_m) & (pid_m < tile_end)  # none past the last tile
    row_start = tl.sum(tl.where(is_mine, rows_end - counts, 0), 0)
    row_start += (pid_m - tl.sum(tl.where(is_mine, first_tile, 0), 0)) * BLOCK_M
    row_end = tl.minimum(row_start + BLOCK_M, tl.sum(tl.where(is_mine, rows_end, 0), 0))
    return group_id, row_start, row_end


@triton.jit(do_not_specialize=["num_rows"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    rows_ptr,
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
    IS_GATHER: tl.constexpr,
    IS_GATED: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out[r] = x[r] @ w[g]^T. Plain: rows tiled from 0, g = 0. Grouped: rows sorted by group,
    counts [num_groups] on the device; tile i is the i-th BLOCK_M-row tile of the groups (no
    tile crosses a group; each starts at its group's first row + a multiple of BLOCK_M) and
    tiles past the last do nothing; num_rows is the launch's tile bound. Gathered (grouped
    only): row r's operand is x[rows[r]] (rows [N] int64), read in place. Gated (grouped
    only): w[g] is [2N, K], gate rows then up rows, and out = silu(x @ gate^T) * (x @ up^T)
    (each product rounded to out's dtype first, then silu_mul_value). Batched (plain only):
    program axis 1 is the batch b, with x, w and out offset by b's strides (w contiguous
    [B, N, K])."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    x_ptr += batch * stride_xb
    w_ptr += batch * N * K
    out_ptr += batch * stride_ob
    if IS_GROUPED:
        num_pid_m = num_rows
    else:
        num_pid_m = tl.cdiv(num_rows, BLOCK_M)
    pid_m, pid_n = tile_of(pid, num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)

    if IS_GROUPED:
        counts, rows_end, tiles, tile_end = _group_tiles(counts_ptr, num_groups, BLOCK_G, BLOCK_M)
        group_id, row_start, row_end = _tile_rows(pid_m, counts, rows_end, tiles, tile_end, BLOCK_M)
        row_end = tl.where(group_id < num_groups, row_end, row_start)  # past the last tile
        w_ptr += group_id * N * K * (2 if IS_GATED else 1)
    else:
        row_start = pid_m * BLOCK_M
        row_end = num_rows
    offs_m = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < row_end
    col_ok = offs_n < N

    # A grouped launch sized for the worst case has empty tiles: they read no weight.
    if row_start < row_end:
        if IS_GATHER:
            # Why: the same loads of the same values as from a gathered copy, so the same dots
            # and bits, without the copy's launch and its [N, K] write and re-read.
            x_rows = tl.load(rows_ptr + offs_m, mask=row_ok, other=0)
        else:
            x_rows = offs_m
        acc = dot_k_range(
            x_ptr, w_ptr, x_rows, offs_n, row_ok, col_ok, stride_xm, K, 0, K, BLOCK_M, BLOCK_N,
            BLOCK_K, INPUT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
        dtype = out_ptr.dtype.element_ty
        if IS_GATED:
            # Why: the same dots as the plain launch's gate and up columns, rounded to the
            # output dtype as its stores would, then the activation kernel's helper: the bits
            # of the two launches, without the [N, 2I] write and re-read between them.
            up = dot_k_range(
                x_ptr, w_ptr + N * K, x_rows, offs_n, row_ok, col_ok, stride_xm, K, 0, K,
                BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, UPCAST_DOT,
            )  # fmt: skip
            out = silu_mul_value(stored_value(acc, dtype), stored_value(up, dtype))
        else:
            out = acc.to(dtype)
        tl.store(
            out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
            out,
            mask=row_ok[:, None] & col_ok[None, :],
        )


@triton.jit
def _tma_tile(desc, batch, row, col, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
              IS_BATCHED: tl.constexpr):  # fmt: skip
    """desc's [BLOCK_R, BLOCK_C] tile at (row, col), of matrix `batch` where desc is 3-d."""
    if IS_BATCHED:
        tile = desc.load([batch, row, col]).reshape(BLOCK_R, BLOCK_C)
    else:
        tile = desc.load([row, col])
    return tile


@triton.jit
def _tma_k_steps(x_desc, w_desc, batch, row, col, first_step, num_steps, acc,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST_DOT: tl.constexpr, IS_BATCHED: tl.constexpr):  # fmt: skip
    """acc + x[row tile, k] @ w[col tile, k]^T over num_steps BLOCK_K steps ascending from
    first_step, by TMA tiles (TMA fills rows and K columns past the end with exact zeros)."""
    for ki in range(first_step, first_step + num_steps):
        a = _tma_tile(x_desc, batch, row, ki * BLOCK_K, BLOCK_M, BLOCK_K, IS_BATCHED)
        b = _tma_tile(w_desc, batch, col, ki * BLOCK_K, BLOCK_N, BLOCK_K, IS_BATCHED)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit(do_not_specialize=["num_rows"])
def _linear_persistent_kernel(
    x_desc,
    w_desc,
    out_desc,
    num_rows,
    N,
    K,
    num_batches,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    NUM_CHUNKS: tl.constexpr = 1,
    FLATTEN: tl.constexpr = True,
    IS_BATCHED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """out = x @ w^T with TMA tiles; program p computes tiles p, p + NUM_PROGRAMS, ...
    NUM_CHUNKS > 1: the linear's fixed K split as the chain (((c0 + c1) + c2) + ...) of
    NUM_CHUNKS chunk sums of whole BLOCK_K steps, each an fp32 sum from zero: the chain's and
    the chunk launch's adds (moe_kernels/triton_chunk_tree.py), so their bits. IS_BATCHED:
    3-d descriptors, num_batches products x[b] @ w[b]^T (a matrix's tiles one after another)."""
    pdl_start(PDL)
    num_pid_m = tl.cdiv(num_rows, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    chunk_steps = num_k // NUM_CHUNKS
    pids_per_group = GROUP_M * num_pid_n
    tiles_per_batch = num_pid_m * num_pid_n
    num_tiles = tiles_per_batch * num_batches if IS_BATCHED else tiles_per_batch
    # Which program computes a tile depends on the row count; the tile's sums do not.
    # (FLATTEN: the tile and K loops as one; the launch turns it off for the chain's nest)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        batch = tile // tiles_per_batch if IS_BATCHED else 0
        in_batch = tile % tiles_per_batch if IS_BATCHED else tile
        first_m = (in_batch // pids_per_group) * GROUP_M
        group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (in_batch % pids_per_group) % group_rows
        pid_n = (in_batch % pids_per_group) // group_rows
        row = pid_m * BLOCK_M
        col = pid_n * BLOCK_N
        # Why: the same ascending K loop with the same BLOCK_K as _linear_kernel; TMA fills
        # out-of-range rows and K columns with exact zeros, as the masked loads there do.
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _tma_k_steps(
            x_desc, w_desc, batch, row, col, 0, chunk_steps, zero, BLOCK_M, BLOCK_N, BLOCK_K,
            UPCAST_DOT, IS_BATCHED,
        )  # fmt: skip
        for chunk in range(1, NUM_CHUNKS):
            acc += _tma_k_steps(
                x_desc, w_desc, batch, row, col, chunk * chunk_steps, chunk_steps, zero, BLOCK_M,
                BLOCK_N, BLOCK_K, UPCAST_DOT, IS_BATCHED,
            )  # fmt: skip
        if IS_BATCHED:
            out_desc.store([batch, row, col], acc.to(out_desc.dtype).reshape(1, BLOCK_M, BLOCK_N))
        else:
            out_desc.store([row, col], acc.to(out_desc.dtype))


@triton.jit
def _grouped_persistent_kernel(
    x_desc,
    w_desc,
    out_ptr,
    counts_ptr,
    num_groups,
    N,
    K,
    stride_om,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The grouped GEMM (rows of x sorted by group, counts [num_groups] on the device) with
    TMA tiles; program p walks tiles p, p + NUM_PROGRAMS, ... of the groups' row tiles times
    the column tiles. w_desc views the weight as [L * N, K]; a tile's rows past its group's
    end (the next group's rows, or TMA's zeros past x) are computed and never stored."""
    pdl_start(PDL)
    counts, rows_end, tiles, tile_end = _group_tiles(counts_ptr, num_groups, BLOCK_G, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tl.sum(tiles, 0) * num_pid_n, NUM_PROGRAMS):
        # Why n fastest: the programs running together share a row tile's x in L2.
        pid_m = tile // num_pid_n
        pid_n = tile % num_pid_n
        group_id, row_start, row_end = _tile_rows(pid_m, counts, rows_end, tiles, tile_end, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # Why: the pointer kernel's ascending K loop with its BLOCK_K, so its bits; TMA fills
        # K columns past the end with exact zeros, as its masked loads do.
        for ki in range(num_k):
            a = x_desc.load([row_start.to(tl.int32), ki * BLOCK_K])
            b = w_desc.load([(group_id * N + pid_n * BLOCK_N).to(tl.int32), ki * BLOCK_K])
            if UPCAST_DOT:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b.T, acc, input_precision=INPUT_PRECISION)
        offs_m = row_start + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (offs_m < row_end)[:, None] & (offs_n < N)[None, :]
        out = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask)


def _launch_grouped_persistent(x, weight, out, counts, config: LinearConfig) -> torch.Tensor:
    """The grouped GEMM of contiguous, 16-byte aligned x [N, K] and weight [L, OUT, K]."""
    num_groups, out_dim, in_dim = weight.shape
    sms = 4 if is_interpreted() else _num_sms(x.device.index or 0)
    bound = grouped_tile_bound(x.shape[0], num_groups, config.block_m)
    num_programs = min(bound * triton.cdiv(out_dim, config.block_n), sms)
    consts = kernel_consts(config, x.dtype, weight.dtype)
    del consts["GROUP_M"]
    _grouped_persistent_kernel[(num_programs,)](
        TensorDescriptor.from_tensor(x, [config.block_m, config.block_k]),
        TensorDescriptor.from_tensor(
            weight.view(num_groups * out_dim, in_dim), [config.block_n, config.block_k]
        ),
        out,
        counts,
        num_groups,
        out_dim,
        in_dim,
        out.stride(0),
        NUM_PROGRAMS=num_programs,
        BLOCK_G=max(triton.next_power_of_2(num_groups), 2),
        **consts,
        **pdl_launch(x.device),
    )
    return out


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned base addresses and strides (all but the last, which is 1)."""
    return all(
        t.data_ptr() % 16 == 0
        and t.stride(-1) == 1
        and all(t.stride(d) * t.element_size() % 16 == 0 for d in range(t.dim() - 1))
        for t in tensors
    )


def _launch_persistent(x, weight, out, config: LinearConfig, num_chunks: int = 1) -> torch.Tensor:
    """The TMA kernel over SM-many programs: x [M, K] @ weight [N, K]^T, or batched x [B, M, K]
    @ weight [B, N, K]^T into out [B, M, N] (strided views as _tma_ok allows); num_chunks > 1:
    the fixed K split's chain (chunks of whole K steps, in_dim = num_chunks * chunk)."""
    is_batched = x.dim() == 3
    num_rows, (out_dim, in_dim) = x.shape[-2], weight.shape[-2:]
    num_batches = x.shape[0] if is_batched else 1
    num_tiles = triton.cdiv(num_rows, config.block_m) * triton.cdiv(out_dim, config.block_n)
    sms = 4 if is_interpreted() else _num_sms(x.device.index or 0)
    num_programs = min(num_tiles * num_batches, sms)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    lead = [1] if is_batched else []  # a batched tile is one matrix's
    _linear_persistent_kernel[(num_programs,)](
        TensorDescriptor.from_tensor(x, lead + [bm, bk]),
        TensorDescriptor.from_tensor(weight, lead + [bn, bk]),
        TensorDescriptor.from_tensor(out, lead + [bm, bn]),
        num_rows,
        out_dim,
        in_dim,
        num_batches,
        NUM_PROGRAMS=num_programs,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=config.group_m,
        UPCAST_DOT=is_interpreted(),
        NUM_CHUNKS=num_chunks,
        FLATTEN=num_chunks == 1,
        IS_BATCHED=is_batched,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_launch(x.device),
    )
    return out


def _launch(
    x,
    weight,
    out,
    counts,
    num_rows,
    config: LinearConfig,
    whole_out_dim: int | None = None,
    arrivals: torch.Tensor | None = None,
    row_index: torch.Tensor | None = None,
    is_gated: bool = False,
) -> torch.Tensor:
    """Launch over row tiles: `counts` is None (plain) or the grouped GEMM's device counts,
    num_rows then the tile bound. whole_out_dim, arrivals: see linear_triton. row_index
    (grouped only): out's row r reads x's row row_index[r]. is_gated (grouped only): weight
    [L, 2I, K] (gate rows, up rows), out [N, I] = silu(gate) * up.

    x [M, K] / out [M, N] (row strides free, unit column stride), or batched x [B, M, K],
    out [B, M, N] with weight [B, N, K] (plain only). Plain 2-D launches of a weight with a
    fixed K split (k_split_count) go through launch_split_k (chunk order; fp32: the tree)."""
    out_dim, in_dim = weight.shape[-2:]
    out_dim //= 2 if is_gated else 1
    is_plain = counts is None and x.dim() == 2
    k_splits = k_split_count(whole_out_dim or out_dim, in_dim, weight.dtype) if is_plain else 1
    if k_splits > 1:
        chunk_k = k_split_chunk(in_dim, k_splits)
        chain = chain_config(out_dim, in_dim, k_splits, weight.dtype, num_rows)
        if chain is not None and x.is_contiguous() and out.is_contiguous():
            # Prefill sizes: the same chunk sums and adds in one launch, no fp32 parts.
            if chain.is_persistent:
                if out.dtype == weight.dtype and _tma_ok(x, weight, out):
                    return _launch_persistent(x, weight, out, chain, k_splits)
                chain = CHAIN_WIDE_CONFIG
            return linear_chunk_tree(x, weight, k_splits, out.dtype, chain, is_tree=False, out=out)
        launch_split_k(
            x, weight, out, chunk_k, config, is_tree=k_split_is_tree(weight.dtype),
            chunks_per_program=k_split_chunks_per_program(weight.dtype, k_splits, num_rows),
            arrivals=arrivals,
        )  # fmt: skip
        return out
    if config.is_persistent and counts is None and out.dtype == weight.dtype:
        # Plain or batched (batched_config's prefill tiles). (An fp32 out's
        # [BLOCK_M, BLOCK_N] store tile would not fit the TMA kernel's smem.)
        if is_plain and not _tma_ok(x, weight, out):
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
        out if row_index is None else row_index,  # unread when IS_GATHER is False
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
        IS_GATHER=row_index is not None,
        IS_GATED=is_gated,
        BLOCK_G=max(triton.next_power_of_2(num_groups), 2),
        **kernel_consts(config, x.dtype, weight.dtype),
        **pdl_launch(x3.device),
    )
    return out


def linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    whole_out_dim: int | None = None,
    arrivals: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [T, IN] @ weight [OUT, IN]^T -> [T, OUT] in out_dtype (None: weight's dtype); fp32
    accumulation, rounded to out_dtype once at the store (fp32: the sums themselves). x has
    weight's dtype, or is 16-bit against an fp32 weight (the router): then it is upcast in
    registers, exactly, and the result has linear_triton(x.float(), weight)'s bits without
    the copy launch.

    whole_out_dim: the OUT of the whole weight when `weight` is one TP rank's column slice of
    it (None: weight is whole). The fixed K split follows the whole weight's shape, so each
    output column gets the same sum at every TP degree. arrivals: the fixed K split's arrival
    counts (arrival_counts; None: fresh zeros when a launch needs them).
    """
    check_pair(x, weight, 2, is_upcast_ok=True)
    if whole_out_dim is not None and whole_out_dim < weight.shape[0]:
        raise ValueError(
            f"whole_out_dim {whole_out_dim} is smaller than the slice's {weight.shape[0]} rows"
        )
    x, weight = x.contiguous(), weight.contiguous()
    if out_dtype not in (None, weight.dtype, torch.float32):
        raise ValueError(f"out_dtype must be the weight's {weight.dtype} or fp32, got {out_dtype}")
    out = x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype or weight.dtype)
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
    check_pair(x[0], weight[0], 2)
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
    config = batched_config(weight.shape[1], weight.shape[2], x.dtype, num_rows, batch)
    return _launch(x, weight, out, None, num_rows, config)


GROUPED_TMA_CONFIG = LinearConfig(128, 256, BLOCK_K_16BIT, 8, 8, 3, is_persistent=True)


def grouped_config(
    out_dim: int, in_dim: int, dtype: torch.dtype, num_rows: int, num_groups: int
) -> LinearConfig:
    """The grouped GEMM's tile config, bucketed by the mean rows per group (a host shape).

    The linear's buckets up to SMALL_ROWS rows a group, the pointer kernel's large tiles to
    MEDIUM_ROWS, the persistent TMA kernel's above (`_grouped_persistent_kernel`); every
    config has BLOCK_K 64 and the ascending K loop, so a row's bits never follow the bucket.
    """
    mean_rows = triton.cdiv(num_rows, max(num_groups, 1))
    if dtype != torch.float32 and mean_rows > MEDIUM_ROWS:
        # Same sweep at 768 rows a group (8192 tokens): TMA 128 x 256 tiles 1037 / 493 us
        # (gate_up gathering its rows first / down) where the 128 x 128 pointer tiles took
        # 1102 / 621, torch._grouped_mm 981 (with its gather) / 523 (with one it lacks here).
        return GROUPED_TMA_CONFIG
    if dtype != torch.float32 and mean_rows > SMALL_ROWS:
        # H200, graph replay, V2-Lite's experts at 96 rows a group (1024 tokens, top-6 of
        # 64): 128 x 128 tiles 236 / 128 us (gate_up / down) where 64 x 64 took 295 / 162,
        # torch._grouped_mm 254 / 149 (bench/gpu_kernels.py grouped_sweep).
        return POINTER_CONFIG_16BIT
    return linear_config(out_dim, in_dim, dtype, mean_rows)


def grouped_tile_bound(num_rows: int, num_groups: int, block_m: int) -> int:
    """Most row tiles N rows in L groups can need: sum of ceil(c / block_m) <= N / block_m + L,
    and every tile holds a row. At decode sizes (N <= L) it is N: no program is idle."""
    return min(triton.cdiv(num_rows, block_m) + num_groups, num_rows)


def grouped_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_sizes: Sequence[int] | torch.Tensor,
    *,
    row_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of x [N, IN], sorted by group, times their group's weight [L, OUT, IN] -> [N, OUT].
    With row_index [N] int64 on x's device, the rows are x[row_index] (x [T, IN]), read in
    place by the kernel (indices are not range-checked: that would be a host sync).

    group_sizes: host ints summing to N, or an int tensor [L] on x's device (no host sync:
    the launch covers the worst case and empty tiles return at once, so CUDA graphs can
    capture it; rows past the counts' sum are left unwritten). Every tile holds rows of one
    group; a row's bits never depend on how many rows its group (or any other) received.
    """
    return _grouped(x, weight, group_sizes, row_index, is_gated=False)


# The gated launch's reach: mean rows a group (a host shape) up to this. H200, graph replay,
# V2-Lite's routed gate_up, 64 experts, top-6: one launch 24.1 / 116.5 / 191.8 us vs the two
# 25.1 / 116.1 / 194.7 at 1 / 8 / 64 tokens; 1441 vs 1224 at 8192 tokens (768 rows a group;
# the best of seven tiles), 274-302 vs 309 at 1024 (96).
GATED_MAX_MEAN_ROWS = 64


def grouped_gated_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_sizes: Sequence[int] | torch.Tensor,
    *,
    row_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """grouped_gated_linear_composed's contract (moe_kernels/activation.py) in one launch: weight
    [L, 2I, IN] (each group's gate rows, then its up rows) -> silu(gate) * up [N, I], with the
    bits of grouped_linear_triton's gate and up columns through silu_mul_triton."""
    if weight.dim() == 3 and weight.shape[1] % 2:
        raise ValueError(f"weight must be [L, 2I, IN] (gate, up), got {tuple(weight.shape)}")
    num_rows = check_row_index(x, row_index)
    if num_rows > GATED_MAX_MEAN_ROWS * weight.shape[0]:
        # Why two launches here: at prefill sizes the two live accumulators cost more than
        # the [N, 2I] round trip they save (BENCHMARKS.md); the same bits either way.
        gate_up = _grouped(x, weight, group_sizes, row_index, is_gated=False)
        return silu_mul_triton(*gate_up.chunk(2, dim=-1))
    return _grouped(x, weight, group_sizes, row_index, is_gated=True)


def _grouped(
    x, weight, group_sizes, row_index, *, is_gated: bool, config: LinearConfig | None = None
) -> torch.Tensor:
    """The grouped launches' shared body; config: the tiles (default grouped_config's)."""
    check_pair(x, weight, 3)
    if isinstance(group_sizes, torch.Tensor):
        if group_sizes.shape != (weight.shape[0],) or group_sizes.device != x.device:
            raise ValueError(
                f"group_sizes must be [{weight.shape[0]}] on {x.device}, got "
                f"{tuple(group_sizes.shape)} on {group_sizes.device}"
            )
        counts = group_sizes
    num_rows = check_row_index(x, row_index)
    if row_index is not None:
        row_index = row_index.contiguous()
    if not isinstance(group_sizes, torch.Tensor):
        _group_slices(group_sizes, num_rows, weight.shape[0])
        counts = torch.tensor(list(group_sizes), dtype=torch.int64).to(x.device)
    x, weight = x.contiguous(), weight.contiguous()
    out = x.new_empty((num_rows, weight.shape[1] // (2 if is_gated else 1)))
    if num_rows == 0:
        return out
    if config is None:
        # Why the whole weight's rows: the tiles the two-launch path had (any tile: same bits).
        config = grouped_config(weight.shape[1], weight.shape[2], x.dtype, num_rows, len(counts))
    if config.is_persistent and not is_gated:
        # Why the copy: TMA reads contiguous row tiles (no gather on this GPU's TMA); at these
        # sizes the faster GEMM pays for it (BENCHMARKS.md, grouped GEMM tiles).
        rows = x if row_index is None else x[row_index]
        if _tma_ok(rows, weight, out):
            return _launch_grouped_persistent(rows, weight, out, counts, config)
    bound = grouped_tile_bound(num_rows, counts.numel(), config.block_m)
    return _launch(x, weight, out, counts, bound, config, row_index=row_index, is_gated=is_gated)
