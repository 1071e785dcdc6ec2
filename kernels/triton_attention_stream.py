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
def _split_start(s, offs_t, splits, split_end, blocks, block_end, SPLIT_BLOCKS: tl.constexpr):
    """(query t, its block j, the launch's block index) where the launch's split s starts
    (splits query-major; s = the split count gives one past the last block: t is then a lane
    past the launch's queries, where splits and blocks are 0 and the ends are the totals)."""
    t = tl.sum((split_end <= s).to(tl.int32))
    j = (s - _pick(offs_t, t, split_end - splits)) * SPLIT_BLOCKS
    return t, j, _pick(offs_t, t, block_end - blocks) + j


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
    block_end = tl.cumsum(blocks, 0)
    total = tl.sum(splits)
    first = program * total // tl.num_programs(1)
    stop = (program + 1) * total // tl.num_programs(1)
    if first < stop:
        t, j, walk_first = _split_start(
            first, offs_t, splits, split_end, blocks, block_end, SPLIT_BLOCKS
        )
        _, _, walk_stop = _split_start(
            stop, offs_t, splits, split_end, blocks, block_end, SPLIT_BLOCKS
        )
        t = t.to(tl.int64)
        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < num_heads
        offs_v = tl.arange(0, BLOCK_V)
        offs_r = tl.arange(0, BLOCK_R)
        offs_s = tl.arange(0, BLOCK_S)
        v_ok = offs_v < V
        r_ok = V + offs_r < C
        position = tl.load(positions_ptr + t)
        num_blocks = position // BS + 1
        table_row = tables_ptr + tl.load(seq_ids_ptr + t) * table_width
        q_rows = q_ptr + (t * num_heads + heads)[:, None] * C
        q_lat, q_pe = _load_query(q_rows, head_ok, offs_v, v_ok, offs_r, r_ok, V, UPCAST_DOT)
        row_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_V), dtype=tl.float32)
        # Why the table entry read a block ahead: the copy's address then comes from the
        # loop-carried id, which the pipeliner can issue stages early (as TABLE_AHEAD).
        next_id = tl.load(table_row + j).to(tl.int64)
        for _ in range(walk_first, walk_stop):
            block_id = next_id
            kv_ok = (offs_s < BS) & (j * BS + offs_s <= position)
            kv_rows = kv_ptr + (block_id * BS + offs_s)[:, None] * C
            row_max, row_sum, acc = _attend_block(
                q_lat, q_pe, q_rows, kv_rows, kv_ok, head_ok, offs_v, v_ok, offs_r, r_ok,
                row_max, row_sum, acc, scale, V, C, BLOCK_H, BLOCK_S, BLOCK_V, BLOCK_V, True,
                INPUT_PRECISION, UPCAST_DOT,
            )  # fmt: skip
            j += 1
            if (j % SPLIT_BLOCKS == 0) | (j == num_blocks):  # a split done: its partial
                slot = (t * num_splits + (j - 1) // SPLIT_BLOCKS) * num_heads + heads
                tl.store(
                    acc_ptr + slot[:, None] * BLOCK_V + offs_v[None, :],
                    acc,
                    mask=head_ok[:, None] & v_ok[None, :],
                )
                tl.store(stats_ptr + slot * 2, row_max, mask=head_ok)
                tl.store(stats_ptr + slot * 2 + 1, row_sum, mask=head_ok)
                row_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
                row_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
                acc = tl.zeros((BLOCK_H, BLOCK_V), dtype=tl.float32)
            if j == num_blocks:  # the query done: the next one's (the last query's at the end)
                t = tl.minimum(t + 1, num_tokens - 1)
                j -= num_blocks
                position = tl.load(positions_ptr + t)
                num_blocks = position // BS + 1
                table_row = tables_ptr + tl.load(seq_ids_ptr + t) * table_width
                q_rows = q_ptr + (t * num_heads + heads)[:, None] * C
                q_lat, q_pe = _load_query(
                    q_rows, head_ok, offs_v, v_ok, offs_r, r_ok, V, UPCAST_DOT
                )
            next_id = tl.load(table_row + tl.minimum(j, num_blocks - 1)).to(tl.int64)


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
