"""Batch-invariant paged MLA attention over the latent cache as Triton kernels (GPU path).

Contract of `mla_attention_ref` (moe_kernels/attention.py): query t attends to positions
0..positions[t] of sequence query_seq_ids[t], keys are whole cache rows [C], values their first
v_dim channels. One program per (query token, head block, KV split): it walks cache blocks
(chunks of exactly the cache block size, aligned to absolute positions) with an online softmax
in fp32. A split is a fixed run of SPLIT_BLOCKS blocks counted from position 0
(LONG_SPLIT_BLOCKS for a query of LONG_BLOCKS blocks or more; a query's last split also takes
up to TAIL_BLOCKS blocks past it: split_count), so which splits a query has depends on its own
position only; a second kernel merges a query's splits in split order.
Nothing a program computes depends on the other queries: prefill, decode and any chunking of a
prompt give the same bits. Under TRITON_INTERPRET=1 it runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from moe_kernels.attention_launch import (
    BLOCK_H,
    TABLE_AHEAD_MAX_PAIRS,
    check_runs,
    group_launch,
    head_launch,
    merge_heads,
    merge_warps,
    split_count,
    table_split_count,
    value_split,
    wide_value_parts,
    with_groups,
    with_long_blocks,
)
from moe_kernels.gluon_attention import fits_gluon, launch_wide_split
from moe_kernels.triton_attention_block import (
    _fold,
    _load_query,
    _own_splits,
    _split_blocks_of,
    _starts_run,
    _walk_run,
)
from moe_kernels.triton_pdl import pdl_launch, pdl_start

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PARTIAL_BYTES = 256 << 20  # cap on the fp32 split buffers of one launch (queries grouped)
MAX_GRID_Y = 65535  # CUDA's limit on grid axis 1, the launch's queries


# Why: batch-dependent ints are not specialised (==1, %16), so one compiled kernel serves
# every batch; specialisation would change only address arithmetic, never a float.
@triton.jit(do_not_specialize=["num_splits", "table_width"])
def _mla_split_kernel(
    q_ptr,
    kv_ptr,
    seq_ids_ptr,
    tables_ptr,
    positions_ptr,
    acc_ptr,
    stats_ptr,
    scale,
    num_heads,
    num_splits,
    table_width,
    C: tl.constexpr,
    V: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr,
    TAIL_BLOCKS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    V_PARTS: tl.constexpr,
    LAT_CHUNK: tl.constexpr,
    WHOLE_QUERY: tl.constexpr,
    TABLE_AHEAD: tl.constexpr,
    GROUP_BLOCKS: tl.constexpr = 0,
    GROUP_TAIL: tl.constexpr = 0,
    LONG_BLOCKS: tl.constexpr = 0,
    LONG_SPLIT_BLOCKS: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    """Partial (max, sum, acc) of one query's heads over one split of its cache blocks; with
    WRITE_OUT (the launch has one split) the finished acc / sum into out_ptr (= acc_ptr).

    WHOLE_QUERY (grid axis 2 of size 1, WRITE_OUT): the program walks every split of its
    query, each from a fresh state as above, and folds them in split order with the merge
    kernel's arithmetic (_fold), so it writes the bits of the split launch and its merge
    without their fp32 partials in HBM or the second launch.
    GROUP_BLOCKS > 0: the query's splits fold in groups (runs of GROUP_BLOCKS blocks from block
    0, the last taking up to GROUP_TAIL blocks more), then the groups in order: the two-level
    order of the merge kernel's GROUP_SLOTS. With WHOLE_QUERY (grid axis 2: the table's groups)
    the program walks one group and writes its fold as a partial (or, WRITE_OUT, the output),
    which the merge kernel folds in group order.
    LONG_BLOCKS > 0: a query of at least that many blocks has splits of LONG_SPLIT_BLOCKS
    (_split_blocks_of; never with groups), its last one taking up to TAIL_BLOCKS more too.

    Many heads (V_PARTS > 1): a program keeps only its 1 / V_PARTS of the value columns (the
    scores are recomputed by each part) and walks the latent in LAT_CHUNK-column dots, so a
    wide head block fits in registers."""
    pdl_start(PDL)
    # Why head blocks on the fastest grid axis: the programs of one query's head blocks run
    # side by side and read the same latent blocks, so HBM serves them once and L2 the rest.
    head_block = tl.program_id(0) // V_PARTS
    v_part = tl.program_id(0) % V_PARTS
    BLOCK_PV: tl.constexpr = BLOCK_V // V_PARTS
    IS_WHOLE: tl.constexpr = V_PARTS == 1 and LAT_CHUNK == BLOCK_V
    t = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)  # a KV split, or with WHOLE_QUERY and GROUP_BLOCKS a group
    position = tl.load(positions_ptr + t)
    num_blocks = position // BS + 1
    # The blocks a program walks from its first: a group's, every block (0), or a split's
    # (the query's own size), and the blocks its last run takes on past them (its tail).
    IS_GROUP: tl.constexpr = WHOLE_QUERY and GROUP_BLOCKS > 0
    RUN_TAIL: tl.constexpr = GROUP_TAIL if IS_GROUP else TAIL_BLOCKS
    if IS_GROUP:
        run = GROUP_BLOCKS
    elif WHOLE_QUERY:
        run = 0
    else:
        run = _split_blocks_of(num_blocks, SPLIT_BLOCKS, LONG_BLOCKS, LONG_SPLIT_BLOCKS)
    first_block = split * run
    # Run k > 0 of the query's own (_own_splits) exists where k * run + RUN_TAIL < num_blocks;
    # the last one runs to the query's last block.
    if first_block < tl.maximum(num_blocks - RUN_TAIL, 1):
        seq = tl.load(seq_ids_ptr + t)
        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < num_heads
        offs_v = tl.arange(0, BLOCK_V)
        offs_pv = v_part * BLOCK_PV + tl.arange(0, BLOCK_PV)  # this program's value columns
        offs_r = tl.arange(0, BLOCK_R)
        offs_s = tl.arange(0, BLOCK_S)
        v_ok = offs_v < V
        pv_ok = offs_pv < V
        r_ok = V + offs_r < C
        q_rows = q_ptr + (t * num_heads + heads)[:, None] * C
        q_lat, q_pe = _load_query(
            q_rows, head_ok, offs_v, v_ok, offs_r, r_ok, V, IS_WHOLE, UPCAST_DOT
        )
        IS_ALL_BLOCKS: tl.constexpr = WHOLE_QUERY and not IS_GROUP
        is_to_end = (first_block + run + RUN_TAIL >= num_blocks) | IS_ALL_BLOCKS
        last_block = tl.where(is_to_end, num_blocks, first_block + run)
        row_max, row_sum, acc = _walk_run(
            q_lat, q_pe, q_rows, kv_ptr, tables_ptr + seq * table_width, position, first_block,
            last_block, num_blocks, offs_s, head_ok, offs_pv, pv_ok, offs_r, r_ok, scale, V, C,
            BS, BLOCK_H, BLOCK_S, BLOCK_V, BLOCK_PV, LAT_CHUNK, IS_WHOLE, INPUT_PRECISION,
            UPCAST_DOT, SPLIT_BLOCKS, TAIL_BLOCKS, WHOLE_QUERY, TABLE_AHEAD, LONG_BLOCKS,
            LONG_SPLIT_BLOCKS,
        )  # fmt: skip
        if WRITE_OUT:
            # The merge kernel's one-split case, the same fp32 division: the same bits.
            out = acc / row_sum[:, None]
            tl.store(
                acc_ptr + (t * num_heads + heads)[:, None] * V + offs_pv[None, :],
                out,
                mask=head_ok[:, None] & pv_ok[None, :],
            )
            return
        slot = (t * num_splits + split) * num_heads + heads
        tl.store(
            acc_ptr + slot[:, None] * BLOCK_V + offs_pv[None, :],
            acc,
            mask=head_ok[:, None] & pv_ok[None, :],
        )
        stats_ok = head_ok & (v_part == 0)  # every part has the same stats: part 0 writes them
        tl.store(stats_ptr + slot * 2, row_max, mask=stats_ok)
        tl.store(stats_ptr + slot * 2 + 1, row_sum, mask=stats_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_merge_kernel(
    acc_ptr,
    stats_ptr,
    positions_ptr,
    out_ptr,
    num_heads,
    num_splits,
    V: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr,
    TAIL_BLOCKS: tl.constexpr,
    GROUP_SLOTS: tl.constexpr = 0,
    GROUP_TAIL: tl.constexpr = 0,
    ONE_SPLIT_WRITTEN: tl.constexpr = False,
    MERGE_HEADS: tl.constexpr = 1,
    LONG_BLOCKS: tl.constexpr = 0,
    LONG_SPLIT_BLOCKS: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    """out[t, h] = merge of the query's partials 0, 1, ... (its own: SPLIT_BLOCKS cache blocks
    a partial, LONG_SPLIT_BLOCKS for a query of LONG_BLOCKS blocks or more) in that order, then
    acc / sum, for MERGE_HEADS heads a program (each head's columns folded by the same fp32
    operations whatever heads share its program). GROUP_SLOTS
    > 0: the partials are KV splits in groups of GROUP_SLOTS (the last taking up to GROUP_TAIL
    blocks more), folded in order within a group, the groups' folds in group order (the bits of
    WHOLE_QUERY programs with GROUP_BLOCKS, and of a flat merge of group programs' partials).
    ONE_SPLIT_WRITTEN: the split kernel wrote the output of queries of one split itself (the
    Gluon kernel: acc / sum, this kernel's arithmetic), so they are skipped."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * MERGE_HEADS + tl.arange(0, MERGE_HEADS)
    head_ok = heads < num_heads
    position = tl.load(positions_ptr + t)
    num_blocks = position // BS + 1
    num_own_splits = _own_splits(
        num_blocks, SPLIT_BLOCKS, TAIL_BLOCKS, LONG_BLOCKS, LONG_SPLIT_BLOCKS
    )  # fmt: skip
    if ONE_SPLIT_WRITTEN and num_own_splits == 1:
        return
    offs_v = tl.arange(0, BLOCK_V)
    ok = head_ok[:, None] & (offs_v < V)[None, :]
    first = t * num_splits * num_heads + heads
    row_max = tl.load(stats_ptr + first * 2, mask=head_ok, other=0.0)
    row_sum = tl.load(stats_ptr + first * 2 + 1, mask=head_ok, other=1.0)
    acc = tl.load(acc_ptr + first[:, None] * BLOCK_V + offs_v[None, :], mask=ok, other=0.0)
    GROUP_BLOCKS: tl.constexpr = GROUP_SLOTS * SPLIT_BLOCKS
    if GROUP_SLOTS > 0:  # the groups folded so far (valid from the second group on)
        done_max = tl.full(row_max.shape, float("-inf"), dtype=tl.float32)
        done_sum = tl.zeros(row_sum.shape, dtype=tl.float32)
        done_acc = tl.zeros(acc.shape, dtype=tl.float32)
    # Why: a fixed merge order (split ascending) over splits fixed by the position alone.
    for split in range(1, num_own_splits):
        slot = (t * num_splits + split) * num_heads + heads
        part_max = tl.load(stats_ptr + slot * 2, mask=head_ok, other=0.0)
        part_sum = tl.load(stats_ptr + slot * 2 + 1, mask=head_ok, other=1.0)
        part_acc = tl.load(
            acc_ptr + slot[:, None] * BLOCK_V + offs_v[None, :], mask=ok, other=0.0
        )  # fmt: skip
        if GROUP_SLOTS > 0:
            # At a group's start the finished group folds in and a new one starts.
            if _starts_run(split * SPLIT_BLOCKS, GROUP_BLOCKS, GROUP_TAIL, num_blocks):
                done_max, done_sum, done_acc = _fold(
                    done_max, done_sum, done_acc, row_max, row_sum, acc, split == GROUP_SLOTS,
                    True,
                )  # fmt: skip
                # A fresh state: the fold below takes the split as it is (alpha 0, beta 1).
                row_max = tl.full(row_max.shape, float("-inf"), dtype=tl.float32)
                row_sum = tl.zeros(row_sum.shape, dtype=tl.float32)
                acc = tl.zeros(acc.shape, dtype=tl.float32)
        row_max, row_sum, acc = _fold(
            row_max, row_sum, acc, part_max, part_sum, part_acc, False, True
        )
    if GROUP_SLOTS > 0:  # the last group folded in (taken as it is if it is the only one)
        is_one_group = num_blocks <= GROUP_BLOCKS + GROUP_TAIL
        _, row_sum, acc = _fold(
            done_max, done_sum, done_acc, row_max, row_sum, acc, is_one_group, True
        )
    out = acc / row_sum[:, None]
    tl.store(out_ptr + (t * num_heads + heads)[:, None] * V + offs_v[None, :], out, mask=ok)


def _is_interpreted() -> bool:
    return isinstance(_mla_split_kernel, InterpretedFunction)


def _check(q, kv_cache, query_seq_ids, block_tables, positions, v_dim) -> None:
    allowed = ("cpu", "cuda") if _is_interpreted() else ("cuda",)
    tensors = {
        "q": q,
        "kv_cache": kv_cache,
        "query_seq_ids": query_seq_ids,
        "block_tables": block_tables,
        "positions": positions,
    }
    for name, t in tensors.items():
        if t.device.type not in allowed:
            raise ValueError(f"{name} must be on a device of type {allowed}, got {t.device}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if q.dim() != 3 or kv_cache.dim() != 3 or q.shape[2] != kv_cache.shape[2]:
        raise ValueError(
            f"need q [T, H, C] and kv_cache [NB, BS, C], got {tuple(q.shape)}, "
            f"{tuple(kv_cache.shape)}"
        )
    if q.dtype not in _DTYPES or kv_cache.dtype != q.dtype:
        raise ValueError(
            f"q and kv_cache must share a dtype in {_DTYPES}, got {q.dtype}, {kv_cache.dtype}"
        )
    num_tokens = q.shape[0]
    if query_seq_ids.shape != (num_tokens,) or positions.shape != (num_tokens,):
        raise ValueError(f"query_seq_ids and positions must be [{num_tokens}]")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [B, MB], got {tuple(block_tables.shape)}")
    if not 1 <= v_dim <= q.shape[2]:
        raise ValueError(f"v_dim must be in [1, {q.shape[2]}], got {v_dim}")


def mla_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_seq_ids: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: float,
    v_dim: int,
    whole_heads: int | None = None,
    group_splits: int | None = None,
    long_blocks: int | None = None,
    long_split_blocks: int | None = None,
) -> torch.Tensor:
    """q [T, H, C], kv_cache [NB, BS, C] (q's dtype), query_seq_ids/positions [T] int64,
    block_tables [B, MB] int64 (-1 padding past a sequence's end) -> [T, H, v_dim] q.dtype.
    whole_heads: the model's head count at TP 1 (None: H), whose launch (head_launch) a TP
    rank holding H of them keeps, so every TP degree gives the same bits. group_splits
    (models below 64 heads; None: the launch's): a query's splits folded in groups of this
    many, then the groups (attention_launch.with_groups; part of the bits). long_blocks
    (None: the launch's own): a query of at least this many cache blocks has splits of
    long_split_blocks (None: the launch's own), 0 never (attention_launch.with_long_blocks;
    part of the bits)."""
    _check(q, kv_cache, query_seq_ids, block_tables, positions, v_dim)
    if whole_heads is not None and whole_heads < q.shape[1]:
        raise ValueError(f"whole_heads {whole_heads} is below the {q.shape[1]} heads of q")
    # The launch (measured on the H200, BENCHMARKS.md) is fixed per model, so prefill and
    # decode compile the same kernel and round the same way.
    launch = head_launch(q.shape[1] if whole_heads is None else whole_heads)
    if long_blocks is not None or long_split_blocks is not None:
        launch = with_long_blocks(launch, long_blocks, long_split_blocks)
    if group_splits is not None:
        launch = with_groups(launch, group_splits)
    if launch.is_wide and q.element_size() > 2 and not _is_interpreted():
        raise ValueError(
            f"invariant attention of a {whole_heads or q.shape[1]}-head model (64 heads a "
            f"program) needs 16-bit q and kv_cache on the GPU, got {q.dtype}: the fp32 "
            "split kernel's cache blocks need 311 KB of shared memory (sm_90 has 227)"
        )
    # The interpreter's dots are numpy's, not checked across widths: it keeps whole head blocks.
    block_v = triton.next_power_of_2(v_dim)
    num_splits = launch.table_splits(block_tables.shape[1])
    is_narrow_launch = not launch.is_wide  # the narrow launch, its groups as configured
    is_narrow = is_narrow_launch and not _is_interpreted()
    v_parts, lat_chunk = (1, None)
    if is_narrow:
        v_parts, lat_chunk = value_split(q.shape[0], block_v, num_splits)
    is_wide = launch.is_wide and not _is_interpreted()
    is_gluon = is_wide and fits_gluon(q, kv_cache, v_dim, launch.block_h)
    if is_gluon:
        v_parts = wide_value_parts(q.shape[0], num_splits)
    whole_stages = None
    if is_narrow_launch and v_parts == 1:  # a program a query or a query's group
        whole_stages = group_launch(launch, q.shape[0], q.shape[1], block_tables.shape[1])
    # The table read ahead gives the pipeliner a second cache-block buffer: 16-bit blocks only
    # (fp32 blocks are twice the bytes: 336 KB of shared memory then, sm_90 has 227).
    is_ahead_ok = is_narrow_launch and q.element_size() == 2
    is_ahead = is_ahead_ok and q.shape[0] * num_splits <= TABLE_AHEAD_MAX_PAIRS
    return _attend(
        q, kv_cache, query_seq_ids, block_tables, positions, scale, v_dim, launch.split_blocks,
        launch.num_warps, whole_stages or launch.num_stages, launch.block_h, v_parts=v_parts,
        lat_chunk=lat_chunk, is_gluon=is_gluon,
        is_whole_query=whole_stages is not None,
        is_table_ahead=is_ahead or (whole_stages is not None and is_ahead_ok),
        tail_blocks=launch.tail_blocks, group_splits=launch.group_splits,
        group_tail=launch.group_tail, long_blocks=launch.long_blocks,
        long_split_blocks=launch.long_split_blocks,
    )  # fmt: skip


def _attend(
    q, kv_cache, query_seq_ids, block_tables, positions, scale, v_dim,
    split_blocks, num_warps, num_stages, block_h=BLOCK_H, v_parts=1, lat_chunk=None,
    is_gluon=False, is_whole_query=False, is_table_ahead=None, tail_blocks=0, group_splits=0,
    group_tail=0, merge_heads_per_program=None, long_blocks=0, long_split_blocks=0,
) -> torch.Tensor:  # fmt: skip
    """The launches; the launch parameters are arguments so bench/ can sweep them (tail_blocks:
    HeadLaunch's, the blocks a query's last split takes on past its whole splits). is_gluon:
    the Gluon split kernel (its own fixed warps and stages; fits_gluon's shapes);
    is_whole_query: a program a query's head block walks all its splits (the Triton kernel
    only: the Gluon one has the split launch alone, attention_launch.py says why);
    is_table_ahead (default: is_whole_query): each block's table entry read a block earlier;
    group_splits and group_tail (HeadLaunch's): a query's splits fold in groups of this many
    (0: one group), the last taking up to group_tail blocks more, then the groups; a
    whole-query launch then has a program a query's group. merge_heads_per_program: the merge
    launch's heads a program (default merge_heads's; no bit depends on it). long_blocks and
    long_split_blocks (HeadLaunch's): a query of at least long_blocks blocks has splits of
    long_split_blocks (long_blocks 0: never)."""
    check_runs(split_blocks, tail_blocks, group_splits, group_tail, long_blocks, long_split_blocks)
    long_split_blocks = long_split_blocks if long_blocks else 0  # one compile where they're off
    if group_splits and is_gluon:
        raise ValueError(f"group_splits {group_splits} needs the Triton kernel, not the Gluon one")
    if is_whole_query and is_gluon:
        raise ValueError("the whole-query launch needs the Triton kernel, not the Gluon one")
    group_blocks = group_splits * split_blocks
    num_tokens, num_heads, cache_dim = q.shape
    out = q.new_empty((num_tokens, num_heads, v_dim))
    if num_tokens == 0:  # a rank with no tokens still runs the step (EP lockstep)
        return out
    q, kv_cache, block_tables = q.contiguous(), kv_cache.contiguous(), block_tables.contiguous()
    block_size = kv_cache.shape[1]
    block_v = triton.next_power_of_2(v_dim)
    block_r = max(16, triton.next_power_of_2(max(cache_dim - v_dim, 1)))
    # No host sync: the launch's split count comes from the table width (a host shape, the
    # batch's longest block table). Queries with fewer splits skip the extra programs; no
    # query's result depends on this number.
    width = block_tables.shape[1]
    num_splits = table_split_count(width, split_blocks, tail_blocks, long_blocks, long_split_blocks)
    # What a partial (and a program along grid axis 2) covers, with its tail: a split, or a
    # group of them; the merge folds split partials in groups (merge_groups) or flat.
    slot_blocks, slot_tail, merge_groups = split_blocks, tail_blocks, group_splits
    is_groups = is_whole_query and group_splits > 0
    if is_groups:
        num_splits = split_count(width, group_blocks, group_tail)
        slot_blocks, slot_tail, merge_groups = group_blocks, group_tail, 0
    elif is_whole_query:
        num_splits = 1
    per_token = num_splits * num_heads * (block_v + 2) * 4
    group = min(max(1, PARTIAL_BYTES // per_token), MAX_GRID_Y)
    is_fp32 = q.dtype == torch.float32
    is_direct = num_splits == 1
    heads_a_merge = merge_heads_per_program or merge_heads(num_heads)
    for start in range(0, num_tokens, group):  # launch boundaries only: rows are independent
        rows = slice(start, min(start + group, num_tokens))
        count = rows.stop - rows.start
        if is_direct:
            acc, stats = out[rows], out  # stats never written: WRITE_OUT returns first
        else:  # fp32 whatever torch's default dtype is (a caller may have set bf16)
            f32 = torch.float32
            acc = torch.empty((count, num_splits, num_heads, block_v), dtype=f32, device=q.device)
            stats = torch.empty((count, num_splits, num_heads, 2), dtype=f32, device=q.device)
        seq_ids, pos = query_seq_ids[rows].contiguous(), positions[rows].contiguous()
        grid = (triton.cdiv(num_heads, block_h) * v_parts, count, num_splits)
        if is_gluon:
            launch_wide_split(
                grid, q[rows], kv_cache, seq_ids, block_tables, pos, acc, stats, out[rows],
                scale, num_splits, split_blocks, tail_blocks, is_direct, v_parts=v_parts,
                long_blocks=long_blocks, long_split_blocks=long_split_blocks,
            )  # fmt: skip
        else:
            _mla_split_kernel[grid](
                q[rows],
                kv_cache,
                seq_ids,
                block_tables,
                pos,
                acc,
                stats,
                scale,
                num_heads,
                num_splits,
                width,
                C=cache_dim,
                V=v_dim,
                BS=block_size,
                BLOCK_S=max(16, triton.next_power_of_2(block_size)),  # tl.dot needs 16 columns
                BLOCK_H=block_h,
                BLOCK_V=block_v,
                BLOCK_R=block_r,
                SPLIT_BLOCKS=split_blocks,
                TAIL_BLOCKS=tail_blocks,
                # fp32 inputs use exact fp32 products; 16-bit ones the MMA with fp32 accumulation.
                INPUT_PRECISION="ieee" if is_fp32 else "tf32",
                # The interpreter hands 16-bit floats to numpy as raw bits: feed it fp32.
                UPCAST_DOT=_is_interpreted() and not is_fp32,
                WRITE_OUT=is_direct,
                V_PARTS=v_parts,
                LAT_CHUNK=lat_chunk or block_v,
                WHOLE_QUERY=is_whole_query,
                TABLE_AHEAD=is_whole_query if is_table_ahead is None else is_table_ahead,
                GROUP_BLOCKS=group_blocks if is_whole_query else 0,
                GROUP_TAIL=group_tail if is_whole_query else 0,
                LONG_BLOCKS=long_blocks,
                LONG_SPLIT_BLOCKS=long_split_blocks,
                num_warps=num_warps if block_v >= 256 else 4,
                num_stages=num_stages,
                **pdl_launch(q.device),
            )
        if is_direct:
            continue
        _mla_merge_kernel[(count, triton.cdiv(num_heads, heads_a_merge))](
            acc,
            stats,
            pos,
            out[rows],
            num_heads,
            num_splits,
            V=v_dim,
            BS=block_size,
            BLOCK_V=block_v,
            SPLIT_BLOCKS=slot_blocks,
            TAIL_BLOCKS=slot_tail,
            GROUP_SLOTS=merge_groups,
            GROUP_TAIL=group_tail if merge_groups else 0,
            ONE_SPLIT_WRITTEN=is_gluon,
            MERGE_HEADS=heads_a_merge,
            LONG_BLOCKS=long_blocks,
            LONG_SPLIT_BLOCKS=long_split_blocks,
            num_warps=merge_warps(heads_a_merge),
            **pdl_launch(out.device),
        )
    return out
