"""The grouped (per-expert) linear as Triton kernels (GPU path): rows sorted by group times
their group's weight, `grouped_linear_triton`, and its gated form (silu(gate) * up in one
launch), `grouped_gated_linear_triton`; the tile config by mean rows a group and the persistent
TMA kernel of its prefill sizes. Smaller sizes run triton_pointer_linear.py's kernel.

Every tile holds rows of one group and walks K in BLOCK_K steps from 0, so a row's bits never
depend on how many rows its group (or any other) received. It must not read device counts on
the host (no sync: CUDA graphs capture it) nor pick tiles by anything but host shapes.
Oracle: `grouped_linear_ref` (moe_kernels/linear.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moe_kernels.linear import _group_slices, check_row_index
from moe_kernels.triton_activation import silu_mul_triton
from moe_kernels.triton_dot import check_pair, kernel_consts, num_persistent_programs, tma_ok
from moe_kernels.triton_linear_config import (
    BLOCK_K_16BIT,
    MEDIUM_ROWS,
    POINTER_CONFIG_16BIT,
    SMALL_ROWS,
    LinearConfig,
    linear_config,
)
from moe_kernels.triton_pdl import pdl_launch, pdl_start
from moe_kernels.triton_pointer_linear import group_tiles, launch_pointer_linear, tile_rows


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
    counts, rows_end, tiles, tile_end = group_tiles(counts_ptr, num_groups, BLOCK_G, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tl.sum(tiles, 0) * num_pid_n, NUM_PROGRAMS):
        # Why n fastest: the programs running together share a row tile's x in L2.
        pid_m = tile // num_pid_n
        pid_n = tile % num_pid_n
        group_id, row_start, row_end = tile_rows(pid_m, counts, rows_end, tiles, tile_end, BLOCK_M)
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
    bound = grouped_tile_bound(x.shape[0], num_groups, config.block_m)
    num_programs = num_persistent_programs(bound * triton.cdiv(out_dim, config.block_n), x.device)
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
        if tma_ok(rows, weight, out):
            return _launch_grouped_persistent(rows, weight, out, counts, config)
    bound = grouped_tile_bound(num_rows, counts.numel(), config.block_m)
    return launch_pointer_linear(
        x, weight, out, counts, bound, config, row_index=row_index, is_gated=is_gated
    )
