"""The block-table widths DecodeGraphRunner captures each batch size at (no GPU needed)."""

from __future__ import annotations

from moe_kernels.attention_launch import WIDE_LAUNCH
from moe_runtime.worker.cuda_graphs import table_widths


def test_table_widths_double_from_one_wide_split_to_the_longest_context():
    first = WIDE_LAUNCH.split_blocks  # a table the wide attention launch reads in one split
    assert table_widths(8 * first) == (first, 2 * first, 4 * first, 8 * first)
    assert table_widths(5 * first) == (first, 2 * first, 4 * first, 5 * first)
    assert table_widths(first) == (first,)
    assert table_widths(first - 3) == (first - 3,)  # short contexts: one width


def test_table_widths_of_the_wide_launch_hold_whole_splits_and_the_tail():
    """At 128 heads a query's last split takes up to tail_blocks more, so each width is the
    widest table of its split count: 18 blocks (one split) holds contexts of 17 and 18 blocks,
    which a width of 16 sent to a second split."""
    from moe_kernels.attention_launch import head_launch, split_count

    launch = head_launch(128)
    split, tail = launch.split_blocks, launch.tail_blocks
    assert tail > 0 and launch == WIDE_LAUNCH
    widths = table_widths(200, tail)
    assert widths == (split + tail, 2 * split + tail, 4 * split + tail, 8 * split + tail, 200)
    for count, width in zip((1, 2, 4, 8), widths, strict=False):
        assert split_count(width, split, tail) == count
        assert split_count(width + 1, split, tail) == count + 1  # the widest of its count
    # A model below 64 heads keeps the widths of whole wide splits (its launch has no tail).
    assert head_launch(16).tail_blocks == 0
    assert table_widths(200, head_launch(16).tail_blocks) == table_widths(200)
