import pytest

from moe_runtime.engine.block_manager import BlockManager

BLOCK_SIZE = 4


def _manager(num_blocks: int = 8, enable_prefix_caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)


def _run(manager: BlockManager, token_ids: list[int]) -> list[int]:
    """Admits a sequence as the engine would: match, allocate, compute all, commit."""
    table = manager.match_prefix(token_ids)
    assert manager.allocate(table, len(token_ids))
    manager.commit(table, token_ids, len(token_ids))
    return table


def test_constructor_rejects_bad_values():
    with pytest.raises(ValueError, match="num_blocks.*0"):
        BlockManager(0, 4, True)
    with pytest.raises(ValueError, match="block_size.*-2"):
        BlockManager(4, -2, True)


def test_allocate_and_free_accounting():
    manager = _manager()
    table: list[int] = []
    assert manager.allocate(table, 1) and len(table) == 1
    assert manager.allocate(table, 4) and len(table) == 1  # still fits in one block
    assert manager.allocate(table, 9) and len(table) == 3
    assert manager.num_free_blocks == 5 and manager.usage == 3 / 8
    manager.free(table)
    assert manager.num_free_blocks == 8 and manager.usage == 0.0


def test_allocate_is_all_or_nothing():
    manager = _manager(num_blocks=3)
    table: list[int] = []
    assert not manager.allocate(table, 4 * BLOCK_SIZE)
    assert table == [] and manager.num_free_blocks == 3
    assert manager.allocate(table, 3 * BLOCK_SIZE)
    other: list[int] = []
    assert not manager.allocate(other, 1) and other == []


def test_prefix_hit_for_shared_prefix():
    manager = _manager()
    first = _run(manager, list(range(10)))  # blocks 0-3, 4-7 full; 8-9 partial
    hit = manager.match_prefix(list(range(8)) + [99, 98, 97])
    assert hit == first[:2]
    # Cap: a prompt of exactly two full blocks reuses only one, leaving a token to compute.
    assert manager.match_prefix(list(range(8))) == first[:1]
    assert manager.match_prefix(list(range(4))) == []
    assert manager.match_prefix([]) == []


def test_no_hit_for_equal_block_at_other_depth():
    manager = _manager()
    _run(manager, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    # Block [5, 6, 7, 8] is cached as the second block after [1, 2, 3, 4], not as a first block.
    assert manager.match_prefix([5, 6, 7, 8, 0]) == []
    # Same second block behind a different first block: only the chain decides.
    assert manager.match_prefix([9, 9, 9, 9, 5, 6, 7, 8, 0]) == []


def test_partial_and_uncomputed_blocks_are_not_cached():
    manager = _manager()
    table: list[int] = []
    tokens = list(range(12))
    assert manager.allocate(table, len(tokens))
    manager.commit(table, tokens, 6)  # a chunk of 6 tokens computed: only block 0 is complete
    assert manager.match_prefix(tokens + [0]) == table[:1]
    manager.commit(table, tokens, 12)
    assert manager.match_prefix(tokens + [0]) == table


def test_ref_counting_with_shared_prefix():
    manager = _manager(num_blocks=6)
    prefix = list(range(8))
    a = _run(manager, prefix + [100, 101])
    b = _run(manager, prefix + [200])
    assert b[:2] == a[:2] and b[2] != a[2]
    assert manager.num_free_blocks == 2
    manager.free(a)
    # The shared blocks are still held by b; only a's tail came back.
    assert manager.num_free_blocks == 3
    assert manager.match_prefix(prefix + [1]) == a[:2]
    manager.free(b)
    manager.free(a[:2])
    assert manager.num_free_blocks == 6


def test_eviction_prefers_empty_then_least_recently_freed():
    manager = _manager(num_blocks=4)
    old = _run(manager, list(range(8)) + [0])  # 3 blocks, 2 of them cached
    manager.free(old)
    new: list[int] = []
    assert manager.allocate(new, 1)
    assert new == [3]  # the never-used block first
    assert manager.match_prefix(list(range(8)) + [0]) == old[:2]
    manager.free(old[:2])  # freed in reverse: old[1] now goes before old[0]
    assert manager.allocate(new, 2 * BLOCK_SIZE) and new[1] == old[2]  # uncached tail block
    assert manager.allocate(new, 3 * BLOCK_SIZE) and new[2] == old[1]
    # old[1] was evicted: its entry is gone, old[0] still hits.
    assert manager.match_prefix(list(range(8)) + [0]) == [old[0]]


def test_duplicate_block_keeps_existing_entry():
    manager = _manager()
    tokens = list(range(8)) + [0]
    a: list[int] = []
    b: list[int] = []
    assert manager.allocate(a, len(tokens)) and manager.allocate(b, len(tokens))
    manager.commit(a, tokens, len(tokens))
    manager.commit(b, tokens, len(tokens))  # computed twice concurrently, no prefix hit
    assert manager.match_prefix(tokens) == a[:2]
    manager.free(b)
    assert manager.match_prefix(tokens) == a[:2]  # b's copies never replaced a's entries


def test_caching_off_never_hits():
    manager = _manager(enable_prefix_caching=False)
    tokens = list(range(9))
    table = _run(manager, tokens)
    assert manager.match_prefix(tokens) == []
    manager.free(table)
    assert manager.match_prefix(tokens) == []
    assert manager.num_free_blocks == 8


def test_double_free_raises():
    manager = _manager()
    table: list[int] = []
    manager.allocate(table, 5)
    manager.free(table)
    with pytest.raises(RuntimeError, match="double free"):
        manager.free(table)


def test_clear_cache_forgets_prefixes_and_never_caches_blocks_in_use():
    blocks = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    tokens = [1, 2, 3, 4, 5]
    done = []
    assert blocks.allocate(done, 5)
    blocks.commit(done, tokens, 5)
    blocks.free(done)
    running = []
    assert blocks.allocate(running, 5)
    blocks.clear_cache()
    assert blocks.match_prefix(tokens) == []
    blocks.commit(running, tokens, 5)  # computed before the change: must not become a hit
    blocks.free(running)
    assert blocks.match_prefix(tokens) == []
    fresh = []
    assert blocks.allocate(fresh, 5)
    blocks.commit(fresh, tokens, 5)
    blocks.free(fresh)
    assert len(blocks.match_prefix(tokens)) == 2
    assert blocks.num_free_blocks == 8 - 2


def test_incremental_commit_caches_what_one_commit_caches():
    """Committing block by block from the returned (block, parent) equals one commit of all,
    and never reads the tokens before the first uncommitted block."""
    tokens = list(range(100, 117))  # 4 full blocks and one token more
    whole, step = _manager(16), _manager(16)
    table = whole.match_prefix(tokens)
    assert whole.allocate(table, len(tokens))
    whole.commit(table, tokens, len(tokens))

    table = step.match_prefix(tokens)
    assert step.allocate(table, len(tokens))
    first, parent = 0, 0
    for computed in range(1, len(tokens) + 1):
        tail = tokens[first * BLOCK_SIZE :]  # only the tokens from the first open block
        first, parent = step.commit(table, tail, computed, first, parent)
        assert first == computed // BLOCK_SIZE
    for manager in (whole, step):
        assert len(manager.match_prefix(tokens + [1])) == 4  # every full block is a hit


def test_can_allocate_answers_as_allocate_would_and_takes_nothing():
    manager = _manager(num_blocks=8)
    table: list[int] = []
    assert manager.allocate(table, 6 * BLOCK_SIZE)  # 2 blocks left
    assert manager.can_allocate(table, 5) and manager.can_allocate(table, 8 * BLOCK_SIZE)
    assert not manager.can_allocate(table, 8 * BLOCK_SIZE + 1)
    assert not manager.can_allocate([], 8 * BLOCK_SIZE)  # a table of its own: 8 blocks
    assert manager.num_free_blocks == 2 and len(table) == 6  # nothing was taken
    assert not manager.allocate(table, 8 * BLOCK_SIZE + 1) and manager.allocate(table, 32)
