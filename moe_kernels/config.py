"""KernelConfig: the small config the kernel layer consumes.

`mode` picks between the batch-invariant implementations and plain torch ("fast", used for
speed and as the negative control of every invariance test). `num_threads` is the intra-op
thread count of a worker: part of the layout, never of the load. `tile_rows` is the fixed
row count every CPU BLAS call and row reduction is padded to (1 or at least 8 in invariant
mode, and a power of two with several threads: BLAS splits other tiles' rows between the
threads). `cuda_graphs` replays pure
decode steps of at most max(`cuda_graph_batch_sizes`) sequences as CUDA graphs, the batch
padded up to the next size; None (the default) lets the runtime config decide (on where the
device is CUDA, tensor parallelism is off and ranks, if several, talk over gloo), and sizes
None the powers of two up to the scheduler's batch (`graph_batch_sizes`). In
invariant mode a row ignores the padding; in fast mode graphs are a speed setting like any
other and the bits may follow the padded size. `tp_max` is the fixed K split of the
row-parallel linears (moe_kernels/tp_linear.py): K is always cut into tp_max chunks summed in one
binary tree, so every TP degree dividing tp_max gives the same bits; a power of two, so that
each degree's ranks hold whole subtrees. tp_max 1 gives up TP invariance (TP degree 1 only):
the row-parallel linears are then the plain invariant linear, batch-invariant and faster at
prefill (BENCHMARKS.md). `side_stream_rows`: launches of at most this many rows run a layer's
independent branches (kv_a beside the query projection, the cache write beside W_UK, the
shared experts beside the routed ones) on a second CUDA stream (moe_kernels/streams.py); 0 turns
it off. No arithmetic changes, so no bit does. `attention_group_splits` (invariant mode on
CUDA, models below 64 heads): a query's KV splits fold in groups of this many, then the
groups, the last group taking up to one split more (moe_kernels/attention_launch.py); 0 (the
default) keeps one group. It is part of the bits, as tp_max is: every rank and run that must
agree sets the same value. Measured and off by default (BENCHMARKS.md, twenty-sixth and
twenty-seventh sessions). `attention_long_blocks` (invariant mode on CUDA): a query of at
least this many cache blocks has long KV splits, of `attention_long_split_blocks` blocks; 0
never; None (the default) the launch's own: LONG_BLOCKS (64, measured: attention_launch.py)
below 64 heads, WIDE_LONG_BLOCKS (64) from 64. `attention_long_split_blocks`: None (the default)
the launch's own (8 blocks below 64 heads, WIDE_LONG_SPLIT_BLOCKS (32) from 64), else more than
the launch's split (4 blocks; 16 from 64 heads, and even there: the kernel pairs blocks). Both
are part of the bits too; neither with attention_group_splits (groups count splits of one size: with
groups, the default has none).
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("invariant", "fast")
MAX_TP_MAX = 16  # what the GPU tree-sum kernel adds (moe_kernels/triton_tp_linear.py)
SIDE_STREAM_ROWS = 128
MIN_TILE_ROWS = 8  # invariant mode's smallest tile above 1 (KernelConfig: why)


@dataclass(frozen=True)
class KernelConfig:
    mode: str = "invariant"
    num_threads: int = 1
    tile_rows: int = 16
    tp_max: int = 8
    cuda_graphs: bool | None = None
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    side_stream_rows: int = SIDE_STREAM_ROWS
    attention_group_splits: int = 0
    attention_long_blocks: int | None = None
    attention_long_split_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"kernels.mode must be one of {MODES}, got {self.mode!r}")
        for key in ("num_threads", "tile_rows", "tp_max"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kernels.{key} must be an int >= 1, got {value!r}")
        rows = self.tile_rows
        if self.is_invariant and self.num_threads > 1 and rows & (rows - 1):
            # Why: with several threads MKL splits a GEMM's rows between them at some row
            # counts (5-7 and 9-11 measured, 2-4 threads), each part taking its own kernel, so
            # a row's bits followed its place in the tile; powers of two up to 64 held.
            raise ValueError(
                f"kernels.tile_rows must be a power of two when kernels.num_threads > 1 in "
                f"invariant mode (BLAS splits a tile's rows between the threads, and at some "
                f"other counts a row's bits follow its place in the tile), got "
                f"kernels.tile_rows={rows} with kernels.num_threads={self.num_threads}"
            )
        if self.is_invariant and 1 < rows < MIN_TILE_ROWS:
            # Why: under MKL's SSE4.2 kernels (what a CPU without AVX gets) a row's bits
            # followed its place in tiles of 2-7 rows even on one thread; 1 and 8-64 held
            # (tests/test_kernels_shapes.py). AVX CPUs hold at every height, so the refusal
            # costs them only tiles nobody needs.
            raise ValueError(
                f"kernels.tile_rows must be 1 or at least {MIN_TILE_ROWS} in invariant mode "
                f"(on CPUs without AVX, BLAS gave a row of a 2-7-row tile bits that follow its "
                f"place in the tile), got kernels.tile_rows={rows}"
            )
        if self.tp_max & (self.tp_max - 1) or self.tp_max > MAX_TP_MAX:
            raise ValueError(
                f"kernels.tp_max must be a power of two <= {MAX_TP_MAX} (the ranks of every TP "
                f"degree then hold whole subtrees of its fixed binary tree), got {self.tp_max}"
            )
        for key in ("side_stream_rows", "attention_group_splits", "attention_long_blocks"):
            value = getattr(self, key)
            if value is None and key == "attention_long_blocks":
                continue  # the launch's own
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"kernels.{key} must be an int >= 0, got {value!r}")
        size = self.attention_long_split_blocks
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(
                f"kernels.attention_long_split_blocks must be an int >= 1 or null, got {size!r}"
            )
        long_blocks = self.attention_long_blocks
        if long_blocks and self.attention_group_splits:
            raise ValueError(
                f"kernels.attention_long_blocks={long_blocks} and kernels."
                f"attention_group_splits={self.attention_group_splits}: groups count splits "
                "of one size, so set one of them to 0"
            )
        if size is not None and self.attention_group_splits:
            raise ValueError(
                f"kernels.attention_long_split_blocks={size} and kernels."
                f"attention_group_splits={self.attention_group_splits}: groups have no long "
                "splits, so leave it null or set attention_group_splits to 0"
            )
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ValueError(
                f"kernels.cuda_graphs must be a bool or null, got {self.cuda_graphs!r}"
            )
        sizes = self.cuda_graph_batch_sizes
        if sizes is None:
            return
        if (
            not isinstance(sizes, (list, tuple))
            or not sizes
            or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes)
            or any(a >= b for a, b in zip(sizes, sizes[1:], strict=False))
        ):
            raise ValueError(
                "kernels.cuda_graph_batch_sizes must be null or a non-empty, strictly "
                f"increasing list of ints >= 1, got {sizes!r}"
            )
        object.__setattr__(self, "cuda_graph_batch_sizes", tuple(sizes))  # YAML gives a list

    @property
    def is_invariant(self) -> bool:
        return self.mode == "invariant"


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The default graph batch sizes of a scheduler running up to max_num_seqs sequences a
    step: the powers of two from 1 up to the first at or past it, so every decode batch it can
    form has a graph (each captured when first used, so an unused size costs nothing)."""
    sizes = [1]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)
