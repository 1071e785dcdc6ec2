"""Which launch the invariant MLA attention takes (moe_kernels/triton_attention.py).

Two kinds of choice, kept apart. Per model, fixed (part of the bits): the heads a program
takes (the MMA), its warps, and the KV split with its tail (the merge order), from the model's
head count at TP 1. Per launch, from host shapes only (the same bits, checked on the GPU): the
value split and the table read a block ahead by the launch's (query, KV split) pairs (the
splits counted from the table's width), the whole-query programs by its query count. No
choice reads a tensor, so none syncs the host or breaks a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

SPLIT_BLOCKS = 4  # cache blocks per KV split: a constant, never a function of the batch
BLOCK_H = 16  # heads per program (tl.dot needs 16 rows); extra heads are masked


@dataclass(frozen=True)
class HeadLaunch:
    """A model's attention launch: heads a program, cache blocks a KV split, warps, stages,
    the blocks past its last whole split that a query's last split takes on (tail_blocks,
    fewer than a split's: split_count), and the splits a group folds before the groups fold
    (group_splits; 0: one group, every split folded in turn)."""

    block_h: int
    split_blocks: int
    num_warps: int
    num_stages: int
    tail_blocks: int = 0
    group_splits: int = 0
    group_tail: int = 0  # blocks past its last whole group a query's last group takes on
    long_blocks: int = 0  # a query of at least this many blocks (0: none) has long splits,
    long_split_blocks: int = 0  # of this many blocks (its last taking up to tail_blocks more)

    def __post_init__(self) -> None:
        check_runs(
            self.split_blocks, self.tail_blocks, self.group_splits, self.group_tail,
            self.long_blocks, self.long_split_blocks,
        )  # fmt: skip

    @property
    def is_wide(self) -> bool:
        """Whether this is the wide launch (64 heads a program), whatever its long splits."""
        return self.block_h == WIDE_LAUNCH.block_h

    def table_splits(self, table_width: int) -> int:
        """The most KV splits of any query in a table table_width blocks wide."""
        return table_split_count(
            table_width, self.split_blocks, self.tail_blocks, self.long_blocks,
            self.long_split_blocks,
        )  # fmt: skip

    def num_groups(self, num_blocks: int) -> int:
        """The groups of a query (or table) of num_blocks cache blocks (1 without groups)."""
        if not self.group_splits:
            return 1
        return split_count(num_blocks, self.group_splits * self.split_blocks, self.group_tail)


def check_runs(
    split_blocks: int, tail_blocks: int, group_splits: int, group_tail: int, long_blocks: int = 0,
    long_split_blocks: int = 0,
) -> None:  # fmt: skip
    """Raise ValueError, naming the value, unless the split tail is below a split, the groups
    are >= 0 and only without a split tail, the group tail is whole splits below a group, and
    long splits (long_blocks > 0) come without groups and are longer than a split."""
    if long_blocks < 0 or (long_blocks and group_splits):
        raise ValueError(
            f"long_blocks {long_blocks} must be >= 0, and 0 with group_splits {group_splits}"
        )
    if long_blocks and long_split_blocks <= split_blocks:
        raise ValueError(
            f"long_split_blocks {long_split_blocks} must be above split_blocks {split_blocks} "
            f"where long_blocks is {long_blocks}"
        )
    if not 0 <= tail_blocks < split_blocks:
        raise ValueError(
            f"tail_blocks {tail_blocks} must be in [0, {split_blocks}) "
            f"(split_blocks {split_blocks})"
        )
    if group_splits < 0 or (group_splits and tail_blocks):
        raise ValueError(
            f"group_splits {group_splits} must be >= 0, and 0 with tail_blocks {tail_blocks}"
        )
    group_blocks = group_splits * split_blocks
    is_whole_splits = group_tail % split_blocks == 0
    if group_tail and (not is_whole_splits or group_blocks <= group_tail):
        raise ValueError(
            f"group_tail {group_tail} must be whole splits of {split_blocks} blocks, below a "
            f"group's {group_blocks} (group_splits {group_splits})"
        )


def split_count(num_blocks: int, split_blocks: int, tail_blocks: int) -> int:
    """The KV splits of a query of num_blocks cache blocks (or the most of any query in a
    table num_blocks wide): runs of split_blocks from block 0, the last taking up to
    tail_blocks more, at least one. A function of the query's own length only, so a query has
    the same splits in every batch and chunking (the kernels restate it: _own_splits)."""
    return max(1, -(-(num_blocks - tail_blocks) // split_blocks))


def query_split_blocks(
    num_blocks: int, split_blocks: int, long_blocks: int, long_split_blocks: int
) -> int:
    """The cache blocks a KV split of a query of num_blocks blocks runs: split_blocks,
    long_split_blocks from long_blocks blocks (0: never). A function of the query's own length
    only, as split_count is (the kernels restate it: _split_blocks_of)."""
    return long_split_blocks if long_blocks and num_blocks >= long_blocks else split_blocks


def table_split_count(
    table_width: int, split_blocks: int, tail_blocks: int, long_blocks: int = 0,
    long_split_blocks: int = 0,
) -> int:  # fmt: skip
    """The most KV splits of any query in a table table_width blocks wide (the launch's grid):
    with long splits a query just short of long_blocks may have more than the widest one."""
    if not long_blocks:
        return split_count(table_width, split_blocks, tail_blocks)
    short = split_count(min(table_width, long_blocks - 1), split_blocks, tail_blocks)
    if table_width < long_blocks:
        return short
    return max(short, split_count(table_width, long_split_blocks, tail_blocks))


# Why the launch follows the model's head count (at TP 1), never the heads a rank holds or the
# batch: the head block's width picks the MMA (16 rows: mma.sync; 64: wgmma, whose fp32 sums
# round differently) and the split is part of the merge order, so both are fixed per model.
# From WIDE_HEADS heads a program takes 64 heads: each latent block is read once for 64 heads
# instead of once for 16, and larger splits (each split's fp32 partial is 64 x 512 a head
# block) cut the partials' traffic. On the GPU the wide launch's split kernel is the Gluon one
# (moe_kernels/gluon_attention.py) where the shape fits. H200, 128 heads, graph replay
# (BENCHMARKS.md): the Gluon kernel on splits of 16 blocks ran 1.7-1.9x faster than the Triton
# wide kernel and about 3x faster than 16-head blocks; against FlashMLA with its step plan
# shared as the engine shares it, 1.42x its time at B = 256 context 1024 (the earlier
# 0.80-1.39x paid FlashMLA's plan on every call).
WIDE_HEADS = 64
# A 16-head query of at least LONG_BLOCKS cache blocks (4096 positions in blocks of 64) may
# have KV splits of 2 x SPLIT_BLOCKS (kernels.attention_long_blocks; with_long_blocks): part of
# the bits, a function of the query's own length, so one value for every batch. Why: a split
# launch writes each split's fp32 partial (16 x 512) to HBM and merges them, and at long
# contexts those round trips and the merge were what kept B = 64 at 1.2x FlashMLA's time;
# halving a long query's splits halves them, where a query below it keeps its parallelism
# (one query at context 1024: 13 -> 19 µs with splits of 8). H100, graph replay, engine-wide
# tables (BENCHMARKS.md, fifty-second session, `bench/gpu_kernels.py split_larger`), constant
# splits of 4 -> 8 blocks, µs: context 4096 B = 1 14.9 -> 19.5, B = 8 26.4 -> 26.8, B = 16
# 41.7 -> 38.0, B = 32 75.6 -> 67.2, B = 64 138.8 -> 122.8; context 8192 B = 8 45.7 -> 40.0,
# B = 64 264.5 -> 236.5; from 128 queries (a program a whole query, so prefill) level. On by
# default since the kernel with long splits ran on a GPU (H100, fifty-third session: its kernel
# and golden tests pass; the op at context 4096 B = 64 139.0 -> 123.2 µs, B = 8 at 8192 45.5
# -> 39.9, B = 1 at 4096 14.7 -> 19.4, B = 16 at 4096 41.4 -> 45.2: in a table 64 blocks
# wide the grid counts 16 splits (a query of 63 blocks) where a 64-block query has 8, so the
# launch is past TABLE_AHEAD_MAX_PAIRS where constant splits of 8 (37.9) are not; fifty-fourth
# session, `bench/gpu_kernels.py long_ahead`: counting the widest query's own splits instead
# would lose 2-11% for the shorter queries such tables hold; through the engine at context 4096,
# ms a step, B = 64 15.25 -> 14.88, B = 8 7.67 -> 7.60, B = 1 2.93 -> 3.04, prefill 8x4096
# level). The attention goal is at B >= 64, where one query's +4.7 µs a layer is the
# price.
# Groups (with_groups) count splits of one size: a launch with groups has none.
LONG_BLOCKS = 64
NARROW_LAUNCH = HeadLaunch(
    BLOCK_H, SPLIT_BLOCKS, 4, 3, long_blocks=LONG_BLOCKS, long_split_blocks=2 * SPLIT_BLOCKS
)
# A query's last split of the wide launch takes up to 2 blocks past its last whole split
# (tail_blocks) instead of a split of its own: a whole-query program then folds no split of
# one or two blocks (its running fold's fp32 round trip through L2 cost more than the blocks).
# Part of the bits, so one value for every batch. H200, 128 heads, graph replay
# (BENCHMARKS.md, `bench/gpu_kernels.py tail`), µs: B = 256 context 1088 (17 blocks) 247.7 ->
# 225.3, 1152 267.6 -> 229.1, B = 64 65.8 -> 58.3 and 70.2 -> 60.4; the split launch (B <= 8)
# pays the longer last split, 47 -> 49-52. Four tail blocks gained as much at 20 blocks (B =
# 256 287 -> 259) and cost B <= 8 20% there (47 -> 57).
# A 128-head query of at least WIDE_LONG_BLOCKS cache blocks has KV splits of
# WIDE_LONG_SPLIT_BLOCKS (the launch's tail kept; kernels.attention_long_blocks and
# attention_long_split_blocks): part of the bits, a function of the query's own length. Why:
# each split's fp32 partial is 64 x 512 a head block, so at long contexts the partials' round
# trip and the merge cost more than at 16 heads. H100 (BENCHMARKS.md, fifty-fourth session):
# the op at context 4096, graph replay, engine-wide tables, splits of 16 / long 32 / long 64
# from 64 blocks, µs: B = 64 214 / 175 / 154, B = 128 473 / 348 / 308, B = 256 884 / 771 /
# 720, B = 8 49 / 69 / 118, B = 1 42 / 65 / 117; through the engine (27 layers, context 4096,
# ms a step): B = 64 19.26 / 18.18 / 17.53, B = 8 10.13 / 10.73 / 11.89, B = 1 5.54 / 6.19 /
# 7.65. Splits of 64 would save 3.4% more at B = 64 for 24% more at one query than 32: 32 is
# the trade the 16-head launch made (B = 64 -2.4%, B = 1 +3.8% there; here -5.6%, +11.7%),
# and against fast mode with FlashMLA it gives the smaller worst price of invariance at
# context 4096: 1.07-1.12 from B = 1 to 64 (1.00-1.14 without long splits, 1.03-1.38 with 64).
WIDE_LONG_BLOCKS = 64
WIDE_LONG_SPLIT_BLOCKS = 32
WIDE_LAUNCH = HeadLaunch(
    64, 16, 8, 2, tail_blocks=2, long_blocks=WIDE_LONG_BLOCKS,
    long_split_blocks=WIDE_LONG_SPLIT_BLOCKS,
)  # fmt: skip


def head_launch(whole_heads: int) -> HeadLaunch:
    """The launch of a model with whole_heads attention heads (all TP ranks together)."""
    return WIDE_LAUNCH if whole_heads >= WIDE_HEADS else NARROW_LAUNCH


# Launches of at most this many (query, KV split) pairs, the splits counted from the table's
# width (a host shape), split each head block's value columns over VALUE_SPLIT's programs: a
# program still computes every score of its heads in the same dots and keeps only some value
# columns, whose sums do not depend on which others a program holds, so every launch gives the
# same bits (checked on the GPU) and the choice may follow the batch. H200, 16 heads, graph
# replay, tables as wide as the engine's graphs (BENCHMARKS.md, nineteenth session): four
# parts gained at 4 to 32 pairs (one query at context 1024 15.0 -> 12.7 us, eight 17.8 ->
# 16.4, one at 8192 19.4 -> 17.1) and lost 2x from 64 (eight queries at 8192: 36.2 -> 72.3;
# one wave of programs either way); two parts gained nowhere (the earlier rule's two parts up to
# eight queries made eight at 8192 73.8 us). NARROW_LAUNCH only: with 64-head blocks the Triton
# kernel's parts ran out of shared memory or lost (H200); the Gluon kernel has its own
# (wide_value_parts).
VALUE_SPLIT_MAX_PAIRS = 32
VALUE_SPLIT = (4, 128)  # (v_parts, lat_chunk)
MIN_PART_COLUMNS = 128  # value columns a program keeps at least (the measured 512 / 4)
# Launches with at least this many (query, head block) programs give each one a whole query
# (WHOLE_QUERY): its splits folded in the program, so no fp32 partials cross HBM and no merge
# launch runs. The same bits as the split launch (checked on the GPU), so the choice may
# follow the query count. (from this many programs, num_stages), H200, 16 heads, engine-wide
# tables (BENCHMARKS.md): from 256, two stages (one cache-block buffer, two programs an SM;
# B = 256 ctx 1024: 137 -> 92 us); from 128, three (two buffers, one program an SM; B = 128
# ctx 1024 62 -> 51 us, ctx 4096 213 -> 168); below, the split launch (B = 64: 35 vs 45 us).
WHOLE_QUERY_STAGES = ((256, 2), (128, 3))
# With groups every whole-query launch has a program a query's group (plus a merge where a
# query has two). A program a whole query folding its groups in turn must keep their running
# fold somewhere: in registers (a third 16 x 512 fp32 state beside the walk's two) it spilled;
# parked in HBM between groups it ran 1.19-1.31x the launch without groups at B = 256 (H200,
# BENCHMARKS.md, twenty-seventh session), where a program a group ran 0.99-1.06x: the park's
# stores alone, in the program's loop over groups and never reached by a query of one group,
# cost 15-30%. So no launch has that form, and the kernel has none.
# Wide launches (the Gluon kernel) always take the split launch and its merge. The kernel
# before the paired one also had a whole-query form (splits folded in the program, the running
# fold parked in two fp32 slots), 0.92-1.00x its split launch from 128 programs; the paired
# kernel's form held 740 bytes of spills a thread and ran 1.26-1.29x the kernel before it
# (H200, BENCHMARKS.md, thirty-first session), while its split launch runs 0.82-0.90x that
# kernel's whole-query form, so it has none.
# Split launches of at most this many (query, KV split) pairs (the splits counted from the
# table's width, as VALUE_SPLIT_MAX_PAIRS) also read the table a block ahead at three stages
# (no arithmetic changes: the same bits, checked on the GPU). H200, 16 heads, graph replay,
# tables as wide as the engine's graphs (BENCHMARKS.md, nineteenth session): it gained at
# every 4 to 128 pairs (eight queries at context 1024, four value parts: 16.6 -> 13.7 us;
# sixteen at 2048, whole head blocks: 24.4 -> 20.2; four at 8192: 27.4 -> 23.0) and lost from
# 256 (sixteen at 4096: 34.5 -> 38.5; eight at 8192: 36.3 -> 41.0). (The rule before took it
# at one query only, from tables 128 wide at every context.)
TABLE_AHEAD_MAX_PAIRS = 128


# The wide launch's Gluon kernel splits each partition's value columns over two programs in
# launches of at most this many (query, KV split) pairs (the splits counted from the table's
# width): the same bits (its docstring says why, checked on the GPU), so the choice may
# follow the batch. It fills more SMs and does not shorten a program's walk, so it gains
# while the doubled programs fit one wave. H200, graph replay, engine-wide tables
# (BENCHMARKS.md, forty-second session): 0.91-0.99x the one-part time where the rule takes
# it (B = 1 at context 1024: 42.2 -> 38.9 us), 1.56-1.72x where the doubled programs pass a
# wave (B = 64 at 1024, B = 8 at 8000: 64 pairs); through the engine, 128 heads, B = 1
# decode 4.34-4.41 -> 4.13-4.15 ms a step, B = 8 7.27-7.40 -> 7.09-7.12. The pairs are
# counted from the table's width, not the queries' lengths (device values): B = 8 in a
# table of 128 blocks would gain 4% at context 4096 and lose 62% at 8000. Four parts (N =
# 64) were slower at every size on an H100 (spills; each program still walks every block).
WIDE_VALUE_SPLIT_MAX_PAIRS = 32


def wide_value_parts(num_tokens: int, num_splits: int) -> int:
    """Programs each head block's value columns are split over in the Gluon kernel's launch
    of num_tokens queries of at most num_splits KV splits: 2 up to WIDE_VALUE_SPLIT_MAX_PAIRS
    (query, split) pairs, else 1."""
    return 2 if num_tokens * num_splits <= WIDE_VALUE_SPLIT_MAX_PAIRS else 1


def value_split(num_tokens: int, block_v: int, num_splits: int) -> tuple[int, int | None]:
    """(v_parts, lat_chunk) of a GPU launch of num_tokens queries of at most num_splits KV
    splits each whose value block is block_v columns: VALUE_SPLIT where the launch has at most
    VALUE_SPLIT_MAX_PAIRS (query, split) pairs and each part keeps MIN_PART_COLUMNS columns
    (so lat_chunk divides it), else whole head blocks (1, None)."""
    v_parts, _ = VALUE_SPLIT
    if num_tokens * num_splits <= VALUE_SPLIT_MAX_PAIRS and block_v // v_parts >= MIN_PART_COLUMNS:
        return VALUE_SPLIT
    return 1, None


# A 16-head query's splits may fold in groups (kernels.attention_group_splits; 0, the
# default: one group), then the groups in order: part of the bits (a query within one group
# folds as with none), so one value for every batch of a deployment. Why groups: a program can
# then walk a query's group instead of the whole query, so a launch of few long queries fills
# the GPU without every split's fp32 partial crossing HBM and a merge of them all. A query's
# last group takes up to one split more (65 blocks: two groups, not a third of one block).
# H200 (BENCHMARKS.md, twenty-sixth session): groups of 8 ran B = 64 context 4140 at 88.4 µs
# against 107.9 without (FlashMLA 88.5); through the engine B = 64 decode 10.99 -> 10.42 ms a
# step, B = 128 even, but prefill 8x4096 1.6% slower; at B = 256 the kernel 1.00-1.04x the
# launch without groups (twenty-seventh session): off by default.
@functools.cache  # a frozen launch per (launch, groups): no new object on every call
def with_groups(launch: HeadLaunch, group_splits: int) -> HeadLaunch:
    """The narrow launch with a query's splits folded in groups of group_splits (0: one
    group), the last group taking up to one split more."""
    if launch.is_wide:
        raise ValueError(
            f"group_splits {group_splits} applies to the launch of models below {WIDE_HEADS} "
            f"heads (16 heads a program), not to {launch}"
        )
    if not group_splits:
        return launch
    # Groups count splits of one size: a launch with groups has no long splits.
    return dataclasses.replace(
        launch, group_splits=group_splits, group_tail=launch.split_blocks, long_blocks=0
    )


@functools.cache  # a frozen launch per (launch, long_blocks, size), as with_groups
def with_long_blocks(
    launch: HeadLaunch, long_blocks: int | None, long_split_blocks: int | None = None
) -> HeadLaunch:
    """The launch with long splits of long_split_blocks from long_blocks blocks (0: none);
    either None: the launch's own."""
    if long_blocks is None:
        long_blocks = launch.long_blocks
    if long_split_blocks is None:
        long_split_blocks = launch.long_split_blocks
    return dataclasses.replace(
        launch, long_blocks=long_blocks, long_split_blocks=long_split_blocks
    )  # fmt: skip


def group_launch(
    launch: HeadLaunch, num_tokens: int, num_heads: int, table_width: int
) -> int | None:
    """The narrow launch's num_stages where a program walks a query's group of splits (without
    groups: the whole query), from 128 (query, head block, group) programs
    (whole_query_stages); None where it runs the split launch. The groups are counted for a
    query three quarters of the table long: the engine's graph tables double in width (the
    longest query is past half), and groups the table holds but no query reaches exit at
    once, so they must not pick two stages (two programs an SM) for what one program an SM
    does faster (H200, B = 64 at context 4137 in a table of 128 blocks: BENCHMARKS.md,
    twenty-fifth session). launch: the narrow launch, or one with_groups made of it."""
    num_programs = num_tokens * -(-num_heads // launch.block_h)
    return whole_query_stages(num_programs * launch.num_groups(table_width * 3 // 4))


def whole_query_stages(num_programs: int) -> int | None:
    """The whole-query launch's num_stages for a launch of num_programs (query, head block)
    programs (WHOLE_QUERY_STAGES), None below them: the split launch."""
    for min_programs, num_stages in WHOLE_QUERY_STAGES:
        if num_programs >= min_programs:
            return num_stages
    return None


# The merge launch (split partials folded into the output) gives a query MERGE_PROGRAMS
# programs, each taking that share of its heads (a power of two): each head's columns fold by
# the same fp32 operations whichever heads share a program (the same bits, checked on the GPU),
# so the choice may follow the launch. H200, graph replay (BENCHMARKS.md, thirty-fourth
# session, `bench/gpu_kernels.py merge`), the op's µs at 1 / 8 / 16 heads a program: 128 heads
# in a table one width past its queries (every query one split, written by the Gluon kernel,
# so merge programs read a position and exit) B = 64 64.0 / 55.7 / 55.3, B = 256 228.5 / 199.4
# / 198.9; real merges level or better at 8 (B = 256 context 2100: 408.7 / 395.4 / 393.4;
# B = 64 context 4100, four splits: 192.6 / 192.1 / 201.2); 16 heads, whose every split
# partial is merged, lose with fewer programs (B = 64 context 4100, 17 splits: 108.8 at 1
# head a program, 130.5 at 8).
MERGE_PROGRAMS = 16


def merge_heads(num_heads: int) -> int:
    """Heads a merge program takes: the largest power of two within num_heads /
    MERGE_PROGRAMS, at least 1 (8 at 128 heads, 1 at 16)."""
    return 1 << (max(1, num_heads // MERGE_PROGRAMS).bit_length() - 1)


def merge_warps(heads: int) -> int:
    """Warps of a merge program of `heads` heads: 4 (one head's 512 columns were 4 a program
    before), 8 from 16 heads, so a thread holds at most 32 of each [heads, 512] fp32 tile."""
    return 4 if heads <= 8 else 8
