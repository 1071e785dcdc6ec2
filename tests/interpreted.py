"""Running Triton kernel checks on CPU under TRITON_INTERPRET=1, for the kernel test modules.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. at import of the kernel module,
and other test modules may import those modules first (through the op table), so a module's
checks run together in one fresh interpreter process and each test asserts on its own check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def run_checks(checks: dict[str, Callable], seed: int) -> None:
    """Subprocess entry: run every check, print {name: traceback or ""} as JSON."""
    results = {}
    for name, check in checks.items():
        try:
            check(torch.Generator().manual_seed(seed))
            results[name] = ""
        except Exception:
            results[name] = traceback.format_exc()
    print(json.dumps(results))


def interpreted_results(module: str, seed: int) -> dict[str, str]:
    """Run `module`'s CHECKS in a fresh interpreted process -> {name: traceback or ""}."""
    code = f"import {module} as m; from tests.interpreted import run_checks; "
    code += f"run_checks(m.CHECKS, {seed})"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])
