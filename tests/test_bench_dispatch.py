"""bench/dispatch.py as a smoke run on CPU: two gloo processes, the tiny shape, every path timed.

The GPU figures (NCCL, V2-Lite and V3 shapes) come from the same script on the device; this
keeps the script running in CI: both dispatchers and the raw all_to_all report positive times
and byte rates for every (shape, tokens) case, and a bad --world is refused by name.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATHS = ("all_to_all", "fixed_capacity", "raw all_to_all_single")


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "bench/dispatch.py", "--backend", "gloo", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_dispatch_bench_smoke_on_gloo():
    run = _run("--world", "2", "--shapes", "tiny", "--tokens", "4", "16", "--repeats", "2")
    assert run.returncode == 0, run.stderr
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| tiny")]
    cases = {(r[1].strip(), r[2].strip()) for r in rows}
    assert cases == {(t, p) for t in ("4", "16") for p in PATHS}, run.stdout
    for row in rows:
        dispatch_us, combine_us = float(row[3]), float(row[4])
        assert dispatch_us > 0 and combine_us > 0, row


def test_dispatch_bench_refuses_one_rank():
    run = _run("--world", "1", "--shapes", "tiny")
    assert run.returncode != 0 and "--world must be >= 2" in run.stderr
