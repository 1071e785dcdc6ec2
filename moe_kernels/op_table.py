"""The op table: one set of kernel callables chosen once per worker by device and mode.

It holds every reducing op of the token path, the MoE combine, the TP sum and the sampler's
cumsum included, so `kernels.mode: fast` turns invariance off everywhere. Invariant mode on
CPU binds the torch references (tiled ones to `config.tile_rows`); fast mode is plain torch,
except on CUDA, where it is the fastest version of each op measured: cuBLAS linears (the
Triton ones at the few rows where they were faster), torch's grouped GEMM (the Triton one at few
rows an expert), FlashMLA (or split-KV) decode attention, the invariant launch where that was
faster (moe_kernels/fast_attention.py), and the one-launch Triton kernels of the norms, silu*up,
router top-k, combine, MoE output and latent cache write. Invariant
mode on CUDA binds the Triton kernels; other devices are refused.
Building a table has no side effects beyond its own CUDA buffers and side stream
(moe_kernels/streams.py); `pin_threads` is the one call that touches process
state (torch's intra-op thread count, fp32 matmul precision and default dtype) and each worker
makes it once, at start-up (a rank in the caller's process around each call: `process_state`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial, wraps

import torch

from moe_kernels.activation import grouped_gated_linear_composed, silu_mul_fast, silu_mul_ref
from moe_kernels.attention import mla_attention_fast, mla_attention_ref
from moe_kernels.combine import (
    moe_combine_fast,
    moe_combine_output_composed,
    moe_combine_ref,
    moe_output_ref,
    sum_over_ranks_fast,
    sum_over_ranks_ref,
)
from moe_kernels.config import KernelConfig
from moe_kernels.cumsum import cumsum_fast, cumsum_ref
from moe_kernels.latent_cache import write_latent_cache_fast, write_latent_cache_ref
from moe_kernels.linear import (
    FAST_TRITON_BATCHED_MAX_HEADS,
    FAST_TRITON_BATCHED_MAX_ROWS,
    FAST_TRITON_LINEAR_ANY_OUT_MAX_IN,
    FAST_TRITON_LINEAR_ANY_OUT_ROWS,
    FAST_TRITON_LINEAR_MAX_OUT,
    FAST_TRITON_LINEAR_MAX_ROWS,
    FAST_TRITON_ROUTER_MAX_ROWS,
    ByRows,
    batched_linear_fast,
    batched_linear_ref,
    grouped_linear_by_rows,
    grouped_linear_cuda_fast,
    grouped_linear_fast,
    grouped_linear_ref,
    linear_fast,
    linear_ref,
)
from moe_kernels.mla_prefill import MhaPrefill
from moe_kernels.rmsnorm import add_rms_norm_fast, add_rms_norm_ref, rms_norm_fast, rms_norm_ref
from moe_kernels.router import (
    router_logits_fast,
    router_logits_ref,
    router_topk_fast,
    router_topk_ref,
)
from moe_kernels.softmax import log_softmax_fast, log_softmax_ref, softmax_fast, softmax_ref
from moe_kernels.streams import SideStream, StreamBuffers, inline_branch
from moe_kernels.tp_linear import row_parallel_linear_fast, row_parallel_linear_ref


@dataclass(frozen=True)
class OpTable:
    """Kernel callables with the fast versions' signatures (tile_rows already bound)."""

    linear: Callable
    batched_linear: Callable
    grouped_linear: Callable
    grouped_gated_linear: Callable
    rms_norm: Callable
    add_rms_norm: Callable
    softmax: Callable
    log_softmax: Callable
    mla_attention: Callable
    router_logits: Callable
    router_topk: Callable
    moe_combine: Callable
    moe_output: Callable
    moe_combine_output: Callable
    sum_over_ranks: Callable
    cumsum: Callable
    silu_mul: Callable
    write_latent_cache: Callable
    row_parallel_linear: Callable
    mode: str
    # A layer's independent branch: `with ops.branch(num_rows) as side: side.run(fn, ...)`
    # (moe_kernels/streams.py); on a second CUDA stream up to config.side_stream_rows rows.
    branch: Callable = inline_branch
    side_stream: SideStream | None = None
    # Fast mode on CUDA: prefill steps attend in the multi-head form (moe_kernels/mla_prefill.py);
    # None: every step in the absorbed form (invariant mode: part of the bits).
    mla_prefill: MhaPrefill | None = None


# Each op: (fast, invariant reference). The tiled references take `tile_rows`.
_TILED_OPS: dict[str, tuple[Callable, Callable]] = {
    "linear": (linear_fast, linear_ref),
    "batched_linear": (batched_linear_fast, batched_linear_ref),
    "grouped_linear": (grouped_linear_fast, grouped_linear_ref),
    "rms_norm": (rms_norm_fast, rms_norm_ref),
    "add_rms_norm": (add_rms_norm_fast, add_rms_norm_ref),  # residual add, then the norm
    "softmax": (softmax_fast, softmax_ref),
    "log_softmax": (log_softmax_fast, log_softmax_ref),
    "mla_attention": (mla_attention_fast, mla_attention_ref),
    "router_logits": (router_logits_fast, router_logits_ref),
    "router_topk": (router_topk_fast, router_topk_ref),
    # The norm, ropes (the latent's and the query's) and cache write of the MLA latents; on
    # CUDA one fused launch in both modes.
    "write_latent_cache": (write_latent_cache_fast, write_latent_cache_ref),
}
# Why these references serve CPU and CUDA alike (on CUDA the combine is one Triton kernel
# instead: fewer launches), untiled: each is row-wise already (a token's slots, ranks or
# vocab, never a tile of other rows). The combine and TP sum are index copies plus
# elementwise multiplies and adds in a fixed slot / rank order; cumsum is an exact integer scan
# (moe_kernels/cumsum.py: any association order gives its bits, so torch's scan on the device);
# silu_mul_ref is elementwise exp, IEEE division and a multiply (on CUDA one Triton kernel of
# the same elementwise steps). Elementwise
# kernels run one scalar formula on every element (CUDA vectorises only loads and stores), so
# an element's bits never depend on its offset, the tensor size or the batch.
_ROW_WISE_OPS: dict[str, tuple[Callable, Callable]] = {
    "moe_combine": (moe_combine_fast, moe_combine_ref),
    "sum_over_ranks": (sum_over_ranks_fast, sum_over_ranks_ref),
    "cumsum": (cumsum_fast, cumsum_ref),
    "silu_mul": (silu_mul_fast, silu_mul_ref),
    # Elementwise, not reducing: one op for both modes (on CUDA one Triton launch of the same
    # roundings instead of three torch ones).
    "moe_output": (moe_output_ref, moe_output_ref),
}


# Ops whose Triton kernel is also the fastest CUDA version measured (bench/profile_step.py):
# fused elementwise or row-wise kernels replacing 3-14 torch launches each. The router's top-k:
# one launch against torch's softmax, topk and scaling, H200, 1 to 256 rows, graph replay, µs
# torch / Triton 14.1-19.9 / 3.1-3.6 (BENCHMARKS.md, `bench/gpu_kernels.py fast_choice`).
_FASTEST_ON_CUDA = (
    "rms_norm",
    "add_rms_norm",
    "silu_mul",
    "moe_combine",
    "moe_output",
    "write_latent_cache",
    "router_topk",
)


def build_op_table(config: KernelConfig, device: torch.device | str) -> OpTable:
    device = torch.device(device)
    side = None
    # Why the check: a table may be built for a device this process cannot see (a CUDA table
    # on a CPU host, tests): it binds the same ops, with no stream or buffers of its own.
    is_present = device.type == "cuda" and _is_present(device)
    if is_present and config.side_stream_rows:
        side = SideStream(device, config.side_stream_rows)
    # The split-K arrival counts of the Triton linears (None: each launch makes its own).
    arrivals = _arrival_counts(device, side) if is_present else None
    if config.is_invariant:
        ops = _invariant_ops(config, device, arrivals)
    else:
        ops = _fast_ops(device, arrivals)
    ops["row_parallel_linear"] = _row_parallel_linear(config, device, arrivals)
    ops["moe_combine_output"] = _moe_combine_output(ops, device)
    ops["grouped_gated_linear"] = _grouped_gated_linear(ops, device, config.is_invariant)
    if side is not None:
        ops |= {"branch": side.branch, "side_stream": side}
    return OpTable(**ops, mode=config.mode)


def _invariant_ops(
    config: KernelConfig, device: torch.device, arrivals: torch.Tensor | StreamBuffers | None
) -> dict[str, Callable]:
    """Invariant mode's ops: the Triton kernels on CUDA, the torch references on the CPU (the
    tiled ones at config.tile_rows)."""
    row_wise = {name: ref for name, (_, ref) in _ROW_WISE_OPS.items()}
    if device.type == "cuda":
        ops = row_wise | _triton_kernels(arrivals)
        if config.attention_group_splits:  # part of the bits: the config's, not the launch's
            ops["mla_attention"] = partial(
                ops["mla_attention"], group_splits=config.attention_group_splits
            )
        long_splits = {  # the same (None, unbound: the launch's own)
            "long_blocks": config.attention_long_blocks,
            "long_split_blocks": config.attention_long_split_blocks,
        }
        long_splits = {key: value for key, value in long_splits.items() if value is not None}
        if long_splits:
            ops["mla_attention"] = partial(ops["mla_attention"], **long_splits)
        return ops
    if device.type == "cpu":
        tile = partial(partial, tile_rows=config.tile_rows)
        return {name: tile(ref) for name, (_, ref) in _TILED_OPS.items()} | row_wise
    raise ValueError(f"kernels.mode='invariant' supports devices cpu and cuda, got device {device}")


def _fast_ops(
    device: torch.device, arrivals: torch.Tensor | StreamBuffers | None
) -> dict[str, Callable]:
    """Fast mode's ops: torch's, and on CUDA the Triton kernels where they are faster."""
    ops = {name: fast for name, (fast, _) in (_TILED_OPS | _ROW_WISE_OPS).items()}
    if device.type == "cuda":
        # Why: fast mode is the best path a user could run, so each op whose one-launch
        # Triton kernel beats torch's several launches takes it (invariance costs nothing
        # there; the price of invariance is measured on the reducing GEMMs and attention),
        # and the linears take it at the sizes where it beat cuBLAS (moe_kernels/linear.py).
        ops |= _fast_cuda_ops(_triton_kernels(arrivals))
    return ops


def _fast_cuda_ops(triton_ops: dict[str, Callable]) -> dict[str, Callable]:
    """Fast mode's CUDA ops over torch's: the one-launch kernels, and the linears by rows."""
    ops = {name: triton_ops[name] for name in _FASTEST_ON_CUDA}
    triton_linear = triton_ops["linear"]
    narrow_or_cublas = ByRows(
        triton_linear, linear_fast, FAST_TRITON_LINEAR_MAX_ROWS,
        max_out=FAST_TRITON_LINEAR_MAX_OUT,
    )  # fmt: skip
    ops["linear"] = ByRows(
        triton_linear, narrow_or_cublas, FAST_TRITON_LINEAR_ANY_OUT_ROWS,
        max_in=FAST_TRITON_LINEAR_ANY_OUT_MAX_IN,
    )  # fmt: skip
    ops["batched_linear"] = ByRows(
        triton_ops["batched_linear"], batched_linear_fast, FAST_TRITON_BATCHED_MAX_ROWS,
        rows_dim=1,  # [heads, tokens, features]
        max_batch=FAST_TRITON_BATCHED_MAX_HEADS,
    )  # fmt: skip
    ops["router_logits"] = ByRows(
        triton_ops["router_logits"], router_logits_fast, FAST_TRITON_ROUTER_MAX_ROWS
    )  # fmt: skip
    # Why: the per-expert loop needs host counts; a graph-captured step can't have
    # them. Torch's grouped GEMM, or the Triton one where it is the faster (few rows
    # an expert: decode).
    ops["grouped_linear"] = partial(
        grouped_linear_by_rows,
        few_rows=triton_ops["grouped_linear"],
        many_rows=grouped_linear_cuda_fast,
    )
    ops["mla_attention"] = _fast_decode_attention()
    ops["mla_prefill"] = MhaPrefill()
    return ops


def _is_present(device: torch.device) -> bool:
    """Whether this process sees the CUDA device."""
    index = 0 if device.index is None else device.index
    return torch.cuda.is_available() and index < torch.cuda.device_count()


def _arrival_counts(device: torch.device, side: SideStream | None) -> torch.Tensor | StreamBuffers:
    """The split-K arrival counts of the table's Triton linears (moe_kernels/triton_split_k.py) on
    a present device: one buffer a stream."""
    from moe_kernels.triton_split_k import arrival_counts

    # Why one buffer a stream: a folded split-K launch leaves its arrival counts at zero, so
    # the launches of one stream share them (two running at once must not); made here, outside
    # any graph capture.
    if side is not None:
        return StreamBuffers(side, partial(arrival_counts, device))
    return arrival_counts(device)


def _with_arrivals(fn: Callable, arrivals: torch.Tensor | StreamBuffers | None) -> Callable:
    """fn with its split-K arrival counts bound: one buffer, or the current stream's."""
    if not isinstance(arrivals, StreamBuffers):
        return partial(fn, arrivals=arrivals)

    @wraps(fn)  # keeps the kernel's name
    def call(*args, **kwargs):
        return fn(*args, arrivals=arrivals.current(), **kwargs)

    return call


def _row_parallel_linear(
    config: KernelConfig, device: torch.device, arrivals: torch.Tensor | StreamBuffers | None
) -> Callable:
    """The TP row-parallel linear (moe_kernels/tp_linear.py): invariant mode cuts K into
    config.tp_max fixed chunks summed in one binary tree, the same bits at every TP degree;
    fast mode is one GEMM and the backend's all_reduce. arrivals: the table's split-K counts."""
    if not config.is_invariant:
        return row_parallel_linear_fast
    if device.type == "cuda":
        from moe_kernels.triton_tp_linear import row_parallel_linear_triton

        return _with_arrivals(partial(row_parallel_linear_triton, tp_max=config.tp_max), arrivals)
    return partial(row_parallel_linear_ref, tp_max=config.tp_max, tile_rows=config.tile_rows)


def _moe_combine_output(ops: dict[str, Callable], device: torch.device) -> Callable:
    """The combine and the MoE output as one op: on CUDA one Triton launch (both modes take
    the Triton combine and output kernels there, and it has their bits), else the table's two
    ops composed."""
    if device.type == "cuda":
        from moe_kernels.triton_combine import moe_combine_output_triton

        return moe_combine_output_triton
    return partial(
        moe_combine_output_composed, moe_combine=ops["moe_combine"], moe_output=ops["moe_output"]
    )


def _grouped_gated_linear(
    ops: dict[str, Callable], device: torch.device, is_invariant: bool
) -> Callable:
    """The experts' gate_up GEMM and silu * up as one op: the table's grouped_linear and
    silu_mul composed, except where the Triton grouped GEMM runs on CUDA (invariant mode;
    fast mode at few rows an expert), which takes the one-launch kernel of the same bits."""
    composed = partial(
        grouped_gated_linear_composed,
        grouped_linear=ops["grouped_linear"],
        silu_mul=ops["silu_mul"],
    )
    if device.type != "cuda":
        return composed
    from moe_kernels.linear import grouped_linear_cuda_fast
    from moe_kernels.triton_grouped_linear import grouped_gated_linear_triton

    if is_invariant:
        return grouped_gated_linear_triton
    many_rows = partial(
        grouped_gated_linear_composed,
        grouped_linear=grouped_linear_cuda_fast,
        silu_mul=ops["silu_mul"],
    )
    return partial(
        grouped_linear_by_rows, few_rows=grouped_gated_linear_triton, many_rows=many_rows
    )


def _fast_decode_attention() -> Callable:
    # Why: mla_attention_fast syncs for its padded length; decode batches get FlashMLA or a
    # split-KV Triton kernel instead. Imported here so CPU-only workers never load either.
    from moe_kernels.fast_attention import mla_decode_fast

    return mla_decode_fast


def _triton_kernels(arrivals: torch.Tensor | StreamBuffers | None) -> dict[str, Callable]:
    """The CUDA Triton kernels of each op, the split-K linears bound to the table's arrival
    counts (_with_arrivals)."""
    # Imported here so CPU-only workers never load Triton's compiler front end.
    from moe_kernels.triton_activation import silu_mul_triton
    from moe_kernels.triton_attention import mla_attention_triton
    from moe_kernels.triton_combine import moe_combine_triton
    from moe_kernels.triton_grouped_linear import grouped_linear_triton
    from moe_kernels.triton_latent_cache import write_latent_cache_triton
    from moe_kernels.triton_linear import batched_linear_triton, linear_triton
    from moe_kernels.triton_moe_output import moe_output_triton
    from moe_kernels.triton_rmsnorm import add_rms_norm_triton, rms_norm_triton
    from moe_kernels.triton_router import router_logits_triton, router_topk_triton
    from moe_kernels.triton_softmax import log_softmax_triton, softmax_triton

    return {
        "linear": _with_arrivals(linear_triton, arrivals),
        "batched_linear": batched_linear_triton,
        "grouped_linear": grouped_linear_triton,
        "rms_norm": rms_norm_triton,
        "add_rms_norm": add_rms_norm_triton,  # one launch for the add and the norm
        "softmax": softmax_triton,
        "log_softmax": log_softmax_triton,
        "mla_attention": mla_attention_triton,
        # No x.float() launch: upcast in registers.
        "router_logits": _with_arrivals(router_logits_triton, arrivals),
        # Why a kernel and not torch: torch.softmax over experts and the weight-normalising
        # sum choose their CUDA launch plans from the tensor shape.
        "router_topk": router_topk_triton,
        # Why a kernel: the torch combine is ~14 launches per MoE layer on a decode step.
        "moe_combine": moe_combine_triton,
        "silu_mul": silu_mul_triton,  # one launch for ~7 torch ones
        "moe_output": moe_output_triton,  # one launch for the cast and two adds
        # Why fused: the unfused norm, two ropes, cat and index copy are six launches a layer;
        # the kernel calls the same jit helpers as the norm and rope kernels: the same bits.
        "write_latent_cache": write_latent_cache_triton,
    }


def pin_threads(config: KernelConfig) -> None:
    """Fix torch's process-wide settings a row's bits depend on: the intra-op thread count
    (part of the layout, not the load), IEEE fp32 matmuls and a float32 default dtype (torch's
    defaults: what a fresh process, a Ray rank, has)."""
    # Why: reduction plans (e.g. splitting one long row across threads) depend on the count;
    # a "medium" / "bf16" fp32 precision lets oneDNN (and TF32 on CUDA) round the operands; the
    # default dtype is that of every float tensor made from Python floats (the sampler's
    # temperatures and top_p). A caller of a world-size-1 LLM may have set any of them.
    torch.set_num_threads(config.num_threads)
    # By the legacy API too: it sets the matmul ones below and its own, which the new ones
    # alone left at a caller's "high" (set_float32_matmul_precision, allow_tf32 = True), a mix
    # torch refuses to read (allowTF32CuBLAS raises) and that reads "high" while IEEE runs.
    torch.set_float32_matmul_precision("highest")
    torch.backends.mkldnn.matmul.fp32_precision = "ieee"
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.set_default_dtype(torch.float32)


def process_state() -> tuple:
    """The settings `pin_threads` fixes, as they are now (for `restore_process_state`): the
    matmuls' fp32 precisions as set on them ("none" where they defer to a parent's)."""
    return (
        torch.get_num_threads(),
        _legacy_matmul_precision(),
        _own_fp32_precision("mkldnn", "matmul"),
        _own_fp32_precision("cuda", "matmul"),
        torch.get_default_dtype(),
    )


def _own_fp32_precision(backend: str, op: str) -> str:
    """The fp32 precision set on (backend, op) itself: "none" where it defers to its parent's
    ((backend, "all"), then torch.backends.fp32_precision). Why: torch's getter answers the
    value it defers to, and that value written back made it the op's own, which then stopped
    following the caller's parent setting (its later torch.backends.fp32_precision = "ieee"
    left the matmuls in TF32). Where the two agree, the parent is moved to another value and
    back to tell them apart."""
    get, put = torch._C._get_fp32_precision_getter, torch._C._set_fp32_precision_setter
    now = get(backend, op)
    parent = ("generic", "all") if op == "all" else (backend, "all")
    if backend == "generic" or now == "none" or now != get(*parent):
        return now  # the root, torch's default, or set on the op itself
    parents_own = _own_fp32_precision(*parent)
    probe = "tf32" if now == "ieee" else "ieee"  # accepted by every backend
    put(*parent, probe)
    try:
        return "none" if get(backend, op) == probe else now
    finally:
        put(*parent, parents_own)


def _legacy_matmul_precision() -> str | None:
    """torch.get_float32_matmul_precision(), or None where torch refuses to read it (settings
    of the legacy and the new API that already disagree)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


def is_pinned(state: tuple, config: KernelConfig) -> bool:
    """Whether `state` (process_state) is what `pin_threads(config)` sets, as torch computes
    and reads it: an op's "none" defers to its backend's, then to torch.backends.fp32_precision,
    whose own "none" is IEEE."""

    def ieee(backend: str, own: str) -> bool:
        if own == "none":  # what it defers to
            own = torch._C._get_fp32_precision_getter(backend, "all")
        return own in ("none", "ieee")

    threads, legacy, mkldnn, cuda, dtype = state
    return (
        threads == config.num_threads
        and legacy == "highest"
        and ieee("mkldnn", mkldnn)
        and ieee("cuda", cuda)
        and dtype == torch.float32
    )


def restore_process_state(state: tuple) -> None:
    threads, legacy, mkldnn, cuda, dtype = state
    torch.set_num_threads(threads)
    if legacy is not None:  # first: it sets the matmul ones too, which then get theirs back
        torch.set_float32_matmul_precision(legacy)
    torch.backends.mkldnn.matmul.fp32_precision = mkldnn
    torch.backends.cuda.matmul.fp32_precision = cuda
    torch.set_default_dtype(dtype)
