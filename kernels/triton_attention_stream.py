"""The invariant MLA attention's stream launch (kernels/triton_attention.py's `_attend` calls
it; under TRITON_INTERPRET=1 it runs on CPU tensors): a fixed number of programs share a
launch's KV splits, each walking a contiguous run of them (query-major) in one loop across
split and query boundaries and writing every split's (max, sum, acc) for the merge kernel.

Why: the split launch gives each split of SPLIT_BLOCKS blocks its own program, which fills
its copy pipeline from empty; a stream program keeps its copies in flight from one split to
the next. Each split still starts from a fresh state and walks exactly its own blocks with
the shared `_attend_block`, so the partials, hence the merged bits, are the split launch's
whichever program computes them: the number of programs is a launch choice, never a bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_attention_block import _attend_block, _load_query


@triton.jit
def _pick(offs_t, t, values):
    """values[t] of a [BLOCK_T] vector."""
    return tl.sum(tl.where(offs_t == t, values, 0))


@triton.jit
def _split_start(s, offs_t, splits, split_end, num_tokens, SPLIT_BLOCKS: tl.constexpr):
    """(query t, its block j) where the launch's split s starts (splits query-major); s = the
    split count gives (num_tokens, 0)."""
    t = tl.minimum(tl.sum((split_end <= s).to(tl.int32)), num_tokens)
    j = (s - _pick(offs_t, t, split_end - splits)) * SPLIT_BLOCKS
    return t, tl.where(t < num_tokens, j, 0)


# Why batch-dependent ints are not specialised: one compiled kernel a BLOCK_T serves every
# launch; specialisation changes address arithmetic only, never a float.
@triton.jit(do_not_specialize=["num_tokens", "num_splits", "table_width"])
def _mla_stream_kernel(
    q_ptr,
    kv_ptr,
    seq_ids_ptr,
    tables_ptr,
    positions_ptr,
    acc_ptr,
    stats_ptr,
    scale,
    num_heads,
    num_tokens,
    num_splits,
    table_width,
    C: tl.constexpr,
    V: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Grid (head blocks, programs): program p takes the launch's splits [p S / P, (p + 1) S
    / P) of S in all (query-major, each query's by its position alone) and writes each one's
    partial where the split launch does (acc [T, num_splits, H, BLOCK_V], stats [.., 2]).
    BLOCK_T > num_tokens (a power of two): the prologue reads every query's position."""
    head_block = tl.program_id(0)
    program = tl.program_id(1)
    offs_t = tl.arange(0, BLOCK_T)
    t_ok = offs_t < num_tokens
    blocks = tl.where(t_ok, tl.load(positions_ptr + offs_t, mask=t_ok, other=0) // BS + 1, 0)
    splits = (blocks + SPLIT_BLOCKS - 1) // SPLIT_BLOCKS
    split_end = tl.cumsum(splits, 0)
    total = tl.sum(splits)
    first = program * total // tl.num_programs(1)
    stop = (program + 1) * total // tl.num_programs(1)
    if first < stop:
        t_first, j_first = _split_start(first, offs_t, splits, split_end, num_tokens, SPLIT_BLOCKS)
        t_stop, j_stop = _split_start(stop, offs_t, splits, split_end, num_tokens, SPLIT_BLOCKS)
        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < num_heads
        offs_v = tl.arange(0, BLOCK_V)
        offs_r = tl.arange(0, BLOCK_R)
        offs_s = tl.arange(0, BLOCK_S)
        v_ok = offs_v < V
        r_ok = V + offs_r < C
        # Why a loop over queries around the loop over blocks: the query's parts stay loop
        # invariants of the pipelined loop (reloading them inside it spilled the registers).
        t_first = t_first.to(tl.int64)  # the loop's index type: int64 addresses
        for t in range(t_first, t_stop + (j_stop > 0)):
            position = tl.load(positions_ptr + t)
            num_blocks = position // BS + 1
            j_start = tl.where(t == t_first, j_first, 0)
            j_end = tl.where(t == t_stop, j_stop, num_blocks)
            table_row = tables_ptr + tl.load(seq_ids_ptr + t) * table_width
            q_rows = q_ptr + (t * num_heads + heads)[:, None] * C
            q_lat, q_pe = _load_query(q_rows, head_ok, offs_v, v_ok, offs_r, r_ok, V, UPCAST_DOT)
            row_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
            row_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_H, BLOCK_V), dtype=tl.float32)
            slots = (t * num_splits + j_start // SPLIT_BLOCKS) * num_heads + heads
            # Why the table entry read a block ahead: as the split kernel's TABLE_AHEAD.
            next_id = tl.load(table_row + j_start).to(tl.int64)
            for j in range(j_start, j_end):
                if (j % SPLIT_BLOCKS == 0) & (j > j_start):  # a split done: its partial
                    _store_partial(acc_ptr, stats_ptr, slots, acc, row_max, row_sum, head_ok,
                                   offs_v, v_ok, BLOCK_V)  # fmt: skip
                    slots += num_heads
                    row_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
                    row_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
                    acc = tl.zeros((BLOCK_H, BLOCK_V), dtype=tl.float32)
                block_id = next_id
                next_id = tl.load(table_row + tl.minimum(j + 1, j_end - 1)).to(tl.int64)
                kv_ok = (offs_s < BS) & (j * BS + offs_s <= position)
                kv_rows = kv_ptr + (block_id * BS + offs_s)[:, None] * C
                row_max, row_sum, acc = _attend_block(
                    q_lat, q_pe, q_rows, kv_rows, kv_ok, head_ok, offs_v, v_ok, offs_r, r_ok,
                    row_max, row_sum, acc, scale, V, C, BLOCK_H, BLOCK_S, BLOCK_V, BLOCK_V,
                    True, INPUT_PRECISION, UPCAST_DOT,
                )  # fmt: skip
            # The query's last split here ends at a split boundary or at the query's end.
            _store_partial(acc_ptr, stats_ptr, slots, acc, row_max, row_sum, head_ok, offs_v,
                           v_ok, BLOCK_V)  # fmt: skip


@triton.jit
def _store_partial(acc_ptr, stats_ptr, slots, acc, row_max, row_sum, head_ok, offs_v, v_ok,
                   BLOCK_V: tl.constexpr):  # fmt: skip
    """A split's (acc, max, sum) into its slots (the split launch's layout)."""
    tl.store(
        acc_ptr + slots[:, None] * BLOCK_V + offs_v[None, :],
        acc,
        mask=head_ok[:, None] & v_ok[None, :],
    )
    tl.store(stats_ptr + slots * 2, row_max, mask=head_ok)
    tl.store(stats_ptr + slots * 2 + 1, row_sum, mask=head_ok)


def launch_stream(
    num_programs, q, kv_cache, seq_ids, block_tables, positions, acc, stats, scale, v_dim,
    split_blocks, input_precision, upcast_dot, num_warps, num_stages,
) -> None:  # fmt: skip
    """One stream launch of num_programs programs a head block into the split buffers acc
    [T, num_splits, H, BLOCK_V] / stats [T, num_splits, H, 2], as `_attend` launches the split
    kernel (its merge kernel follows)."""
    num_tokens, num_heads, cache_dim = q.shape
    block_size = kv_cache.shape[1]
    block_v = triton.next_power_of_2(v_dim)
    grid = (triton.cdiv(num_heads, 16), num_programs)
    _mla_stream_kernel[grid](
        q, kv_cache, seq_ids, block_tables, positions, acc, stats, scale, num_heads,
        num_tokens, acc.shape[1], block_tables.shape[1],
        C=cache_dim, V=v_dim, BS=block_size, BLOCK_S=max(16, triton.next_power_of_2(block_size)),
        BLOCK_H=16, BLOCK_V=block_v,
        BLOCK_R=max(16, triton.next_power_of_2(max(cache_dim - v_dim, 1))),
        BLOCK_T=triton.next_power_of_2(num_tokens + 1), SPLIT_BLOCKS=split_blocks,
        INPUT_PRECISION=input_precision, UPCAST_DOT=upcast_dot,
        num_warps=num_warps if block_v >= 256 else 4, num_stages=num_stages,
    )  # fmt: skip
