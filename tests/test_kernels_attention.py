"""Paged MLA attention: closeness to fp64, prefill == decode == chunked bitwise, fast control.

Three sequences of different lengths live in scattered cache blocks (BS = 4) with -1 padding
in the block table and NaN garbage in every unwritten slot, so masking is tested too.
"""

from functools import partial

import pytest
import torch

from moe_kernels.attention import mla_attention_fast, mla_attention_ref

NUM_HEADS, KV_LORA_RANK, ROPE_DIM, BLOCK_SIZE = 4, 64, 8, 4
CACHE_DIM = KV_LORA_RANK + ROPE_DIM
SCALE = CACHE_DIM**-0.5
SEQ_LENS = (13, 5, 30)  # crosses block boundaries; one sequence shorter than two blocks
TILE_SIZES = (4, 16)


@pytest.fixture
def paged_cache(generator):
    """kv_cache [NB, BS, C] with the sequences written, block_tables [B, MB], one q per token."""
    max_blocks = max(SEQ_LENS) // BLOCK_SIZE + 2
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in SEQ_LENS) + 3
    kv_cache = torch.full((num_blocks, BLOCK_SIZE, CACHE_DIM), float("nan"))
    block_tables = torch.full((len(SEQ_LENS), max_blocks), -1, dtype=torch.int64)
    free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
    for seq_id, seq_len in enumerate(SEQ_LENS):
        for j in range(-(-seq_len // BLOCK_SIZE)):
            block_tables[seq_id, j] = free_blocks.pop()
        for pos in range(seq_len):
            block = block_tables[seq_id, pos // BLOCK_SIZE]
            kv_cache[block, pos % BLOCK_SIZE] = torch.randn(CACHE_DIM, generator=generator)
    seq_ids = torch.cat([torch.full((n,), s) for s, n in enumerate(SEQ_LENS)])
    positions = torch.cat([torch.arange(n) for n in SEQ_LENS])
    q = torch.randn(len(seq_ids), NUM_HEADS, CACHE_DIM, generator=generator)
    return q, kv_cache, seq_ids, block_tables, positions


def _run(op, q, kv_cache, seq_ids, block_tables, positions, rows, **kwargs):
    rows = torch.as_tensor(rows, dtype=torch.int64)
    return op(
        q[rows],
        kv_cache,
        seq_ids[rows],
        block_tables,
        positions[rows],
        scale=SCALE,
        v_dim=KV_LORA_RANK,
        **kwargs,
    )


def _fp64_attention(q, kv_cache, seq_ids, block_tables, positions):
    out = []
    for t in range(len(q)):
        kv_positions = torch.arange(int(positions[t]) + 1)
        blocks = block_tables[seq_ids[t], kv_positions // BLOCK_SIZE]
        kv = kv_cache[blocks, kv_positions % BLOCK_SIZE].double()
        probs = torch.softmax(q[t].double() @ kv.t() * SCALE, -1)
        out.append(probs @ kv[:, :KV_LORA_RANK])
    return torch.stack(out)


def _rows_of(seq_id, seq_ids):
    return (seq_ids == seq_id).nonzero().squeeze(1).tolist()


@pytest.mark.parametrize("tile_rows", TILE_SIZES)
def test_attention_ref_close_to_fp64_and_fast(paged_cache, tile_rows):
    everyone = range(len(paged_cache[2]))
    out = _run(mla_attention_ref, *paged_cache, everyone, tile_rows=tile_rows)
    assert out.shape == (len(everyone), NUM_HEADS, KV_LORA_RANK) and out.isfinite().all()
    expected = _fp64_attention(*paged_cache).float()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)  # fp32, <= 30 positions
    fast = _run(mla_attention_fast, *paged_cache, everyone)
    torch.testing.assert_close(out, fast, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tile_rows", TILE_SIZES)
def test_attention_ref_prefill_equals_decode_bitwise(paged_cache, tile_rows):
    q, kv_cache, seq_ids, block_tables, positions = paged_cache

    def attend(rows):
        return _run(mla_attention_ref, *paged_cache, rows, tile_rows=tile_rows)

    prefill = attend(range(len(seq_ids)))
    seq0, seq1, seq2 = (_rows_of(s, seq_ids) for s in range(3))
    # A sequence's prefill alone, and chunked prefill in pieces that cut through blocks.
    assert torch.equal(attend(seq2), prefill[seq2])
    for chunk in (seq2[:6], seq2[6:19], seq2[19:]):
        assert torch.equal(attend(chunk), prefill[chunk])
    for step, row in enumerate(seq2):
        # Decode-style: one query of seq 2 alone, or batched with other sequences' queries.
        assert torch.equal(attend([row])[0], prefill[row])
        neighbours = [seq0[step % len(seq0)], seq1[step % len(seq1)]][: step % 3]
        batch = neighbours + [row] if step % 2 else [row] + neighbours
        assert torch.equal(attend(batch)[batch.index(row)], prefill[row])
    perm = torch.randperm(len(seq_ids), generator=torch.Generator().manual_seed(1))
    assert torch.equal(attend(perm), prefill[perm])


def test_attention_ref_empty_batch(paged_cache):
    out = _run(mla_attention_ref, *paged_cache, [], tile_rows=4)
    assert out.shape == (0, NUM_HEADS, KV_LORA_RANK)


def test_attention_fast_prefill_differs_from_decode(paged_cache):
    # Negative control: per-sequence matmuls have M = number of queries, 30 in prefill, 1 in
    # decode, and CPU BLAS rounds the two differently.
    seq2 = _rows_of(2, paged_cache[2])
    prefill = _run(mla_attention_fast, *paged_cache, seq2)
    decode = torch.cat([_run(mla_attention_fast, *paged_cache, [row]) for row in seq2])
    assert not torch.equal(prefill, decode)


def test_zero_queries_give_an_empty_result():
    # An expert-parallel rank with no requests still runs every step on zero tokens.
    q = torch.zeros(0, 2, 6)
    cache = torch.zeros(3, 4, 6)
    empty = torch.zeros(0, dtype=torch.int64)
    for fn in (partial(mla_attention_ref, tile_rows=4), mla_attention_fast):
        out = fn(q, cache, empty, torch.zeros(0, 1, dtype=torch.int64), empty, scale=0.5, v_dim=4)
        assert out.shape == (0, 2, 4)


def test_a_heads_bits_ignore_the_heads_per_call(generator):
    """Tensor parallelism hands each rank H / tp heads: the reference computes each head alone,
    so at DeepSeek-V2-Lite's latent width (576 = 512 + 64, blocks of 64, 16 heads) any split
    of the heads gives the same bits. Control: the fast path's one bmm over all heads rounds a
    head by the head count (MKL), so some split of it differs."""
    heads, cache_dim, v_dim, block = 16, 576, 512, 64
    kv_cache = torch.randn(8, block, cache_dim, generator=generator)
    q = torch.randn(5, heads, cache_dim, generator=generator)
    tables = torch.arange(8).view(2, 4)
    seq_ids, positions = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([3, 70, 100, 200, 255])

    def by_parts(op, num_parts):
        return torch.cat(
            [
                op(part.contiguous(), kv_cache, seq_ids, tables, positions, scale=0.05, v_dim=v_dim)
                for part in q.chunk(num_parts, dim=1)
            ],
            dim=1,
        )

    ref = partial(mla_attention_ref, tile_rows=4)
    whole = by_parts(ref, 1)
    for num_parts in (2, 4, 16):
        assert torch.equal(by_parts(ref, num_parts), whole), num_parts
    fast_whole = by_parts(mla_attention_fast, 1)
    assert any(not torch.equal(by_parts(mla_attention_fast, n), fast_whole) for n in (2, 4, 16)), (
        "the fast path's bits ignored the head count too: the control cannot fail"
    )


def test_head_launch_refuses_bad_tails_and_counts_groups():
    """HeadLaunch names the bad value: a split tail of a split or more, groups beside a split
    tail, a group tail that is not whole splits or not below a group; and counts a query's
    groups with the last taking up to the group tail more (one group without groups)."""
    from moe_kernels.attention_launch import HeadLaunch

    with pytest.raises(ValueError, match="tail_blocks 4 must be in"):
        HeadLaunch(16, 4, 4, 3, tail_blocks=4)
    with pytest.raises(ValueError, match="group_splits 8 must be >= 0, and 0 with tail_blocks 2"):
        HeadLaunch(16, 4, 4, 3, tail_blocks=2, group_splits=8)
    with pytest.raises(ValueError, match="group_tail 2 must be whole splits of 4"):
        HeadLaunch(16, 4, 4, 3, group_splits=8, group_tail=2)
    with pytest.raises(ValueError, match="group_tail 32 .* below a group's 32"):
        HeadLaunch(16, 4, 4, 3, group_splits=8, group_tail=32)
    with pytest.raises(ValueError, match="group_tail 4 .*group_splits 0"):
        HeadLaunch(16, 4, 4, 3, group_tail=4)
    launch = HeadLaunch(16, 4, 4, 3, group_splits=8, group_tail=4)
    counts = [launch.num_groups(n) for n in (1, 32, 33, 36, 37, 64, 68, 69)]
    assert counts == [1, 1, 1, 1, 2, 2, 2, 3], counts
    assert HeadLaunch(16, 4, 4, 3).num_groups(1000) == 1


def test_long_splits_count_a_tables_splits_and_leave_groups_alone():
    """With long splits (a query of long_blocks blocks or more has splits of
    long_split_blocks, its last one taking the launch's tail too) a table's split count is the
    most of any query it can hold, which a query just short of long_blocks may set; long splits
    beside groups, or no longer than a split, are refused naming the value, and a launch with
    groups has none. Both launches take them by default, the wide one (64 heads a program, a
    tail of 2) with its own threshold and split size."""
    from moe_kernels.attention_launch import (
        LONG_BLOCKS,
        NARROW_LAUNCH,
        WIDE_LAUNCH,
        WIDE_LONG_BLOCKS,
        WIDE_LONG_SPLIT_BLOCKS,
        HeadLaunch,
        query_split_blocks,
        split_count,
        table_split_count,
        with_groups,
        with_long_blocks,
    )

    cases = ((4, 0, 64, 8), (2, 0, 5, 4), (4, 0, 4, 8), (4, 0, 1, 8), (4, 0, 0, 8),
             (16, 2, 64, 64), (16, 2, 64, 32), (4, 3, 9, 12), (2, 1, 3, 7))  # fmt: skip
    for split_blocks, tail, long_blocks, long_split in cases:
        for width in range(1, 200):
            most = max(
                split_count(n, query_split_blocks(n, split_blocks, long_blocks, long_split), tail)
                for n in range(1, width + 1)
            )
            got = table_split_count(width, split_blocks, tail, long_blocks, long_split)
            assert got == most, (split_blocks, tail, long_blocks, long_split, width, got, most)
    launch = HeadLaunch(16, 4, 4, 3, long_blocks=64, long_split_blocks=8)
    assert [launch.table_splits(w) for w in (16, 63, 64, 128, 256)] == [4, 16, 16, 16, 32]
    wide = with_long_blocks(WIDE_LAUNCH, 64, 64)
    assert wide.is_wide and wide.long_split_blocks == 64
    # 63 blocks: four splits of 16 (the last taking 15); from 64, one split up to 66 blocks.
    assert [wide.table_splits(w) for w in (18, 63, 66, 130, 131)] == [1, 4, 4, 4, 4]
    assert with_long_blocks(WIDE_LAUNCH, 64, 32).table_splits(200) == 7
    assert (WIDE_LAUNCH.long_blocks, WIDE_LAUNCH.long_split_blocks) == (64, 32)  # measured
    assert (WIDE_LONG_BLOCKS, WIDE_LONG_SPLIT_BLOCKS) == (64, 32)
    assert WIDE_LAUNCH.table_splits(131) == 5 and with_long_blocks(WIDE_LAUNCH, 0).is_wide
    with pytest.raises(ValueError, match="long_blocks 64 must be >= 0, and 0 with group_splits 8"):
        HeadLaunch(16, 4, 4, 3, group_splits=8, long_blocks=64, long_split_blocks=8)
    with pytest.raises(ValueError, match="long_blocks -1 must be >= 0"):
        HeadLaunch(16, 4, 4, 3, long_blocks=-1)
    for size in (0, 4, 3):
        with pytest.raises(ValueError, match=f"long_split_blocks {size} must be above split_"):
            HeadLaunch(16, 4, 4, 3, long_blocks=64, long_split_blocks=size)
    assert NARROW_LAUNCH.long_blocks == LONG_BLOCKS  # on by default since it ran on a GPU
    assert NARROW_LAUNCH.long_split_blocks == 2 * NARROW_LAUNCH.split_blocks
    assert with_long_blocks(NARROW_LAUNCH, 64).table_splits(128) == 16
    assert with_groups(NARROW_LAUNCH, 0) == NARROW_LAUNCH
    assert with_groups(NARROW_LAUNCH, 8).long_blocks == 0
    assert with_long_blocks(NARROW_LAUNCH, 0).long_blocks == 0
    assert with_long_blocks(WIDE_LAUNCH, 64) == WIDE_LAUNCH
    with pytest.raises(ValueError, match="group_splits 8 applies to the launch of models below"):
        with_groups(wide, 8)
