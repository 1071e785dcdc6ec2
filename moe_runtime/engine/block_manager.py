"""BlockManager: the paged KV cache's block pool, reference counts and prefix cache.

It hands out block ids; it never touches KV tensors (the worker maps a step's positions to
cache slots through the block tables) and knows nothing of requests beyond the block tables and
token ids it is given. A full, computed block is cached under an exact key, (parent block's key
id, its tokens), so two prefixes can share a block only if they are equal token for token: a
cache hit then reuses KV that the request would have computed itself.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

ROOT_KEY_ID = 0
# A commit chain that can cache nothing more: it passed a block computed under other weights.
BROKEN_KEY_ID = -1

BlockKey = tuple[int, tuple[int, ...]]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._empty: deque[int] = deque(range(num_blocks))  # free, holding no cache entry
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free, cached; oldest first
        self._cached: dict[BlockKey, int] = {}  # key -> the block that owns it
        self._block_key: dict[int, BlockKey] = {}  # owner block -> its key
        # Key ids come from a counter and are never reused, so a child key can never point
        # at a different prefix after its parent's entry was evicted.
        self._block_key_id: dict[int, int] = {}
        self._next_key_id = ROOT_KEY_ID + 1
        self._stale: set[int] = set()  # in use since before clear_cache: never cached
        self.num_hit_blocks = 0  # blocks served from the prefix cache so far (a metric)

    @property
    def num_free_blocks(self) -> int:
        return len(self._empty) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks holding the longest run of leading full blocks of token_ids, with one
        reference taken on each; at least one token is always left to compute, so the step
        still produces logits."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = max(0, (len(token_ids) - 1) // self.block_size)
        blocks: list[int] = []
        parent = ROOT_KEY_ID
        for i in range(max_blocks):
            block = self._cached.get((parent, self._block_tokens(token_ids, i)))
            if block is None:
                break
            blocks.append(block)
            parent = self._block_key_id[block]
        for block in blocks:
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
        self.num_hit_blocks += len(blocks)
        return blocks

    def unmatch(self, blocks: Sequence[int]) -> None:
        """Give back a match_prefix result that was not used (its sequence could not be
        admitted): its references are dropped and its blocks no longer count as hits."""
        self.free(blocks)
        self.num_hit_blocks -= len(blocks)

    def can_allocate(self, block_table: list[int], num_tokens: int, keep_free: int = 0) -> bool:
        """Whether `allocate(block_table, num_tokens)` would succeed now and leave keep_free
        blocks free (it allocates nothing)."""
        return self._num_needed(block_table, num_tokens) <= self.num_free_blocks - keep_free

    def allocate(self, block_table: list[int], num_tokens: int) -> bool:
        """Appends blocks so block_table covers num_tokens slots; all or nothing."""
        num_needed = self._num_needed(block_table, num_tokens)
        if num_needed <= 0:
            return True
        if num_needed > self.num_free_blocks:
            return False
        for _ in range(num_needed):
            block = self._empty.popleft() if self._empty else self._evict()
            self._ref_counts[block] = 1
            block_table.append(block)
        return True

    def commit(
        self,
        block_table: Sequence[int],
        token_ids: Sequence[int],
        num_computed_tokens: int,
        first_block: int = 0,
        parent: int = ROOT_KEY_ID,
    ) -> tuple[int, int]:
        """Caches every block of block_table that is full and computed (within the first
        num_computed_tokens) and not cached yet, from block `first_block` on: token_ids then
        start at that block and `parent` is the key id the blocks before it end with. Returns
        (first block not committed, its parent key id), where the next call may start.

        Why the first block moves on even where nothing is cached (caching off, a chain
        broken by a stale block): the caller hands in the tokens from that block on, and a
        first block left behind made each decode step copy the sequence's whole tail."""
        num_full = num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or parent == BROKEN_KEY_ID:
            return max(first_block, num_full), parent
        offset = first_block * self.block_size
        for i in range(first_block, num_full):
            block = block_table[i]
            if block in self._stale:
                # Computed under other weights: nothing from here on is reusable, the blocks
                # this table gets later included (their KV attended to this one's).
                return num_full, BROKEN_KEY_ID
            if block in self._block_key:
                parent = self._block_key_id[block]
                continue
            key = (parent, self._block_tokens(token_ids, i, offset))
            owner = self._cached.get(key)
            if owner is None:
                # First copy of this prefix: this block becomes its owner.
                self._cached[key] = block
                self._block_key[block] = key
                self._block_key_id[block] = self._next_key_id
                self._next_key_id += 1
                owner = block
            # A duplicate of a cached block stays uncached; the chain continues from the
            # owner's key id, which names the same prefix.
            parent = self._block_key_id[owner]
        return max(first_block, num_full), parent

    def free(self, block_table: Sequence[int]) -> None:
        """Drops one reference per block. Tail blocks are freed first, so they are evicted
        before the prefix blocks that more requests are likely to share."""
        for block in block_table:
            if self._ref_counts[block] <= 0:
                raise RuntimeError(f"double free of KV block {block}")
        for block in reversed(block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] > 0:
                continue
            self._stale.discard(block)
            if block in self._block_key:
                self._evictable[block] = None
            else:
                self._empty.append(block)

    def clear_cache(self) -> None:
        """Forget every cached prefix (the weights changed). Blocks still in use stay allocated
        but are never cached, since their contents came from the old weights."""
        self._empty.extend(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        self._block_key.clear()
        self._block_key_id.clear()
        self._stale = {b for b, refs in enumerate(self._ref_counts) if refs > 0}

    def _num_needed(self, block_table: list[int], num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) - len(block_table)

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        del self._cached[self._block_key.pop(block)]
        del self._block_key_id[block]
        return block

    def _block_tokens(
        self, token_ids: Sequence[int], index: int, offset: int = 0
    ) -> tuple[int, ...]:
        start = index * self.block_size - offset
        return tuple(token_ids[start : start + self.block_size])
