"""bench/gpu_kernels.py's command line without a device: `--help` lists the sections and a
mistyped one is refused by name, both before CUDA is touched (it crashed with a CUDA error
on a host without one, and a mistyped name died on a KeyError after the device line)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*words: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "bench/gpu_kernels.py", *words]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_help_lists_the_sections():
    run = _run("--help")
    assert run.returncode == 0, run.stderr
    assert "usage: python bench/gpu_kernels.py [SECTION ...]" in run.stdout
    for name in ("rows", "linear", "grouped", "attention", "fast_choice_v3", "read_floor"):
        assert f" {name}" in run.stdout


def test_an_unknown_section_is_refused_by_name():
    run = _run("attention", "atention")
    assert run.returncode == 2
    assert "unknown section(s): atention" in run.stderr
    assert "device:" not in run.stdout


def test_attention_rows_name_the_kernel_fast_mode_ran():
    """`bench/gpu_kernels.py attention` times fast mode's op, which is FlashMLA only where its
    rules leave it: at 16 heads the invariant launch up to 256 (query, split) pairs or from 256
    queries, at 128 heads the split-KV kernel up to 4 queries. The forty-sixth session's table
    headed all of them 'FlashMLA'."""
    from bench.gpu_kernels import ATTENTION_SHAPES, fast_decode_path

    paths = {
        (heads, b, ctx): fast_decode_path(b, -(-ctx // 64), heads, True, (9, 0))
        for heads in (16, 128)
        for b, ctx in ATTENTION_SHAPES
    }
    flash = {key for key, path in paths.items() if path == "FlashMLA"}
    assert flash == {(16, 64, 1056), (16, 64, 4096)} | {
        (128, b, ctx) for b, ctx in ATTENTION_SHAPES if b > 4
    }
    assert paths[(128, 1, 4096)] == "split-KV Triton"
    assert paths[(16, 8, 8192)] == paths[(16, 256, 1024)] == "invariant launch"
    assert fast_decode_path(64, 17, 16, False, (9, 0)) == "split-KV Triton"  # not installed
    # Importable on a device other than SM90 (a Blackwell card): uses_flash_mla says no, so the
    # op runs the split-KV kernel at every shape; the column said FlashMLA or the invariant
    # launch there.
    assert {fast_decode_path(b, -(-ctx // 64), h, True, (10, 0)) for h, b, ctx in paths} == {
        "split-KV Triton"
    }


def test_graph_widths_are_the_engines_at_each_head_count():
    """The benches' block tables are as wide as the engine's decode graph's, and the engine
    takes its widths with the tail of the model's launch (DecodeGraphRunner): at 128 heads a
    query of 17 blocks runs in a table of 18 (one split, no merge), of 65 blocks in one of 66.
    The benches padded every head count to 16, 32, 64 and 128, so their 128-head rows at
    context 1024 ran two splits and a merge the engine never runs (fifty-ninth session)."""
    from bench.gpu_kernels import _graph_width
    from moe_kernels.attention_launch import WIDE_LAUNCH, split_count

    assert [_graph_width(b, 16) for b in (16, 17, 33, 65)] == [16, 32, 64, 128]
    assert [_graph_width(b, 128) for b in (16, 17, 18, 19, 65, 67)] == [18, 18, 18, 34, 66, 128]
    width = _graph_width(17, 128)  # context 1024 decoded: a query of 17 blocks
    assert split_count(width, WIDE_LAUNCH.split_blocks, WIDE_LAUNCH.tail_blocks) == 1
