"""Linear and grouped (per-expert) linear, invariant reference and plain-torch fast path.

`linear_ref` / `grouped_linear_ref` call BLAS only on fixed-shape row tiles, so a row's output
never depends on the other rows in the call, their count or their order (fp32 `torch.mm` row 0
differs between M <= 3 and M >= 7 on CPU). The fast versions call BLAS on whatever M the
batch brings and are the negative control. No bias: DeepSeek projections have none.
In and out features are zero-padded to multiples of PAD_FEATURES (exact zeros add nothing),
so BLAS takes the same full-width path for every weight shape: with MKL's narrow-N path a
row's bits followed its position in the tile (out 2-11, in not a multiple of 4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from moe_kernels.tiling import map_row_tiles

PAD_FEATURES = 16  # 64 bytes of fp32: every padded row of a tile starts cache-line aligned


def _pad_features(weight: torch.Tensor) -> torch.Tensor:
    """[..., OUT, IN] -> zero-padded [..., OUT', IN'], both multiples of PAD_FEATURES."""
    pad_out, pad_in = (-n % PAD_FEATURES for n in weight.shape[-2:])
    return F.pad(weight, (0, pad_in, 0, pad_out)) if pad_out or pad_in else weight


def _tiled_matmul(x: torch.Tensor, padded_weight: torch.Tensor, out_dim: int, tile_rows: int):
    weight_t = padded_weight.t()
    # Why: BLAS sees [tile_rows, IN'] @ [IN', OUT'] every call, one shape and one code path
    # for every row, in a fresh buffer whose alignment the batch cannot move.
    return map_row_tiles(
        lambda tile: (tile @ weight_t)[:, :out_dim], x, tile_rows, num_cols=weight_t.shape[0]
    )


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, *, tile_rows: int, whole_out_dim: int | None = None
) -> torch.Tensor:
    """x [T, IN] @ weight [OUT, IN]^T -> [T, OUT]. whole_out_dim (the OUT of the whole weight a
    TP column slice belongs to) is accepted for the op's contract and unused: the padded
    full-width BLAS call gives a column the same sum whatever OUT is (no K split here)."""
    return _tiled_matmul(x, _pad_features(weight), weight.shape[0], tile_rows)


def linear_fast(
    x: torch.Tensor, weight: torch.Tensor, *, whole_out_dim: int | None = None
) -> torch.Tensor:
    """F.linear; whole_out_dim is ignored (fast mode promises no TP invariance)."""
    return F.linear(x, weight)


def batched_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, *, tile_rows: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [B, M, IN] @ weight [B, OUT, IN]^T -> [B, M, OUT]: linear_ref of each b; written into
    `out` (any strides, e.g. a slice of a wider buffer) and returned when given."""
    outs = [linear_ref(x[b], weight[b], tile_rows=tile_rows) for b in range(x.shape[0])]
    result = torch.stack(outs) if outs else x.new_empty((0, x.shape[1], weight.shape[1]))
    return result if out is None else out.copy_(result)


def batched_linear_fast(
    x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """torch.bmm; with `out` (a strided view, e.g. a slice of the MLA query buffer) cuBLAS
    writes into it through its row and batch strides (no temporary and copy when one of the
    last two strides is 1, as torch's bmm allows)."""
    if out is None:
        return torch.bmm(x, weight.transpose(1, 2))
    return torch.bmm(x, weight.transpose(1, 2), out=out)


def _group_slices(
    group_sizes: Sequence[int] | torch.Tensor, num_rows: int, num_groups: int
) -> list[slice]:
    if isinstance(group_sizes, torch.Tensor):
        group_sizes = group_sizes.tolist()  # host sync: these paths loop over the groups
    if len(group_sizes) != num_groups or sum(group_sizes) != num_rows:
        raise ValueError(
            f"group_sizes must have {num_groups} entries summing to {num_rows} rows, "
            f"got {list(group_sizes)}"
        )
    ends = list(accumulate(group_sizes))
    return [slice(end - size, end) for size, end in zip(group_sizes, ends, strict=True)]


def grouped_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_sizes: Sequence[int] | torch.Tensor,
    *,
    tile_rows: int,
    row_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of x [N, IN], sorted by group, times their group's weight [L, OUT, IN] -> [N, OUT].

    group_sizes: ints summing to N (host, or an int tensor [L]). Each row's result depends only
    on the row and its group's weight: how many tokens the expert received never changes a bit.
    row_index [N] int64, when given: the rows are x[row_index] (x [T, IN]), read in place.
    """
    x = gathered_rows(x, row_index)
    slices = _group_slices(group_sizes, x.shape[0], weight.shape[0])
    padded, out_dim = _pad_features(weight), weight.shape[1]
    # Why: each group is tiled on its own, so a tile never mixes weights and M stays fixed;
    # its rows are copied out of x[s], so the group's offset never sets their alignment.
    outs = [_tiled_matmul(x[s], padded[g], out_dim, tile_rows) for g, s in enumerate(slices)]
    # torch.cat places rows; no float index_add_/scatter_add_ whose order could vary.
    return torch.cat(outs) if outs else x.new_zeros((0, weight.shape[1]))


def check_row_index(x: torch.Tensor, row_index: torch.Tensor | None) -> int:
    """The grouped GEMM's row count: x's, or row_index's (which must be [N] int64 on x's
    device; its values are not range-checked here, that would be a host sync on CUDA)."""
    if row_index is None:
        return x.shape[0]
    if row_index.dim() != 1 or row_index.dtype != torch.int64 or row_index.device != x.device:
        raise ValueError(
            f"row_index must be [N] int64 on {x.device}, got {tuple(row_index.shape)} "
            f"{row_index.dtype} on {row_index.device}"
        )
    return row_index.shape[0]


def gathered_rows(x: torch.Tensor, row_index: torch.Tensor | None) -> torch.Tensor:
    """The grouped GEMM's rows: x itself, or x[row_index] (row_index [N] int64 on x's device)."""
    check_row_index(x, row_index)
    return x if row_index is None else x[row_index]


def grouped_linear_fast(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_sizes: Sequence[int] | torch.Tensor,
    *,
    row_index: torch.Tensor | None = None,
) -> torch.Tensor:
    x = gathered_rows(x, row_index)
    slices = _group_slices(group_sizes, x.shape[0], weight.shape[0])
    outs = [F.linear(x[s], weight[g]) for g, s in enumerate(slices)]
    return torch.cat(outs) if outs else x.new_zeros((0, weight.shape[1]))


# Fast mode's grouped GEMM on CUDA takes the Triton kernel (fast mode may run any kernel)
# where it beats torch's: at most this many rows an expert on average, on weights of at least
# FAST_TRITON_GROUPED_MIN_IN input features. H200, graph replay, V2-Lite's experts (BENCHMARKS.md,
# grouped GEMM table): Triton 0.45-0.71 of `_grouped_mm`'s time at <= 6 rows an expert, 0.82
# (gate_up) and 1.03 (down) at 24, 1.15-1.23 at >= 96. Narrower weights were not measured.
# V3's 256 experts (gate_up 4096 x 7168, down 7168 x 2048, top-8 of 1 to 256 tokens: at most
# 8 rows an expert): Triton 0.56-0.76 of its time at every size (twenty-eighth session).
FAST_TRITON_GROUPED_MAX_MEAN_ROWS = 32
FAST_TRITON_GROUPED_MIN_IN = 1024


def grouped_linear_by_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_sizes: Sequence[int] | torch.Tensor,
    *,
    few_rows: Callable,
    many_rows: Callable,
    row_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """grouped_linear_fast's contract through few_rows(x, weight, group_sizes, row_index=...)
    where the mean rows per group (the GEMM's rows, a host shape: no sync) is at most
    FAST_TRITON_GROUPED_MAX_MEAN_ROWS and the weight has at least FAST_TRITON_GROUPED_MIN_IN
    input features, else through many_rows."""
    num_groups, _, in_dim = weight.shape
    is_few = check_row_index(x, row_index) <= FAST_TRITON_GROUPED_MAX_MEAN_ROWS * num_groups
    if is_few and in_dim >= FAST_TRITON_GROUPED_MIN_IN:
        return few_rows(x, weight, group_sizes, row_index=row_index)
    return many_rows(x, weight, group_sizes, row_index=row_index)


@dataclass(frozen=True)
class ByRows:
    """A fast-mode op on CUDA run by `few` where its input x has at most max_rows rows (its
    dimension rows_dim, a host shape: no sync, any graph) and its weight at most max_out
    output features (weight.shape[-2]), max_in input features (weight.shape[-1]) and, for a
    batched weight [batch, out, in], max_batch of them (None: any), else by `many`; both have
    the op's contract. Fast mode may run any kernel, so each op takes the one measured faster
    at its size; the choice changes bits, as fast mode may."""

    few: Callable
    many: Callable
    max_rows: int
    rows_dim: int = 0
    max_out: int | None = None
    max_in: int | None = None
    max_batch: int | None = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, **kwargs) -> torch.Tensor:
        limits = [
            (x.shape[self.rows_dim], self.max_rows),
            (weight.shape[-2], self.max_out),
            (weight.shape[-1], self.max_in),
        ]
        if weight.dim() == 3:
            limits.append((weight.shape[0], self.max_batch))
        is_few = all(limit is None or size <= limit for size, limit in limits)
        return (self.few if is_few else self.many)(x, weight, **kwargs)


# Fast mode's plain linear, batched W_UK / W_UV products and router logits on CUDA take the
# Triton kernel (its fixed K split included, where a weight has one) at the sizes where it beat
# cuBLAS. H200, V2-Lite, graph replay over weights that miss L2, µs cuBLAS / Triton at 1 to 16
# rows (BENCHMARKS.md, twenty-fourth session, `bench/gpu_kernels.py fast_choice`): kv_a 576 x
# 2048 6.0-6.5 / 4.6-4.8 (won to 128 rows), o_proj 2048 x 2048 6.4 / 5.8-5.9 (to 16),
# shared_down 2048 x 2816 8.5-8.6 / 6.7-6.9 (to 64); the wider ones lost (q_proj 3072 x 2048
# 7.0 / 8.1, shared gate_up 5632 x 2048 9.2-9.6 / 10.3-10.4) or tied (lm_head). At V3's
# shapes (twenty-eighth session, `fast_choice_v3`) the narrow ones won too: q_a 1536 x 7168
# 10.5-11.3 / 9.8-10.0, kv_a 576 x 7168 8.0-8.2 / 6.9-7.1.
FAST_TRITON_LINEAR_MAX_ROWS = 16
FAST_TRITON_LINEAR_MAX_OUT = 2048
# At one row every weight of at most FAST_TRITON_LINEAR_ANY_OUT_MAX_IN input features takes
# it: in the step, where the Triton kernels chain by PDL and cuBLAS's do not, the engine's
# B = 1 decode step went from 2.51-2.60 to 2.26-2.27 ms with V2-Lite's wider weights (K 2048)
# on Triton too; at B = 8 it gained nothing (5.32-5.33 ms without, 5.34-5.38 with;
# BENCHMARKS.md, twenty-fourth session). V3's weights of longer K lost at one row (two runs,
# twenty-eighth session): lm_head 129280 x 7168 417.6-428.8 / 456.3-475.8, shared gate_up
# 4096 x 7168 21.4-21.7 / 25.6, o_proj 7168 x 16384 66.6-67.2 / 69.1-70.2; q_b 24576 x 1536
# won, 23.8-24.2 / 22.4-22.9. (The last two differences are near the ~5 us a launch that PDL
# chaining gave V2-Lite's B = 1 step; no V3-sized engine fits one GPU to weigh them there.)
FAST_TRITON_LINEAR_ANY_OUT_ROWS = 1
FAST_TRITON_LINEAR_ANY_OUT_MAX_IN = 2048
# W_UK x16 (K 128, N 512) 3.8-4.1 / 2.9-3.3 to 64 rows (won to 256), W_UV x16 (K 512, N 128)
# 4.1-4.4 / 3.6-4.1 to 64, lost from 128. At 128 heads both lost at every row count from 1 to
# 64: W_UK x128 7.6-10.4 / 9.0-11.4, W_UV x128 7.5-10.5 / 8.8-11.5 (twenty-eighth session),
# so only models of at most 16 heads (a rank's heads: the weight's batch) take it. Through the
# engine (V2-Lite with 128 heads, three runs each): B = 1 3.45-3.47 ms a step against
# 3.57-3.64 with Triton; B = 8 6.86-6.87 against 6.76-6.86, B = 64 10.40-10.57 against
# 10.40-10.54 (within the runs' spread). Again with FlashMLA fenced (twenty-ninth session, one
# run each, ms a step cuBLAS / Triton): B = 1 3.53 / 3.63, 8 6.88 / 6.98, 64 10.48 / 10.53.
FAST_TRITON_BATCHED_MAX_ROWS = 64
FAST_TRITON_BATCHED_MAX_HEADS = 16
# 64 x 2048 with fp32 output 5.4-5.9 / 3.9-5.4 at every row count measured (1 to 256); V3's
# 256 x 7168 7.4-9.4 / 5.8-8.6 (a tie at 128 rows, 8.1 / 8.3).
FAST_TRITON_ROUTER_MAX_ROWS = 256
# The two V3 rules (max_in and the head count) were taken back once (79cbea0): with cuBLAS's
# W_UK / W_UV in the 128-head B = 1 decode graph the step's hidden state went bad. The cause
# was FlashMLA's decode kernel reading its query before the kernels before it had ended (a
# PDL launch that does not wait; moe_kernels/fast_attention.py `_wait_for_earlier_kernels`,
# twenty-ninth session); with its fence the same run is clean and the rules are back.


def grouped_linear_cuda_fast(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_sizes: Sequence[int] | torch.Tensor,
    *,
    row_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """grouped_linear_fast's contract on CUDA: torch's grouped GEMM (one launch, CUTLASS on
    sm90) over offsets computed on the device, so no host sync and CUDA graphs can capture
    it. Rows past the counts' sum are left unspecified. Shapes it cannot take (not bf16, or
    feature sizes not multiples of 16) take the Triton grouped GEMM, which reads the counts on
    the device too (the per-group loop they took read them on the host, which fails inside a
    graph's capture: fast mode with graphs on, fp32 or expert sizes such as 24, did not start).
    That kernel happens to be the invariant one; fast mode promises nothing either way.
    row_index: gathered first (torch's grouped GEMM reads contiguous rows only)."""
    x = gathered_rows(x, row_index)
    out_dim, in_dim = weight.shape[1:]
    if x.shape[0] == 0:
        return x.new_empty((0, out_dim))
    if x.dtype != torch.bfloat16 or out_dim % 16 or in_dim % 16:
        # Imported here: triton_grouped_linear imports this module.
        from moe_kernels.triton_grouped_linear import grouped_linear_triton

        return grouped_linear_triton(x, weight, group_sizes)
    counts = torch.as_tensor(group_sizes, device=x.device)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
