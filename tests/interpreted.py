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


def tile_dot(a, b):
    """The interpreter's tl.dot under run_checks: numpy arrays [..., M, K] @ [..., K, N], one
    einsum reduction per output element (numpy's own loop, no BLAS)."""
    import numpy as np

    return np.einsum("...mk,...kn->...mn", a, b, optimize=False)


def _dot_by_position_free_sums() -> None:
    """Make the interpreter's tl.dot sum each output element the same way wherever it sits in
    the tile. Triton's interpreter computes tl.dot with np.matmul, and numpy's OpenBLAS picks
    its kernel by CPU: on some (an AVX2 AMD EPYC, for one) an element's rounding follows its
    row's position in the tile, so checks that a row keeps its bits across row buckets, tile
    shapes or head subsets failed there and passed elsewhere. numpy's own einsum loop (no
    BLAS: optimize=False) runs one reduction per output element, the same for every element.
    The checks prove the kernels' tiling and order are batch-invariant; the compiled kernels'
    bits are the GPU tests' to prove (tests/test_gpu_kernels.py)."""
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        # bf16 and fp8 arrive as unsigned integers (the interpreter's storage): its own path.
        if a.data.dtype.kind != "f" or a.data.dtype != b.data.dtype:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        out_dtype = d.data.dtype
        product = tile_dot(a.data.astype(out_dtype), b.data.astype(out_dtype))
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


def _index_by_item() -> None:
    """Let a runtime-bound loop's bound be an interpreted scalar under numpy >= 2.4. Triton
    3.6's interpreter holds a scalar assigned in a kernel as a one-element 1-d array and turns
    it into a loop bound with int(array), which numpy 2.4 refuses (only 0-d arrays convert);
    .item() gives the same integer from any one-element array. The compiled kernels never run
    this path."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_lang_tensor


def run_checks(checks: dict[str, Callable], seed: int) -> None:
    """Subprocess entry: run every check, print {name: traceback or ""} as JSON."""
    _dot_by_position_free_sums()
    _index_by_item()
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
