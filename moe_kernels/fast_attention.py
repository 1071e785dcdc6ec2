"""Fast-mode paged MLA decode attention on CUDA: capturable in a CUDA graph, not batch-invariant.

The best non-invariant decode attention a user could run, the baseline that prices invariance:
DeepSeek's FlashMLA (the optional `flash_mla` package, dense bf16 decode on SM90) where it fits
and is the faster (the invariant launch or the split-KV kernel where that was measured faster:
takes_invariant_launch, takes_split_kv), else the split-KV Triton kernel of
moe_kernels/triton_attention.py with its split length chosen from the batch shape to fill the
GPU. Neither path syncs with the host: every size comes from tensor shapes, so a decode step
can be captured and replayed with new positions. Contract of `mla_attention_fast`
(moe_kernels/attention.py); batches that are not decode-shaped run the paged Triton kernel
(moe_kernels/triton_attention.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton

from moe_kernels.attention_launch import NARROW_LAUNCH, head_launch, split_count
from moe_kernels.triton_attention import BLOCK_H, _attend, _check, mla_attention_triton

try:
    import flash_mla
except (ImportError, OSError, RuntimeError):
    # Why all three: a missing package, a CUDA runtime its library cannot dlopen (OSError), or
    # an op registration torch refuses (RuntimeError) must each leave fast mode on Triton.
    flash_mla = None

# Dense MLA decode lives on FlashMLA's legacy (SM90) side only.
HAS_FLASH_MLA = flash_mla is not None and flash_mla.has_legacy()
FLASH_MLA_BLOCK_SIZE = 64  # page block size, head dims and GPU that its dense decode accepts
FLASH_MLA_HEAD_DIM = 576
FLASH_MLA_V_DIM = 512
FLASH_MLA_CAPABILITY = (9, 0)
# Decode batches of models below the wide launch's head count take the invariant launch
# (mla_attention_triton) instead of FlashMLA where it was the faster: at most
# INVARIANT_MAX_PAIRS (query, KV split) pairs (its split launch; the splits counted from the
# table's width) or at least INVARIANT_MIN_QUERIES queries (its whole-query launch at two
# stages). H200, V2-Lite's 16 heads, graph replay, tables as wide as the engine's graphs,
# FlashMLA with one plan a step (BENCHMARKS.md, twenty-fourth session, `bench/gpu_kernels.py
# fast_choice`), µs FlashMLA / invariant: context 1024 B = 1 12.3 / 11.6, B = 64 (256 pairs)
# 36.5 / 32.0, B = 256 91.0 / 84.3; context 4096 B = 1 23.8 / 13.2, B = 16 (256 pairs) 35.2 /
# 32.5, B = 256 304.1 / 297.2. It lost from 512 pairs below 256 queries at context 4096 (B = 32
# 53.1 / 60.3, B = 64 90.8 / 110.6, B = 128 158.2 / 166.0) and won at context 1024 B = 128
# (51.5 / 48.1), left to FlashMLA by this rule. At 128 heads FlashMLA won everywhere against it.
INVARIANT_MAX_PAIRS = 256
# Decode batches of at most SPLIT_KV_MAX_QUERIES queries of models of the wide launch's head
# count take the split-KV kernel instead of FlashMLA: in the step its Triton launches chain by
# PDL, where FlashMLA takes the fence's plain launch (_wait_for_earlier_kernels) and two of its own.
# H200 through the engine, V2-Lite with 128 heads, graphs, context ~1024, cuBLAS's W_UK / W_UV
# (two runs each, median ms a step of 5 blocks of 8, FlashMLA / split-KV; BENCHMARKS.md,
# twenty-ninth session): B = 1 3.56, 3.51 / 3.39, 3.33; B = 2 4.39, 4.39 / 4.30, 4.30; B = 4
# 5.49, 5.51 / 5.44, 5.36; B = 8 6.89, 6.95 / 6.95, 6.83 (a tie); B = 16 8.68, 8.66 / 8.89, 8.79;
# B = 32 9.67-9.69 / 10.53-10.54; B = 64 10.53 / 12.57, B = 256 18.73 / 25.77 (one run).
SPLIT_KV_MAX_QUERIES = 4
INVARIANT_MIN_QUERIES = 256
WAVES = 2  # split-KV launches aim at this many programs per SM: the tail of a wave is hidden
NUM_WARPS, NUM_STAGES = 4, 3  # the invariant kernel's measured launch shape (BENCHMARKS.md)


def mla_decode_fast(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_seq_ids: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: float,
    v_dim: int,
    whole_heads: int | None = None,
) -> torch.Tensor:
    """q [T, H, C], kv_cache [NB, BS, C], query_seq_ids/positions [T] int64, block_tables [B, MB]
    int64 (-1 padding past a sequence's end) -> [T, H, v_dim] in q.dtype. whole_heads: the
    model's heads at TP 1, for the paged kernel's launch (mla_attention_triton).

    Decode-shaped (T == B: every sequence has one query, so query t is sequence t, the model
    runner's layout) runs FlashMLA, the invariant launch or the split-KV kernel; any other
    batch (prefill chunks) runs the paged Triton kernel of invariant mode, the fastest prefill
    attention here (plain torch attention is several times slower, so a fast mode with it
    would flatter invariance).
    No path syncs with the host.
    """
    num_tokens, table_width = q.shape[0], block_tables.shape[1]
    if num_tokens == block_tables.shape[0]:  # decode-shaped
        if num_tokens == 0:  # a rank with no tokens still runs the step (EP lockstep)
            return q.new_empty((0, q.shape[1], v_dim))
        if not uses_flash_mla(q, kv_cache, v_dim) or takes_split_kv(
            num_tokens, whole_heads or q.shape[1]
        ):
            return mla_decode_split_kv(
                q, kv_cache, query_seq_ids, block_tables, positions, scale=scale, v_dim=v_dim
            )
        if not takes_invariant_launch(num_tokens, table_width, whole_heads or q.shape[1]):
            return _decode_flash_mla(q, kv_cache, block_tables, positions, scale, v_dim)
    return mla_attention_triton(
        q, kv_cache, query_seq_ids, block_tables, positions, scale=scale, v_dim=v_dim,
        whole_heads=whole_heads,
    )  # fmt: skip


def mla_decode_split_kv(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_seq_ids: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: float,
    v_dim: int,
    split_blocks: int | None = None,
) -> torch.Tensor:
    """The Triton split-KV path, same contract; split_blocks (cache blocks per KV split) is
    chosen from the batch shape unless given. Its result depends on that choice."""
    _check(q, kv_cache, query_seq_ids, block_tables, positions, v_dim)
    if split_blocks is None:
        num_tokens, num_heads = q.shape[:2]
        split_blocks = choose_split_blocks(
            num_tokens, num_heads, block_tables.shape[1], _num_sms(q.device)
        )
    args = (q, kv_cache, query_seq_ids, block_tables, positions, scale, v_dim)
    return _attend(*args, split_blocks, NUM_WARPS, NUM_STAGES)


def choose_split_blocks(num_tokens: int, num_heads: int, table_width: int, num_sms: int) -> int:
    """Cache blocks per KV split such that the launch's T x head blocks x splits programs reach
    WAVES per SM; host ints only. The table width (the batch's longest table, or the graph's
    padded one) bounds a query's blocks: a split past a query's position exits at once."""
    programs_per_split = num_tokens * triton.cdiv(num_heads, BLOCK_H)
    num_splits = triton.cdiv(WAVES * num_sms, programs_per_split)
    # Floor: cdiv(table_width, split_blocks) >= num_splits whenever the table allows it.
    return max(1, table_width // num_splits)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the Triton interpreter runs one program at a time
    return torch.cuda.get_device_properties(device).multi_processor_count  # cached, no sync


def takes_invariant_launch(num_tokens: int, table_width: int, whole_heads: int) -> bool:
    """Whether a decode batch that FlashMLA could serve runs the invariant launch instead
    (INVARIANT_MAX_PAIRS, INVARIANT_MIN_QUERIES): host shapes only, so a graph keeps its
    choice. whole_heads: the model's heads at TP 1, which pick the launch."""
    launch = head_launch(whole_heads)
    if launch is not NARROW_LAUNCH:
        return False
    pairs = num_tokens * split_count(table_width, launch.split_blocks, launch.tail_blocks)
    return pairs <= INVARIANT_MAX_PAIRS or num_tokens >= INVARIANT_MIN_QUERIES


def takes_split_kv(num_tokens: int, whole_heads: int) -> bool:
    """Whether a decode batch that FlashMLA could serve runs the split-KV kernel instead
    (SPLIT_KV_MAX_QUERIES; models of the wide launch's head count): host shapes only."""
    return head_launch(whole_heads) is not NARROW_LAUNCH and num_tokens <= SPLIT_KV_MAX_QUERIES


def uses_flash_mla(q: torch.Tensor, kv_cache: torch.Tensor, v_dim: int) -> bool:
    """Whether a decode-shaped batch with these inputs runs FlashMLA (host checks only)."""
    return (
        HAS_FLASH_MLA
        and q.is_cuda
        and q.dtype == kv_cache.dtype == torch.bfloat16
        and kv_cache.shape[1] == FLASH_MLA_BLOCK_SIZE
        and q.shape[2] == kv_cache.shape[2] == FLASH_MLA_HEAD_DIM
        and v_dim == FLASH_MLA_V_DIM
        and torch.cuda.get_device_capability(q.device) == FLASH_MLA_CAPABILITY
    )


@dataclass
class _StepPlan:
    """What every layer of one decode step shares: FlashMLA's int32 lengths and tables and its
    scheduler metadata (filled on the device by the step's first call, reused by the rest)."""

    positions: weakref.ref
    positions_version: int | None
    tables: torch.Tensor  # the step's block_tables (identity and version checked)
    tables_version: int | None
    is_capturing: bool
    cache_seqlens: torch.Tensor
    int_tables: torch.Tensor
    sched_meta: object
    fence: torch.Tensor  # one element: _wait_for_earlier_kernels writes it


# Keyed by id() of the step's positions tensor; an entry holds the tensor weakly and is dropped
# when it dies (tensors compare elementwise, so they cannot key a WeakKeyDictionary).
_STEP_PLANS: dict[int, _StepPlan] = {}


def _version(t: torch.Tensor) -> int | None:
    """t's in-place write counter; None for inference tensors, which keep none (the runtime
    builds every step's batch tensors afresh, so identity alone tells its steps apart)."""
    return None if t.is_inference() else t._version


def _step_plan(block_tables: torch.Tensor, positions: torch.Tensor) -> _StepPlan:
    """The plan of the step these tensors belong to: the same tensor objects, unmodified, seen
    in the same capture state (a CUDA graph's warm-up and its capture share the static batch
    but not the plan: the captured step must compute its own metadata, on its own replays)."""
    is_capturing = torch.cuda.is_current_stream_capturing()
    key = id(positions)
    plan = _STEP_PLANS.get(key)
    if (
        plan is None
        or plan.positions() is not positions
        or plan.positions_version != _version(positions)
        or plan.tables is not block_tables
        or plan.tables_version != _version(block_tables)
        or plan.is_capturing != is_capturing
    ):
        # -1 padding lies past cache_seqlens and is never attended; block 0 keeps every entry
        # a valid address anyway. FlashMLA reads int32 tables.
        plan = _StepPlan(
            weakref.ref(positions, lambda _, key=key: _STEP_PLANS.pop(key, None)),
            _version(positions),
            block_tables,
            _version(block_tables),
            is_capturing,
            cache_seqlens=(positions + 1).to(torch.int32),  # [B]: sequence t's length
            int_tables=block_tables.clamp(min=0).to(torch.int32),
            # Empty: the step's first call fills it on the device from cache_seqlens, so a
            # graph replay re-plans for its own lengths with no host sync.
            sched_meta=flash_mla.get_mla_metadata()[0],
            fence=torch.zeros(1, dtype=torch.int32, device=positions.device),
        )
        _STEP_PLANS[key] = plan
    return plan


def _wait_for_earlier_kernels(plan: _StepPlan) -> None:
    """One plain launch (torch's fill of the plan's one-element fence) before FlashMLA's decode
    kernel. Why: that kernel is launched with programmatic stream serialization (PDL) but does
    not wait for the grid before it (its source leaves cudaGridDependencySynchronize out and
    relies on the kernel before it not letting it launch early), while the Triton kernels here
    let the next kernel launch as they start (moe_kernels/triton_pdl.py). After one of them
    FlashMLA read the query or this step's cache row half written: in the engine at 128 heads
    and B = 1, with cuBLAS's W_UK beside the cache write, the hidden state went bad and the
    router's expert ids out of range, in every run with PDL on and in none without (H200,
    twenty-ninth session). A plain launch starts when every kernel before it has ended and
    lets FlashMLA start only when it ends itself. (The step's first layer had that by chance:
    the metadata kernel, a plain launch, came right before it.)"""
    plan.fence.zero_()


def _decode_flash_mla(q, kv_cache, block_tables, positions, scale, v_dim) -> torch.Tensor:
    """FlashMLA dense decode: query t is sequence t (one query each), any head count (MQA with
    one KV head: the query heads need only divide by it). The layers of a step share one plan:
    one metadata kernel a step instead of one a layer."""
    plan = _step_plan(block_tables, positions)
    cache_seqlens, tables, sched_meta = plan.cache_seqlens, plan.int_tables, plan.sched_meta
    _wait_for_earlier_kernels(plan)
    out, _ = flash_mla.flash_mla_with_kvcache(
        q.unsqueeze(1),  # [B, s_q = 1, H, 576]
        kv_cache.unsqueeze(2),  # [NB, 64, h_kv = 1, 576]
        tables,
        cache_seqlens,
        v_dim,
        sched_meta,
        softmax_scale=scale,
        causal=False,  # one query per sequence: nothing to mask beyond cache_seqlens
        use_legacy=True,  # dense (non-sparse) decode exists only in the legacy kernels
    )
    return out.squeeze(1)  # [B, H, v_dim] bf16
