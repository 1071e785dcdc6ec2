"""The pointer-load tiled linear kernel (`_linear_kernel`) and its launch: plain, batched,
grouped (rows sorted by group, counts on the device), gathered and gated products from one
kernel, plus the group-tile scans the grouped kernels share (`group_tiles`, `tile_rows`).

A program per [BLOCK_M, BLOCK_N] tile walks K in BLOCK_K steps from 0 (dot_k_range),
accumulating in fp32. The launch runs the config its callers (triton_linear.py,
triton_grouped_linear.py) chose and must not choose one itself: the tile shape may follow
the row count, BLOCK_K and the K order never do, so a row's bits never follow the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels.triton_activation import silu_mul_value
from moe_kernels.triton_dot import dot_k_range, kernel_consts, stored_value, tile_of
from moe_kernels.triton_linear_config import POINTER_CONFIG_16BIT, LinearConfig
from moe_kernels.triton_pdl import pdl_launch, pdl_start


@triton.jit
def group_tiles(counts_ptr, num_groups, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr):
    """The groups' row counts [BLOCK_G] from the device (0 past num_groups), their BLOCK_M-row
    tile counts and the running ends of both: what tile_rows reads."""
    g = tl.arange(0, BLOCK_G)
    counts = tl.load(counts_ptr + g, mask=g < num_groups, other=0).to(tl.int64)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    return counts, tl.cumsum(counts, 0), tiles, tl.cumsum(tiles, 0)


@triton.jit
def tile_rows(pid_m, counts, rows_end, tiles, tile_end, BLOCK_M: tl.constexpr):
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
        counts, rows_end, tiles, tile_end = group_tiles(counts_ptr, num_groups, BLOCK_G, BLOCK_M)
        group_id, row_start, row_end = tile_rows(pid_m, counts, rows_end, tiles, tile_end, BLOCK_M)
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


def launch_pointer_linear(
    x,
    weight,
    out,
    counts,
    num_rows,
    config: LinearConfig,
    *,
    row_index: torch.Tensor | None = None,
    is_gated: bool = False,
) -> torch.Tensor:
    """_linear_kernel over row tiles: `counts` is None (plain) or the grouped GEMM's device
    counts, num_rows then the tile bound. row_index (grouped only): out's row r reads x's row
    row_index[r]. is_gated (grouped only): weight [L, 2I, K] (gate rows, up rows), out [N, I]
    = silu(gate) * up. x [M, K] / out [M, N] (row strides free, unit column stride), or
    batched x [B, M, K], out [B, M, N] with weight [B, N, K] (plain only)."""
    out_dim, in_dim = weight.shape[-2:]
    out_dim //= 2 if is_gated else 1
    if config.is_persistent:
        # A persistent config the TMA kernels could not take: the large pointer tiles (the
        # same BLOCK_K and K order, so the same bits).
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
