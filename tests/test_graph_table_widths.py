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
