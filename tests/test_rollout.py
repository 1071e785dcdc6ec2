"""launch/rollout.py: rows equal LLM.generate bit for bit, a killed run resumes without loss or
duplicates, --score equals the rollout's logprobs bit for bit, bad rows name their line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from launch import rollout
from moe_runtime import LLM, SamplingParams
from moe_runtime.seeds import derive_seed
from tests.invariance import TINY_CONFIG

ROOT = Path(__file__).resolve().parent.parent
ROWS = [
    {"id": "text", "prompt": "Hello there", "n": 2, "seed": 7, "temperature": 0.8, "logprobs": 3},
    {"id": 1, "prompt": [5, 6, 7, 8], "seeds": [11, 12, 13], "top_k": 20, "max_tokens": 5},
    {"id": "greedy", "prompt": [9] * 40, "temperature": 0.0, "logprobs": 1},
    {"id": "derived", "prompt": "abc", "n": 2, "top_p": 0.9},  # seeded from --base-seed
]
ARGS = ["--max-tokens", "7", "--temperature", "1.0", "--batch-size", "3", "--base-seed", "5"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(*argv) -> int:
    return rollout.main(["--config", str(TINY_CONFIG), "--no-progress", *map(str, argv)])


def exact(row: dict) -> tuple:
    """Token ids, logprobs and top logprobs of a row, floats as their exact bits."""
    return (
        tuple(row["token_ids"]),
        tuple(map(float.hex, row["logprobs"])),
        tuple(
            tuple((int(t), float.hex(lp)) for t, lp in top.items()) for top in row["top_logprobs"]
        ),
    )


@pytest.fixture(scope="module")
def rollout_rows(tmp_path_factory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("rollout")
    out = tmp / "out.jsonl"
    assert run("--input", write_jsonl(tmp / "in.jsonl", ROWS), "--output", out, *ARGS) == 0
    return out, read_jsonl(out)


def test_rows_equal_generate(rollout_rows):
    _, rows = rollout_rows
    llm = LLM(TINY_CONFIG)
    expected = []
    for row_idx, row in enumerate(ROWS):
        knobs = {"max_tokens": row.get("max_tokens", 7), "temperature": row.get("temperature", 1.0)}
        knobs["return_routed_experts"] = True
        knobs.update({k: row[k] for k in ("top_k", "top_p", "logprobs") if k in row})
        if "seeds" in row:  # one request per sample seed
            for seed in row["seeds"]:
                out = llm.generate([row["prompt"]], SamplingParams(seed=seed, **knobs))[0]
                expected.append(((row["id"], len(expected)), out.outputs[0]))
            continue
        seed = row.get("seed", derive_seed(5, row_idx))
        out = llm.generate([row["prompt"]], SamplingParams(n=row.get("n", 1), seed=seed, **knobs))
        expected.extend(((row["id"], i), o) for i, o in enumerate(out[0].outputs))
    llm.shutdown()
    assert len(rows) == len(expected) == 8
    for row, (_, want) in zip(rows, expected, strict=True):
        got = exact(row)
        assert got[0] == tuple(want.token_ids) and got[1] == tuple(map(float.hex, want.logprobs))
        assert got[2] == tuple(
            tuple((t, lp.hex()) for t, lp in top.items()) for top in want.top_logprobs
        )
        assert row["finish_reason"] == want.finish_reason
        assert row["routed_experts"] == np.asarray(want.routed_experts).tolist()
        assert len(row["routed_experts"]) == len(row["token_ids"])  # one entry per token
    assert [(r["id"], r["sample_idx"]) for r in rows[:3]] == [("text", 0), ("text", 1), (1, 0)]


def test_no_routed_experts_flag(tmp_path):
    source, out = write_jsonl(tmp_path / "in.jsonl", ROWS[:1]), tmp_path / "out.jsonl"
    assert run("--input", source, "--output", out, "--no-routed-experts", *ARGS) == 0
    assert [r["routed_experts"] for r in read_jsonl(out)] == [None, None]


def test_score_equals_rollout_logprobs(rollout_rows, tmp_path):
    out, rows = rollout_rows
    scores = tmp_path / "scores.jsonl"
    assert run("--input", out, "--output", scores, "--score", "--batch-size", "4") == 0
    scored = read_jsonl(scores)
    assert [(r["id"], r["sample_idx"]) for r in scored] == [
        (r["id"], r["sample_idx"]) for r in rows
    ]
    for row, score in zip(rows, scored, strict=True):
        assert list(map(float.hex, score["logprobs"])) == list(map(float.hex, row["logprobs"]))


def test_torn_last_line_is_cut_and_redone(rollout_rows, tmp_path):
    out, rows = rollout_rows
    partial = tmp_path / "partial.jsonl"
    lines = out.read_text().splitlines(keepends=True)
    partial.write_text("".join(lines[:5]) + lines[5][:40])  # killed in the middle of a write
    assert run("--input", write_jsonl(tmp_path / "in.jsonl", ROWS), "--output", partial, *ARGS) == 0
    assert read_jsonl(partial) == rows


def test_killed_run_resumes_without_loss_or_duplicates(tmp_path):
    rows = [
        {"id": i, "prompt": [i % 250 + 1, 7, 9, 11] * (1 + i % 5), "n": 4, "max_tokens": 32}
        for i in range(40)
    ]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    args = ["--input", source, "--batch-size", "8", "--base-seed", "3"]
    killed = tmp_path / "killed.jsonl"
    cmd = [sys.executable, "launch/rollout.py", "--config", str(TINY_CONFIG), "--no-progress"]
    proc = subprocess.Popen([*cmd, *map(str, args), "--output", str(killed)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not (killed.exists() and killed.stat().st_size > 0):
            assert proc.poll() is None and time.monotonic() < deadline, "no batch was written"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    num_written = len(killed.read_text().splitlines())
    assert 0 < num_written < 160, f"{num_written} rows: the kill did not land mid-run"
    assert run(*args, "--output", killed) == 0
    complete = tmp_path / "complete.jsonl"
    assert run(*args, "--output", complete) == 0
    resumed, reference = read_jsonl(killed), read_jsonl(complete)
    keys = [(r["id"], r["sample_idx"]) for r in resumed]
    assert len(keys) == len(set(keys)) == 160
    assert resumed == reference


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ("{not json", "Expecting property name"),
        ({"id": "x", "prompt": "a", "temprature": 1.0}, "unknown field 'temprature'"),
        ({"prompt": "a"}, "missing field 'id'"),
        ({"id": "x", "prompt": []}, "prompt must be"),
        ({"id": "x", "prompt": "a", "top_p": 2.0}, "top_p"),
        ({"id": "x", "prompt": "a", "n": 2, "seeds": [1]}, "seeds must be a list of n=2"),
        ({"id": "x", "prompt": "a", "seeds": [2**63]}, "seed must be an int in [0, 2**63 - 1]"),
        ({"id": "x", "prompt": "a", "n": 3, "seed": 2**63}, "seed must be an int in [0, 2**63"),
        ({"id": "x", "prompt": [1, 2, 9999]}, "token id 9999"),
        ({"id": "x", "prompt": [1] * 2000}, "max_model_len"),
        ({"id": 1, "prompt": "dup"}, "appears twice"),
    ],
)
def test_bad_row_names_its_line_and_nothing_is_generated(tmp_path, capsys, bad, problem):
    source = tmp_path / "in.jsonl"
    bad_line = bad if isinstance(bad, str) else json.dumps(bad)
    good = [json.dumps({"id": 1, "prompt": "ok"}), ""]
    source.write_text("\n".join([*good, bad_line]) + "\n")
    out = tmp_path / "out.jsonl"
    assert run("--input", source, "--output", out, "--max-tokens", "2") == 2
    err = capsys.readouterr().err
    assert f"{source}:3:" in err and problem in err, err
    assert not out.exists()


def test_relative_output_refused_under_ray_job_and_written_path_printed(
    tmp_path, monkeypatch, capsys
):
    source = write_jsonl(tmp_path / "in.jsonl", ROWS[2:3])
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(rollout.RAY_JOB_ENV, raising=False)
    assert run("--input", source, "--output", "here.jsonl", "--max-tokens", "2") == 0
    assert f"to {tmp_path / 'here.jsonl'}" in capsys.readouterr().err  # relative, made absolute
    monkeypatch.setenv(rollout.RAY_JOB_ENV, "{}")  # what Ray sets for a job's entrypoint
    assert run("--input", source, "--output", "job.jsonl", "--max-tokens", "2") == 2
    err = capsys.readouterr().err
    assert "--output job.jsonl is relative" in err and "pass an absolute path" in err, err
    assert not (tmp_path / "job.jsonl").exists()
    out = tmp_path / "job.jsonl"
    assert run("--input", source, "--output", out, "--max-tokens", "2") == 0
    assert f"to {out}" in capsys.readouterr().err and len(read_jsonl(out)) == 1
