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
