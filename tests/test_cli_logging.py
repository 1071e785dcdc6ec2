"""What the launch scripts tell an operator on stderr while they work: the runtime's INFO
records (weight loading progress, its timing), as serve_ep.py shows them, from generate.py and
rollout.py too, which loaded a checkpoint with no word until their first result."""

from __future__ import annotations

import json
import re
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


def test_a_rollout_s_progress_bar_redraws_seldom_into_a_log(tmp_path):
    """stderr not a terminal (a Ray job's log, a redirect): each redraw of the bar is a line
    there (Ray reads a job's log a line at a time, '\\r' ending one), and tqdm redrew ten times
    a second: some 36,000 lines an hour of a rollout job. At most one each LOG_REDRAW_S now,
    beside the first and the last."""
    prompts = tmp_path / "in.jsonl"
    rows = [{"id": i, "prompt": [i % 200 + 1, 5, 7], "n": 4, "max_tokens": 24} for i in range(64)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cmd = [sys.executable, "launch/rollout.py", "--config", str(TINY_CONFIG), "--input"]
    cmd += [str(prompts), "--output", str(tmp_path / "out.jsonl"), "--batch-size", "32"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    redraws = re.findall(r"rollout: +\d+%\|[^\r\n]*", done.stderr)
    assert 2 <= len(redraws) <= 3, redraws
    assert redraws[-1].startswith("rollout: 100%|") and "256/256" in redraws[-1], redraws


def test_a_rollout_says_it_reads_its_input_before_reading_it(tmp_path):
    """Between "writing to" and "loading the model" a rollout read its whole input file (and
    the output's rows, to resume) with no word: 9 s for 200,000 short text rows."""
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"id": 1, "prompt": [1, 2, 3], "max_tokens": 2}) + "\n")
    cmd = [sys.executable, "launch/rollout.py", "--config", str(TINY_CONFIG), "--no-progress"]
    cmd += ["--input", str(prompts), "--output", str(tmp_path / "out.jsonl")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("rollout: ")]
    assert said[:3] == [
        f"rollout: writing to {tmp_path / 'out.jsonl'}",
        f"rollout: reading {prompts}",
        "rollout: loading the model on 1 rank(s)",
    ], said
