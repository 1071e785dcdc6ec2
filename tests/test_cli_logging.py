"""What the launch scripts tell an operator on stderr while they work: the runtime's INFO
records (weight loading progress, its timing), as serve_ep.py shows them, from generate.py and
rollout.py too, which loaded a checkpoint with no word until their first result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.invariance import TINY_CONFIG

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script", ["generate", "rollout"])
def test_a_script_shows_the_runtime_s_loading_records(tmp_path, script):
    cmd = [sys.executable, f"launch/{script}.py", "--config", str(TINY_CONFIG)]
    if script == "rollout":
        prompts = tmp_path / "in.jsonl"
        prompts.write_text(json.dumps({"id": 1, "prompt": [1, 2, 3], "max_tokens": 2}) + "\n")
        cmd += ["--input", str(prompts), "--output", str(tmp_path / "out.jsonl"), "--no-progress"]
    else:
        cmd += ["--prompt", "Hi", "--max-tokens", "2"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert " INFO moe_runtime.loader: weights ready in " in done.stderr, done.stderr
