"""launch/rollout.py: rows equal LLM.generate bit for bit, a killed run resumes without loss or
duplicates, --score equals the rollout's logprobs bit for bit, bad rows name their line before
anything runs (or are skipped), a resume with changed settings is refused, and so is a second run
on an output another run is writing."""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from launch import fingerprint, rollout, rollout_io
from launch.rollout_io import append_rows, lock_output, read_done
from launch.rollout_settings import settings_path
from moe_runtime import LLM, CompletionOutput, SamplingParams
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.seeds import derive_seed
from moe_runtime.tokenizer import ByteTokenizer
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


def most_running(fn):
    """Run fn(); -> (its result, the most sequences any engine step ran meanwhile)."""
    counts = [0]
    step = LLMEngine.step

    def counting_step(self):
        deltas = step(self)
        counts.append(self.stats().num_running)
        return deltas

    LLMEngine.step = counting_step
    try:
        return fn(), max(counts)
    finally:
        LLMEngine.step = step


@pytest.fixture(scope="module")
def rollout_rows(tmp_path_factory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("rollout")
    out = tmp / "out.jsonl"
    source = write_jsonl(tmp / "in.jsonl", ROWS)
    code, most = most_running(lambda: run("--input", source, "--output", out, *ARGS))
    assert code == 0 and most > 1, f"no step ran more than {most} sample: nothing was batched"
    return out, read_jsonl(out)


def generate_alone(mode: str) -> list[tuple[tuple, CompletionOutput]]:
    """Each of ROWS' requests run alone through LLM.generate as the rollout's defaults (ARGS)
    make it; -> ((id, sample_idx), output) per sample, in the rollout's row order."""
    llm = LLM(TINY_CONFIG, **{"kernels.mode": mode})
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
    return expected


def test_rows_equal_generate(rollout_rows):
    _, rows = rollout_rows
    expected = generate_alone("invariant")
    assert len(rows) == len(expected) == 8
    for row, (_, want) in zip(rows, expected, strict=True):
        got = exact(row)
        assert got[0] == tuple(want.token_ids) and got[1] == tuple(map(float.hex, want.logprobs))
        assert got[2] == tuple(
            tuple((t, lp.hex()) for t, lp in top.items()) for top in want.top_logprobs
        )
        assert row["finish_reason"] == want.finish_reason and row["text"] == want.text
        assert row["routed_experts"] == np.asarray(want.routed_experts).tolist()
        assert len(row["routed_experts"]) == len(row["token_ids"])  # one entry per token
    assert [(r["id"], r["sample_idx"]) for r in rows[:3]] == [("text", 0), ("text", 1), (1, 0)]


def test_a_rows_own_stops_end_its_samples_as_generate_does(tmp_path, capsys):
    """A row's stop_token_ids, stop and ignore_eos reach its samples (they were refused as
    unknown fields: an RL job stopping on an id could not say so); its samples equal
    LLM.generate's with the same settings; a bad one is the row's error, naming the field."""
    prompt, greedy = [5, 6, 7, 8], {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    free = [
        r["token_ids"] for r in _rollout(tmp_path / "free", [{"id": 0, "prompt": prompt, **greedy}])
    ]
    llm = LLM(TINY_CONFIG)
    decode = llm.tokenizer.decode
    stop_at = next(t for t in free[0][1:] if (c := decode([t]).strip()) and c.isprintable())
    rows = [
        {"id": "ids", "prompt": prompt, **greedy, "stop_token_ids": [stop_at]},
        {"id": "text", "prompt": prompt, **greedy, "stop": [decode([stop_at]).strip()]},
    ]
    got = _rollout(tmp_path / "stops", rows)
    assert got[0]["token_ids"] == free[0][: free[0].index(stop_at) + 1]
    assert [out["finish_reason"] for out in got] == ["stop", "stop"]
    assert [out["stop_reason"] for out in got] == [stop_at, decode([stop_at]).strip()]
    for row, out in zip(rows, got, strict=True):
        knobs = {k: v for k, v in row.items() if k not in ("id", "prompt")}
        want = llm.generate([row["prompt"]], SamplingParams(seed=out["seed"], **knobs))[0]
        assert exact(out)[:2] == (tuple(want.token_ids), tuple(map(float.hex, want.logprobs)))
        assert out["finish_reason"] == want.finish_reason
        assert out["stop_reason"] == want.stop_reason
        # The text, cut before the stop string: the row said nothing of where it stops, and
        # its token ids decode to the stop string too.
        assert out["text"] == want.text == decode(out["token_ids"][:-1])
    llm.shutdown()
    source = write_jsonl(tmp_path / "bad.jsonl", [{"id": 0, "prompt": prompt, "stop_token_ids": 5}])
    assert run("--input", source, "--output", tmp_path / "bad.out.jsonl", *ARGS) == 2
    assert "stop_token_ids must be a list of token ids" in capsys.readouterr().err


def test_a_rows_min_tokens_holds_its_stops_off(tmp_path, capsys):
    """A row's min_tokens reaches its samples (it was refused as an unknown field): a stop id
    it would take is never sampled before it; one over max_tokens is the row's error."""
    prompt, greedy = [5, 6, 7, 8], {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    (free,) = _rollout(tmp_path / "free", [{"id": 0, "prompt": prompt, **greedy}])
    stop_at = free["token_ids"][1]
    row = {"id": 0, "prompt": prompt, **greedy, "stop_token_ids": [stop_at], "min_tokens": 12}
    (held,) = _rollout(tmp_path / "held", [row])
    assert stop_at not in held["token_ids"] and len(held["token_ids"]) == 12
    assert (held["finish_reason"], held["stop_reason"]) == ("length", None)
    source = write_jsonl(tmp_path / "bad.jsonl", [{**row, "min_tokens": 13}])
    assert run("--input", source, "--output", tmp_path / "bad.out.jsonl", *ARGS) == 2
    problem = "min_tokens must be an int >= 0 and <= max_tokens (12), got 13"
    assert problem in capsys.readouterr().err


def test_a_rows_include_stop_str_in_output_keeps_the_stop_string(tmp_path):
    prompt, greedy = [5, 6, 7, 8], {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    (free,) = _rollout(tmp_path / "free", [{"id": 0, "prompt": prompt, **greedy}])
    stop_at = free["token_ids"][1]
    row = {"id": 0, "prompt": prompt, **greedy, "stop_token_ids": [stop_at]}
    (cut,) = _rollout(tmp_path / "cut", [row])
    (kept,) = _rollout(tmp_path / "kept", [{**row, "include_stop_str_in_output": True}])
    assert cut["token_ids"] == kept["token_ids"] and cut["token_ids"][-1] == stop_at
    decode = ByteTokenizer(512, bos_token_id=256, eos_token_id=257).decode  # the tiny model's
    assert cut["text"] == decode(cut["token_ids"][:-1])
    assert kept["text"] == decode(kept["token_ids"])


def _rollout(directory: Path, rows: list[dict]) -> list[dict]:
    directory.mkdir()
    source, out = write_jsonl(directory / "in.jsonl", rows), directory / "out.jsonl"
    assert run("--input", source, "--output", out, "--no-routed-experts", *ARGS) == 0
    return read_jsonl(out)


def test_no_routed_experts_flag(tmp_path):
    source, out = write_jsonl(tmp_path / "in.jsonl", ROWS[:1]), tmp_path / "out.jsonl"
    assert run("--input", source, "--output", out, "--no-routed-experts", *ARGS) == 0
    assert [r["routed_experts"] for r in read_jsonl(out)] == [None, None]


def test_score_equals_rollout_logprobs_and_routed_experts(rollout_rows, tmp_path, capsys):
    """--score writes the rollout's logprobs and, unless --no-routed-experts, its routed
    experts: each scored token's, those of the position whose logits scored it."""
    out, rows = rollout_rows
    scores = tmp_path / "scores.jsonl"
    assert run("--input", out, "--output", scores, "--score", "--batch-size", "4") == 0
    scored = read_jsonl(scores)
    assert [(r["id"], r["sample_idx"]) for r in scored] == [
        (r["id"], r["sample_idx"]) for r in rows
    ]
    for row, score in zip(rows, scored, strict=True):
        assert list(map(float.hex, score["logprobs"])) == list(map(float.hex, row["logprobs"]))
        assert score["routed_experts"] == row["routed_experts"]
        assert len(score["routed_experts"]) == len(row["token_ids"])
    # engagement: the rows route tokens to several expert sets, so a shifted position differs
    assert any(r["routed_experts"][1:] != r["routed_experts"][:-1] for r in scored)
    none = tmp_path / "none.jsonl"
    assert run("--input", out, "--output", none, "--score", "--no-routed-experts") == 0
    assert all("routed_experts" not in r for r in read_jsonl(none))
    # rows with and without them are not mixed in one output: a part of its record
    capsys.readouterr()
    lines = none.read_text().splitlines(keepends=True)
    none.write_text("".join(lines[:2]))
    assert run("--input", out, "--output", none, "--score") == 2
    assert "this run has return_routed_experts=true" in capsys.readouterr().err


def test_prompt_routed_experts_complete_each_row_s_routing(rollout_rows, tmp_path, capsys):
    """--prompt-routed-experts: each row's prompt_routed_experts, then its routed_experts, are
    its whole sequence's routing (every position but the last), bitwise LLM.score_outputs
    from the first token; the rows are otherwise the run's without it. --score writes the same
    prompt rows. The prompt's routing is what a trainer replaying routing needs besides the
    generated tokens' (generation reports those only)."""
    out, rows = rollout_rows
    source = write_jsonl(tmp_path / "in.jsonl", [*ROWS, {"id": "one", "prompt": [4]}])
    with_prompt = tmp_path / "with_prompt.jsonl"
    argv = ["--input", source, "--output", with_prompt, "--prompt-routed-experts", *ARGS]
    assert run(*argv) == 0
    got = read_jsonl(with_prompt)
    assert [{k: v for k, v in r.items() if k != "prompt_routed_experts"} for r in got[:-1]] == rows
    llm = LLM(TINY_CONFIG)
    sequences = [r["prompt_token_ids"] + r["token_ids"] for r in got]
    whole = llm.score_outputs(sequences, [1] * len(got), return_routed_experts=True, use_tqdm=False)
    llm.shutdown()
    for row, scored in zip(got, whole, strict=True):
        assert len(row["prompt_routed_experts"]) == len(row["prompt_token_ids"]) - 1
        joined = row["prompt_routed_experts"] + row["routed_experts"]
        assert joined == np.asarray(scored.routed_experts).tolist()
    assert got[-1]["prompt_routed_experts"] == []  # a one-token prompt: nothing before it
    scores = tmp_path / "scores.jsonl"
    assert (
        run("--input", with_prompt, "--output", scores, "--score", "--prompt-routed-experts") == 0
    )
    for row, score in zip(got, read_jsonl(scores), strict=True):
        assert score["prompt_routed_experts"] == row["prompt_routed_experts"]
    capsys.readouterr()
    both = ["--prompt-routed-experts", "--no-routed-experts"]
    assert run("--input", source, "--output", tmp_path / "x.jsonl", *both) == 2
    assert "--prompt-routed-experts asks for routed experts" in capsys.readouterr().err


def test_score_under_other_settings_than_the_rollouts_says_so(rollout_rows, tmp_path, capsys):
    """--score read no record of the rollout that wrote its input: under another
    cache.block_size (the attention's KV splits) 40 of 238 logprobs differed, with no word.
    Scoring with other settings (a reference model) is allowed: a warning, not a refusal."""
    out, rows = rollout_rows
    recorded = json.loads(settings_path(out).read_text())
    other = recorded["cache.block_size"] * 2
    capsys.readouterr()
    assert run("--input", out, "--output", tmp_path / "same.jsonl", "--score") == 0
    assert "warning" not in capsys.readouterr().err
    scores = tmp_path / "other.jsonl"
    argv = ["--input", out, "--output", scores, "--score", "--set", f"cache.block_size={other}"]
    assert run(*argv) == 0
    err = capsys.readouterr().err
    assert (
        f"warning: {out} was generated with other settings than this --score run has "
        f"(cache.block_size={recorded['cache.block_size']} -> {other}): its logprobs will not "
        "be bitwise the rollout's"
    ) in err, err
    differing = [
        row["logprobs"] != score["logprobs"]
        for row, score in zip(rows, read_jsonl(scores), strict=True)
    ]
    assert any(differing)  # the warning's reason: other bits


def test_score_of_a_rollout_read_through_a_link_finds_its_record(rollout_rows, tmp_path, capsys):
    """The record is named after the rollout's resolved --output (every spelling of it shares
    one); --score looked for it beside the --input as spelled, so through a link it found none
    and said nothing of other settings."""
    out, _ = rollout_rows
    link = tmp_path / "link.jsonl"
    link.symlink_to(out)
    other = json.loads(settings_path(out).read_text())["cache.block_size"] * 2
    capsys.readouterr()
    argv = ["--input", link, "--output", tmp_path / "scores.jsonl", "--score"]
    assert run(*argv, "--set", f"cache.block_size={other}") == 0
    assert f"warning: {link} was generated with other settings" in capsys.readouterr().err


def test_score_with_logprobs_writes_the_rollouts_top_logprobs(rollout_rows, tmp_path):
    """--score --logprobs 3: each position's top 3 as the rollout row of a 3-logprob sample
    wrote them, bit for bit (JSON floats round-trip exactly)."""
    out, rows = rollout_rows
    scores = tmp_path / "scores.jsonl"
    assert run("--input", out, "--output", scores, "--score", "--logprobs", "3") == 0
    scored = {(r["id"], r["sample_idx"]): r for r in read_jsonl(scores)}
    with_three = [row for row in rows if row["id"] == "text"]  # the rows asked logprobs 3
    assert len(with_three) == 2 and all(len(t) >= 3 for t in with_three[0]["top_logprobs"])
    for row in with_three:
        score = scored[(row["id"], row["sample_idx"])]
        assert score["top_logprobs"] == row["top_logprobs"]
        assert list(map(float.hex, score["logprobs"])) == list(map(float.hex, row["logprobs"]))


def test_fast_kernels_control(tmp_path):
    """With fast kernels the batched rollout differs from each request alone, and its --score
    from its own logprobs: the two comparisons above could fail."""
    source, out = write_jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out.jsonl"
    fast = ["--set", "kernels.mode=fast"]
    assert run("--input", source, "--output", out, *ARGS, *fast) == 0
    rows = read_jsonl(out)
    alone = generate_alone("fast")
    assert len(rows) == len(alone) == 8
    assert any(
        exact(row)[1] != tuple(map(float.hex, want.logprobs))
        for row, (_, want) in zip(rows, alone, strict=True)
    ), "fast kernels gave each request alone the batch's bits"
    scores = tmp_path / "scores.jsonl"
    assert run("--input", out, "--output", scores, "--score", "--batch-size", "4", *fast) == 0
    assert any(
        score["logprobs"] != row["logprobs"]
        for row, score in zip(rows, read_jsonl(scores), strict=True)
    ), "fast kernels scored the rollout's own logprobs"


def test_torn_last_line_is_cut_and_redone(rollout_rows, tmp_path):
    out, rows = rollout_rows
    partial = tmp_path / "partial.jsonl"
    lines = out.read_text().splitlines(keepends=True)
    partial.write_text("".join(lines[:5]) + lines[5][:40])  # killed in the middle of a write
    settings_path(partial).write_bytes(settings_path(out).read_bytes())
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


def test_a_second_run_on_an_output_being_written_is_refused(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    out = tmp_path / "out.jsonl"
    holder = subprocess.Popen(  # a run that holds the output's lock, then is killed
        [sys.executable, "-c", HOLD_LOCK, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert run("--input", source, "--output", out, *ARGS) == 2
        err = capsys.readouterr().err
        assert f"another rollout (pid {holder.pid}) is writing {out}" in err, err
        assert not out.exists() and not settings_path(out).exists()
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert run("--input", source, "--output", out, *ARGS) == 0  # killed: the OS let go
    assert len(read_jsonl(out)) == ROWS[0]["n"]
    assert run("--input", source, "--output", out, *ARGS) == 0  # this run let go as it ended


HOLD_LOCK = """
import sys, time
from pathlib import Path
from launch.rollout_io import lock_output
lock = lock_output(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(600)
"""

BAD_ROWS = [
    ("{not json", "Expecting property name"),
    ('{"id": "x", "prompt": "a", "prompt": "b"}', "key 'prompt' appears twice"),
    ({"id": "x", "prompt": "a", "temprature": 1.0}, "unknown field 'temprature'"),
    ({"prompt": "a"}, "missing field 'id'"),
    ({"id": "x", "prompt": []}, "prompt must be"),
    ({"id": "x", "prompt": "a", "top_p": 2.0}, "top_p"),
    ({"id": "x", "prompt": "a", "top_p": "0.5"}, "top_p must be a finite number"),
    ({"id": "x", "prompt": "a", "temperature": "hot"}, "temperature must be a finite number"),
    ({"id": "x", "prompt": "a", "n": 2, "seeds": [1]}, "seeds must be a list of n=2"),
    ({"id": "x", "prompt": "a", "seeds": [2**63]}, "seed must be an int in [0, 2**63 - 1]"),
    ({"id": "x", "prompt": "a", "n": 3, "seed": 2**63}, "seed must be an int in [0, 2**63"),
    ({"id": "x", "prompt": [1, 2, 9999]}, "token id 9999"),
    ({"id": "x", "prompt": [1] * 2000}, "max_model_len"),
    # The prompt fits, with its max_tokens it does not: the engine's check_request refuses it.
    ({"id": "x", "prompt": [1] * 1020, "max_tokens": 8}, "1028 in all"),
    ({"id": "x", "prompt": "a", "n": 2, "logprobs": 600}, "logprobs=600"),
    ({"id": "x", "prompt": "a", "logprobs": 21}, "logprobs=21 is more than server.max_logprobs=20"),
]


def write_with_bad_row(path: Path, bad: str | dict) -> Path:
    """Line 1 a good row, line 2 blank, line 3 the bad row, line 4 a good row."""
    bad_line = bad if isinstance(bad, str) else json.dumps(bad)
    lines = [{"id": 1, "prompt": "ok"}, "", bad_line, {"id": "after", "prompt": [3, 4]}]
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in lines))
    return path


@pytest.mark.parametrize(
    ("bad", "problem"), [*BAD_ROWS, ({"id": 1, "prompt": "dup"}, "appears twice")]
)
def test_bad_row_names_its_line_and_nothing_is_generated(tmp_path, capsys, bad, problem):
    source = write_with_bad_row(tmp_path / "in.jsonl", bad)
    out = tmp_path / "out.jsonl"
    assert run("--input", source, "--output", out, "--max-tokens", "2", "--batch-size", "1") == 2
    err = capsys.readouterr().err
    assert f"error: {source}:3:" in err and problem in err, err
    assert not out.exists() and not settings_path(out).exists()


@pytest.mark.parametrize(("bad", "problem"), BAD_ROWS)
def test_skip_reports_a_bad_row_and_runs_the_others(tmp_path, capsys, bad, problem):
    source = write_with_bad_row(tmp_path / "in.jsonl", bad)
    out = tmp_path / "out.jsonl"
    args = ["--max-tokens", "2", "--batch-size", "1", "--on-bad-row", "skip"]
    assert run("--input", source, "--output", out, *args) == 0
    err = capsys.readouterr().err
    assert f"skipped {source}:3:" in err and problem in err, err
    assert err.count("skipped ") == 1  # once per row, not per sample
    assert [(r["id"], r["sample_idx"]) for r in read_jsonl(out)] == [(1, 0), ("after", 0)]


@pytest.mark.parametrize("on_bad_row", ["stop", "skip"])
def test_a_row_nested_too_deeply_is_a_bad_row(tmp_path, capsys, on_bad_row):
    """json's decoder recurses a level a bracket: a RecursionError traceback ended the run
    before, even with --on-bad-row skip (and its other rows unwritten)."""
    source = write_with_bad_row(tmp_path / "in.jsonl", "[" * 100_000 + "]" * 100_000)
    out = tmp_path / "out.jsonl"
    args = ["--max-tokens", "2", "--on-bad-row", on_bad_row]
    assert run("--input", source, "--output", out, *args) == (2 if on_bad_row == "stop" else 0)
    err = capsys.readouterr().err
    assert f"{source}:3: JSON nested too deeply to read" in err, err[-500:]
    if on_bad_row == "skip":
        assert [(r["id"], r["sample_idx"]) for r in read_jsonl(out)] == [(1, 0), ("after", 0)]


def test_a_row_asking_more_samples_than_a_request_may_is_a_bad_row(tmp_path, capsys, monkeypatch):
    """A row's samples are built at once: an n of 10**9 (a typo) filled the memory for minutes
    before anything was said. n, a row's or --n's, is held to
    server.max_sequences_per_request, as a completion's prompts x n are."""
    bound = ["--set", "server.max_sequences_per_request=4", "--max-tokens", "2"]
    source = write_with_bad_row(tmp_path / "in.jsonl", {"id": "x", "prompt": "a", "n": 5})
    out = tmp_path / "out.jsonl"
    assert run("--input", source, "--output", out, *bound, "--on-bad-row", "skip") == 0
    err = capsys.readouterr().err
    expected = "n=5 is more samples than server.max_sequences_per_request=4 allows a row"
    assert f"skipped {source}:3: {expected}" in err, err
    assert [(r["id"], r["sample_idx"]) for r in read_jsonl(out)] == [(1, 0), ("after", 0)]
    monkeypatch.setattr(rollout, "LLM", None)  # refused before the model loads
    assert run("--input", source, "--output", tmp_path / "o2.jsonl", *bound, "--n", "5") == 2
    err = capsys.readouterr().err
    assert "error: --n 5 is more samples than server.max_sequences_per_request=4" in err, err


def test_skip_runs_the_good_rows_as_a_clean_input_would(tmp_path, capsys):
    good = [
        {"id": "a", "prompt": "first", "seed": 3},
        {"id": "b", "prompt": [5, 6], "n": 2, "seed": 4},
        {"id": "c", "prompt": "last", "seed": 5},
    ]
    bad = [
        "[1, 2",
        {"id": "u", "prompt": "a", "colour": 1},
        {"id": "v", "prompt": [1] * 1020},
        {"id": "w", "prompt": "a", "logprobs": 600},
    ]
    lines = [good[0], bad[0], bad[1], good[1], "", bad[2], bad[3], good[2]]
    source = tmp_path / "mixed.jsonl"
    source.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in lines))
    args = ["--max-tokens", "8", "--batch-size", "2"]
    mixed, clean = tmp_path / "mixed_out.jsonl", tmp_path / "clean_out.jsonl"
    assert run("--input", source, "--output", mixed, "--on-bad-row", "skip", *args) == 0
    err = capsys.readouterr().err
    skipped = [line.split(": ")[0] for line in err.splitlines() if line.startswith("skipped ")]
    assert skipped == [f"skipped {source}:{n}" for n in (2, 3, 6, 7)], err
    assert "4 bad input rows skipped" in err
    clean_source = write_jsonl(tmp_path / "clean.jsonl", good)
    assert run("--input", clean_source, "--output", clean, *args) == 0
    assert read_jsonl(mixed) == read_jsonl(clean)


def test_skip_with_every_row_bad_fails_naming_the_file(tmp_path, capsys):
    """It wrote no row and exited 0, as a job that did its work. Rows bad when read and rows
    the engine refuses count alike; nothing is written, not even the settings record."""
    lines = [
        "[1, 2",
        {"id": "u", "prompt": "a", "colour": 1},
        {"id": "w", "prompt": "a", "logprobs": 600},
    ]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in lines))
    assert run("--input", source, "--output", out, "--max-tokens", "2", "--on-bad-row", "skip") == 1
    err = capsys.readouterr().err
    assert err.count("skipped ") == 3, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: every row of {source} is bad (3 skipped): no row to run"], err
    assert not out.exists() and not settings_path(out).exists()


def test_duplicate_id_refuses_the_whole_file_even_with_skip(tmp_path, capsys):
    source = write_with_bad_row(tmp_path / "in.jsonl", {"id": 1, "prompt": "dup"})
    out = tmp_path / "out.jsonl"
    assert run("--input", source, "--output", out, "--on-bad-row", "skip") == 2
    err = capsys.readouterr().err
    assert f"error: {source}:3: id 1 appears twice (first on line 1)" in err, err
    assert not out.exists()


@pytest.mark.parametrize("bad_first", [True, False], ids=["bad-first", "bad-second"])
def test_a_bad_row_takes_part_in_the_repeated_id_check(tmp_path, capsys, bad_first):
    """A bad row left the check before its id was seen: under skip the other row of that id
    ran, and the output's row for it matched one of two different inputs."""
    bad, good = {"id": "a", "prompt": "one", "top_p": 5}, {"id": "a", "prompt": "two"}
    rows = [bad, good] if bad_first else [good, bad]
    source, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    assert run("--input", source, "--output", out, "--on-bad-row", "skip", *ARGS) == 2
    err = capsys.readouterr().err
    assert f"error: {source}:2: id 'a' appears twice (first on line 1)" in err, err
    assert not out.exists() or out.stat().st_size == 0


def test_the_input_digest_is_read_a_line_at_a_time(tmp_path, monkeypatch):
    """--score's input (a rollout's output, routed experts and all) was held whole a second
    time, as text, to digest it: ~3x the file in memory. The digest is the same as of the
    non-empty lines joined (resumes of earlier outputs still match)."""
    import hashlib
    import tracemalloc

    from launch.rollout_io import read_samples

    bulk = {"token_ids": list(range(400)), "routed_experts": [[[1, 2, 3, 4, 5, 6]] * 26] * 400}
    rows = [{"id": i, "prompt_token_ids": [1, 2], **bulk} for i in range(30)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    size = source.stat().st_size
    assert size > 5_000_000
    tracemalloc.start()
    samples = read_samples(source, {}, 0, score=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(samples.samples) == 30
    assert peak < size, f"read_samples held {peak} bytes at once for a {size} byte file"
    lines = [line.strip() for line in source.read_text().splitlines() if line.strip()]
    assert samples.sha256 == hashlib.sha256("\n".join(lines).encode()).hexdigest()


@pytest.mark.parametrize("on_bad_row", ["stop", "skip"])
def test_score_refuses_a_duplicate_id_and_sample_idx(tmp_path, capsys, on_bad_row):
    rows = [
        {"id": "a", "prompt_token_ids": [1, 2, 3], "token_ids": [4, 5]},
        {"id": "a", "sample_idx": 1, "prompt_token_ids": [1, 2, 3], "token_ids": [6]},
        {"id": "a", "sample_idx": 0, "prompt_token_ids": [1, 2, 3], "token_ids": [9, 9, 9]},
    ]
    source, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    assert run("--input", source, "--output", out, "--score", "--on-bad-row", on_bad_row) == 2
    err = capsys.readouterr().err
    assert f"error: {source}:3: id 'a' sample_idx 0 appears twice (first on line 1)" in err, err
    assert not out.exists()
    assert run("--input", write_jsonl(source, rows[:2]), "--output", out, "--score") == 0
    assert [(r["id"], r["sample_idx"]) for r in read_jsonl(out)] == [("a", 0), ("a", 1)]


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ({"prompt_token_ids": [1] * 1000, "token_ids": [2] * 30}, "scheduler.max_model_len"),
        ({"prompt_token_ids": [1, 2], "token_ids": [3, 600]}, "token id 600"),
    ],
)
def test_score_checks_rows_with_the_engine_before_scoring(tmp_path, capsys, bad, problem):
    rows = [
        {"id": "ok", "prompt_token_ids": [1, 2], "token_ids": [3]},
        {"id": "bad", **bad},
        {"id": "after", "prompt_token_ids": [4], "token_ids": [5, 6]},
    ]
    source, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    args = ["--input", source, "--output", out, "--score", "--batch-size", "1"]
    assert run(*args) == 2
    err = capsys.readouterr().err
    assert f"error: {source}:2:" in err and problem in err, err
    assert not out.exists()
    assert run(*args, "--on-bad-row", "skip") == 0
    assert f"skipped {source}:2:" in capsys.readouterr().err
    assert [r["id"] for r in read_jsonl(out)] == ["ok", "after"]


def partial_run(tmp_path: Path, num_kept: int) -> tuple[Path, Path, list[str]]:
    """A run of ROWS cut to its first `num_kept` rows (as a kill leaves it): input, output, and
    the full run's lines."""
    source, out = write_jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out.jsonl"
    assert run("--input", source, "--output", out, *ARGS) == 0
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:num_kept]))
    return source, out, lines


@pytest.mark.parametrize(
    ("change", "old", "new"),
    [
        (["--max-tokens", "8"], "max_tokens=7", "max_tokens=8"),
        (["--base-seed", "6"], "base_seed=5", "base_seed=6"),
        (["--temperature", "0"], "temperature=1.0", "temperature=0.0"),
        (["--no-routed-experts"], "return_routed_experts=true", "return_routed_experts=false"),
        (["--set", "model.seed=1"], "model.seed=0", "model.seed=1"),
        (["--set", "kernels.mode=fast"], 'kernels.mode="invariant"', 'kernels.mode="fast"'),
        # Part of the bits in invariant mode too: the KV splits are runs of cache blocks.
        (["--set", "cache.block_size=8"], "cache.block_size=16", "cache.block_size=8"),
        # Decides which rows run (a row skipped as too long would be appended out of order).
        (
            ["--set", "scheduler.max_model_len=2048"],
            "scheduler.max_model_len=1024",
            "scheduler.max_model_len=2048",
        ),
        # Decides which rows run too (a row's n past it is a bad row).
        (
            ["--set", "server.max_sequences_per_request=64"],
            "server.max_sequences_per_request=65536",
            "server.max_sequences_per_request=64",
        ),
        # And so does the bound on a row's logprobs.
        (
            ["--set", "server.max_logprobs=10"],
            "server.max_logprobs=20",
            "server.max_logprobs=10",
        ),
        (["--edit-input"], "input_sha256=", "input_sha256="),
    ],
)
def test_resume_with_changed_settings_is_refused_naming_the_setting(
    tmp_path, capsys, change, old, new
):
    source, out, _ = partial_run(tmp_path, 4)
    before = out.read_bytes()
    if change == ["--edit-input"]:  # a prompt changed under the same id
        write_jsonl(source, [{**ROWS[0], "prompt": "Hello where"}, *ROWS[1:]])
        change = []
    capsys.readouterr()
    argv = ["--input", source, "--output", out, *ARGS, *change]
    assert run(*argv) == 2
    err = capsys.readouterr().err
    assert f"error: {out} was written with {old}" in err and f"this run has {new}" in err, err
    assert out.read_bytes() == before


def test_resume_under_other_runtime_code_is_refused(tmp_path, capsys, monkeypatch):
    """The record names the code the rows came from: a resume after the runtime's sources
    changed (an upgrade, an edited kernel) is refused, naming the digest."""
    source, out, _ = partial_run(tmp_path, 4)
    recorded = fingerprint.runtime_stamp()
    assert len(recorded["runtime.source_sha256"]) == 64 and recorded["runtime.torch"]
    edited = {**recorded, "runtime.source_sha256": "0" * 64}
    monkeypatch.setattr(fingerprint, "runtime_stamp", lambda: edited)
    capsys.readouterr()
    assert run("--input", source, "--output", out, *ARGS) == 2
    err = capsys.readouterr().err
    assert f'runtime.source_sha256="{recorded["runtime.source_sha256"]}"' in err, err


def test_resume_with_the_same_settings_is_bitwise_an_uninterrupted_run(tmp_path):
    source, out, lines = partial_run(tmp_path, 3)
    # Batching and scheduling change no row's bits, so they may change between runs.
    changed = ["--batch-size", "2", "--set", "scheduler.max_num_seqs=2", "--on-bad-row", "skip"]
    assert run("--input", source, "--output", out, *ARGS, *changed) == 0
    assert out.read_text().splitlines(keepends=True) == lines


def test_resume_of_an_output_without_settings_record_is_refused(tmp_path, capsys):
    source, out, _ = partial_run(tmp_path, 4)
    settings_path(out).unlink()  # an output written before the tool recorded settings
    assert run("--input", source, "--output", out, *ARGS) == 2
    err = capsys.readouterr().err
    assert f"{out} is not empty but has no settings record {settings_path(out)}" in err, err
    assert "Write to a new --output" in err and len(read_jsonl(out)) == 4


def test_output_without_rows_takes_the_new_settings(tmp_path):
    source, out, _ = partial_run(tmp_path, 0)  # the record of a run that wrote no row
    assert run("--input", source, "--output", out, *ARGS[:-1], "6") == 0
    assert json.loads(settings_path(out).read_text())["base_seed"] == 6
    assert len(read_jsonl(out)) == 8


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


def test_resume_after_the_checkpoints_weights_were_overwritten_is_refused(tmp_path, capsys):
    """A trainer saving its next step over model.path between a killed run and its resume: the
    resume appended the new weights' rows to the old ones' with nothing to tell them apart.
    The same directory written another way is the same setting."""
    from tests.serving import write_checkpoint

    checkpoint = write_checkpoint(tmp_path / "ckpt", seed=1)
    other = write_checkpoint(tmp_path / "other", seed=2)
    config = tmp_path / "config.yaml"
    config.write_text("scheduler:\n  max_model_len: 256\n")
    source, out = write_jsonl(tmp_path / "in.jsonl", ROWS[:4]), tmp_path / "out.jsonl"

    def run(*extra) -> int:
        argv = ["--config", config, "--no-progress", "--input", source, "--output", out, *ARGS]
        return rollout.main([*map(str, argv), *extra])

    argv = ["--set", f"model.path={checkpoint}"]
    assert run(*argv) == 0
    rows = out.read_text().splitlines(keepends=True)
    out.write_text("".join(rows[:2]))
    roundabout = f"model.path={tmp_path}/ckpt/../ckpt"
    assert run("--set", roundabout) == 0  # the same weights, another spelling: resumed
    assert out.read_text().splitlines(keepends=True) == rows
    out.write_text("".join(rows[:2]))
    time.sleep(0.01)
    Path(f"{checkpoint}/model.safetensors").write_bytes(
        Path(f"{other}/model.safetensors").read_bytes()
    )
    capsys.readouterr()
    assert run(*argv) == 2
    err = capsys.readouterr().err
    assert f"error: {out} was written with model.weights=" in err, err
    assert out.read_text().splitlines(keepends=True) == rows[:2]


def test_resume_after_the_tokenizer_changed_is_refused(tmp_path, capsys):
    """tokenizer.json replaced between a killed run and its resume went unnoticed (only the
    weights were stamped): one output held two tokenizations of the same prompt text."""
    from tests.checkpoints import write_byte_level_bpe
    from tests.serving import write_checkpoint

    checkpoint = Path(write_checkpoint(tmp_path / "ckpt", seed=1))
    write_byte_level_bpe(checkpoint, "hello world, hello there " * 8)
    config = tmp_path / "config.yaml"
    config.write_text("scheduler:\n  max_model_len: 256\n")
    rows = [{"id": i, "prompt": f"hello {i}"} for i in range(3)]
    source, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    argv = ["--config", config, "--no-progress", "--input", source, "--output", out, *ARGS]
    argv += ["--set", f"model.path={checkpoint}"]
    assert rollout.main(list(map(str, argv))) == 0
    recorded = json.loads(settings_path(out).read_text())["model.tokenizer_files"]
    assert list(recorded) == ["tokenizer.json"]
    written = out.read_text().splitlines(keepends=True)
    out.write_text(written[0])
    write_byte_level_bpe(checkpoint, "a different corpus entirely " * 8)
    capsys.readouterr()
    assert rollout.main(list(map(str, argv))) == 2
    err = capsys.readouterr().err
    assert f"error: {out} was written with model.tokenizer_files=" in err, err
    assert out.read_text() == written[0]
    # Scoring reads ids only: the rollout's rows score without a word of the tokenizer.
    scores = tmp_path / "scores.jsonl"
    argv = ["--config", config, "--no-progress", "--input", out, "--output", scores, "--score"]
    assert rollout.main([*map(str, argv), "--set", f"model.path={checkpoint}"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert "model.tokenizer_files" not in json.loads(settings_path(scores).read_text())


def test_the_settings_record_names_the_ranks_device_and_refuses_another(tmp_path, capsys):
    """A resume on another kind of machine (another GPU, a CPU whose kernels or BLAS take
    another instruction set) gave rows of other bits, accepted: the record held no hardware."""
    from moe_runtime.worker import worker

    source, out = write_jsonl(tmp_path / "in.jsonl", ROWS[:2]), tmp_path / "out.jsonl"
    argv = ["--input", source, "--output", out]
    assert run(*argv, *ARGS) == 0
    (device,) = json.loads(settings_path(out).read_text())["runtime.devices"]
    assert device == worker.device_identity(torch.device("cpu"))
    assert device["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    written = out.read_text().splitlines(keepends=True)
    out.write_text(written[0])
    capsys.readouterr()
    real = worker.device_identity
    with pytest.MonkeyPatch.context() as patch:  # as MKL kept to AVX2 on an AVX-512 host
        patch.setattr(worker, "device_identity", lambda d: {**real(d), "matmul_probe": "0" * 16})
        assert run(*argv, *ARGS) == 2
    err = capsys.readouterr().err
    assert f"error: {out} was written with runtime.devices=" in err, err
    assert run(*argv, *ARGS) == 0 and out.read_text().splitlines(keepends=True) == written


_IDENTITY_AND_ROWS = """
import hashlib, json, sys, torch
from moe_runtime.worker.worker import device_identity
torch.set_num_threads(1)
rows = hashlib.sha256()
generator = torch.Generator().manual_seed(1)
for m, k, n in ((1, 64, 256), (7, 256, 64), (64, 1024, 96), (3, 2048, 17)):
    a, b = torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator)
    for dtype in (torch.float32, torch.bfloat16):
        rows.update((a.to(dtype) @ b.to(dtype)).float().numpy().tobytes())
print(json.dumps([device_identity(torch.device("cpu")), rows.hexdigest()[:16]]))
"""


def test_the_device_probe_tells_instruction_sets_apart():
    """The identity's probe bits under torch's AVX2 and its default kernels with MKL kept to
    AVX2 (a subprocess each: both are read at start-up) differ from this process's wherever
    products of other shapes (rows' stand-ins) differ there: a rollout file written at one
    instruction set is never taken for one of another whose bits differ. Where the BLAS runs
    the same code at each (MKL on an AMD CPU keeps to AVX2 whatever it is told), the bits and
    so the probes agree, and nothing is there to tell apart."""
    runs = {}
    for isa in (None, "avx2", "default"):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if isa is not None:
            env |= {"ATEN_CPU_CAPABILITY": isa, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
        done = subprocess.run(
            [sys.executable, "-c", _IDENTITY_AND_ROWS],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        identity, rows = json.loads(done.stdout)
        runs.setdefault(identity["cpu_capability"], (identity["matmul_probe"], rows))
    pairs = [(a, b) for a in runs for b in runs if a < b and runs[a][1] != runs[b][1]]
    if not pairs:
        pytest.skip(f"the products' bits are the same at {list(runs)}: nothing to tell apart")
    for a, b in pairs:  # products that differ: the probes must too
        assert runs[a][0] != runs[b][0], (a, b, runs)


@pytest.mark.parametrize(
    "content",
    [
        b'{"id":"z","sample_idx":0,"data":"keep"}\n{"id":"y","sample_idx":0,"data":"me"}',
        b'{"name": "my notes"}',  # one line, no newline
    ],
)
def test_a_file_this_tool_did_not_write_is_left_as_it_is(tmp_path, capsys, content):
    """Its unterminated last line was cut (or the file erased) before the run was refused."""
    source, out = write_jsonl(tmp_path / "in.jsonl", ROWS[:1]), tmp_path / "notes.json"
    out.write_bytes(content)
    assert run("--input", source, "--output", out, *ARGS) == 2
    err = capsys.readouterr().err
    assert f"{out} is not empty but has no settings record" in err, err
    assert out.read_bytes() == content and not settings_path(out).exists()


def test_a_torn_line_is_kept_when_the_resume_is_refused(tmp_path, capsys):
    source, out, lines = partial_run(tmp_path, 4)
    out.write_text("".join(lines[:4]) + lines[4][:30])
    before = out.read_bytes()
    assert run("--input", source, "--output", out, *ARGS[:-1], "6") == 2
    assert "was written with base_seed=5" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert run("--input", source, "--output", out, *ARGS) == 0  # verified: cut and resumed
    assert out.read_text().splitlines(keepends=True) == lines


def test_output_that_is_the_input_is_refused(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    before = source.read_bytes()
    link = tmp_path / "link.jsonl"
    link.symlink_to(source)
    for output in (source, link):
        assert run("--input", source, "--output", output, *ARGS) == 2
        err = capsys.readouterr().err
        assert f"--output {output} is the same file as --input {source}" in err, err
    assert source.read_bytes() == before and not settings_path(source).exists()


@pytest.mark.parametrize(
    ("flag", "error"),
    [
        (["--base-seed", "-1"], "--base-seed must be an int in [0, 2**63 - 1], got -1"),
        (["--n", "0"], "--n must be an int >= 1, got 0"),
        (["--batch-size", "0"], "--batch-size must be an int >= 1, got 0"),
        (["--max-tokens", "0"], "--max-tokens must be an int >= 1, got 0"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
        (["--top-k", "-2"], "--top-k must be -1 or 0 (off) or an int >= 1, got -2"),
        (["--logprobs", "-2"], "--logprobs must be an int >= 0, got -2"),
    ],
)
def test_a_bad_flag_is_refused_before_any_row_is_read(tmp_path, capsys, monkeypatch, flag, error):
    """It was blamed on each row in turn, and with skip every row was dropped and the run
    passed."""
    monkeypatch.setattr(rollout, "LLM", None)  # loading the model would fail the test
    source, out = write_jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out.jsonl"
    assert run("--input", source, "--output", out, "--on-bad-row", "skip", *flag) == 2
    err = capsys.readouterr().err
    assert f"error: {error}" in err and "skipped" not in err, err
    assert not out.exists() and not settings_path(out).exists()


@pytest.mark.parametrize(
    ("flag", "error"),
    [
        (["--logprobs", "9999"], "--logprobs 9999 asks for more top logprobs than the vocab"),
        (["--logprobs", "21"], "--logprobs 21 is more than server.max_logprobs=20"),
        (["--max-tokens", "1024"], "--max-tokens 1024 leaves no room for a prompt in sched"),
    ],
)
def test_a_flag_past_the_models_bounds_is_refused_once_it_loads(tmp_path, capsys, flag, error):
    source, out = write_jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out.jsonl"
    assert run("--input", source, "--output", out, "--on-bad-row", "skip", *flag) == 2
    err = capsys.readouterr().err
    assert f"error: {error}" in err and "skipped" not in err, err
    assert not out.exists() and not settings_path(out).exists()


def test_an_output_through_a_link_shares_the_lock_and_the_record(tmp_path, capsys):
    """Lock and record were named after the spelling: a run on the link and one on the file
    each wrote every row."""
    source = write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    real, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    link.symlink_to(real)
    with lock_output(real):  # flock: a second open file of it is refused, in this process too
        assert run("--input", source, "--output", link, *ARGS) == 2
    err = capsys.readouterr().err
    assert f"another rollout (pid {os.getpid()}) is writing {real}" in err, err
    assert run("--input", source, "--output", link, *ARGS) == 0
    assert settings_path(real).exists() and not settings_path(link).exists()
    assert run("--input", source, "--output", real, *ARGS) == 0  # resumed: nothing left to do
    assert len(read_jsonl(real)) == ROWS[0]["n"]


def test_missing_output_directory_is_named(tmp_path, capsys):
    source, out = write_jsonl(tmp_path / "in.jsonl", ROWS[:1]), tmp_path / "nowhere" / "o.jsonl"
    assert run("--input", source, "--output", out, *ARGS) == 2
    err = capsys.readouterr().err
    assert f"error: --output {out}: its directory {out.parent} does not exist" in err, err


def test_an_output_that_is_not_a_regular_file_is_refused(tmp_path, capsys):
    """A pipe hung the run (the resume check read it for rows without end), /dev/null ran the
    whole first batch and then failed fsyncing it with a traceback: refused before anything."""
    source, fifo = write_jsonl(tmp_path / "in.jsonl", ROWS[:1]), tmp_path / "fifo"
    os.mkfifo(fifo)
    assert run("--input", source, "--output", fifo, *ARGS) == 2
    err = capsys.readouterr().err
    assert f"error: --output {fifo} is not a regular file (a device or a pipe)" in err, err
    assert not settings_path(fifo).exists() and not fifo.with_name("fifo.lock").exists()


def test_a_failed_append_is_named_and_a_rerun_resumes(rollout_rows, tmp_path, capsys, monkeypatch):
    """A full disk at the second batch: a traceback before (and no word of what was kept); now
    exit 1 naming the output and the error, the first batch kept, and a rerun completes the file
    as an uninterrupted run writes it."""
    num_appends = []

    def full_disk(path: Path, rows: list[dict]) -> list[str]:
        num_appends.append(len(rows))
        if len(num_appends) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return append_rows(path, rows)

    monkeypatch.setattr(rollout_io, "append_rows", full_disk)
    source, out = write_jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out.jsonl"
    assert run("--input", source, "--output", out, *ARGS) == 1
    err = capsys.readouterr().err
    assert (
        f"error: cannot append to {out.resolve()}: [Errno 28] No space left on device; the 3 "
        "rows written this run are kept: rerun the same command to resume"
    ) in err, err
    assert "Traceback" not in err and len(read_jsonl(out)) == 3
    monkeypatch.undo()
    assert run("--input", source, "--output", out, *ARGS) == 0
    assert read_jsonl(out) == rollout_rows[1]


def _rank_dies_in_batch(monkeypatch, batch_no: int, num_tries: int = 1) -> list[int]:
    """The first step of the batch_no-th batch (1-based) fails as a dead rank's does, in its
    first num_tries tries (the rebuilt executor has its own execute: it does not fail); -> the
    batch runs started so far."""
    from moe_runtime.executor import WorkerError

    started, run_batch = [], rollout.rollout_batch

    def dying_batch(llm, batch, *args, **kwargs):
        started.append(len(batch))
        if batch_no <= len(started) < batch_no + num_tries:

            def dead(per_rank_inputs):
                raise WorkerError("rank 0 died during step 9: injected")

            llm.engine.executor.execute = dead
        return run_batch(llm, batch, *args, **kwargs)

    monkeypatch.setattr(rollout, "rollout_batch", dying_batch)
    return started


def test_a_rank_that_dies_mid_run_is_rebuilt_and_its_batch_run_again(
    rollout_rows, tmp_path, capsys, monkeypatch
):
    """A rank dying in the second batch ended the run with the engine's traceback, though the
    server rebuilds its workers for such a fault by itself. Now the workers are rebuilt
    (parallel.max_restarts) and the batch run again, with one line: the file is bitwise an
    uninterrupted run's, nothing lost or written twice."""
    started = _rank_dies_in_batch(monkeypatch, 2)
    source, out = write_jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out.jsonl"
    assert run("--input", source, "--output", out, *ARGS) == 0
    err = capsys.readouterr().err
    assert (
        "rollout: rank 0 died during step 9: injected; rebuilding the workers (restart 1) and "
        "running the batch again"
    ) in err, err
    assert "Traceback" not in err and started == [3, 3, 3, 2]
    assert read_jsonl(out) == rollout_rows[1]


def test_a_rank_that_dies_with_no_restart_left_ends_the_run_with_one_line(
    rollout_rows, tmp_path, capsys, monkeypatch
):
    """parallel.max_restarts=0: the death ends the run with exit 1 and one line naming it (a
    traceback before), the batches before it kept; a rerun completes the file as an
    uninterrupted run writes it."""
    _rank_dies_in_batch(monkeypatch, 2)
    source, out = write_jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out.jsonl"
    no_restart = ("--set", "parallel.max_restarts=0")
    assert run("--input", source, "--output", out, *ARGS, *no_restart) == 1
    err = capsys.readouterr().err
    assert (
        "error: gave up after parallel.max_restarts=0 restarts within "
        "parallel.restart_window_s=3600s: rank 0 died during step 9: injected; the 3 rows "
        "written this run are kept: rerun the same command to resume"
    ) in err, err
    assert "Traceback" not in err and len(read_jsonl(out)) == 3
    monkeypatch.undo()
    assert run("--input", source, "--output", out, *ARGS, *no_restart) == 0
    assert read_jsonl(out) == rollout_rows[1]


def test_a_batch_that_fails_on_every_rebuilt_group_ends_the_run(tmp_path, capsys, monkeypatch):
    """A batch that fails on each new group too (a rank failing on the batch's own inputs) was
    rebuilt and rerun for as long as the restart window let rebuilds fall out of it (forever
    with a short window); now parallel.max_restarts failures in a row end the run."""
    started = _rank_dies_in_batch(monkeypatch, 2, num_tries=5)
    source, out = write_jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out.jsonl"
    window = ("--set", "parallel.restart_window_s=0.001")  # no rebuild stays in it
    assert run("--input", source, "--output", out, *ARGS, *window) == 1
    err = capsys.readouterr().err
    assert (
        "error: gave up after 4 failures in a row of one batch: rank 0 died during step 9: "
        "injected; the 3 rows written this run are kept"
    ) in err, err
    assert started == [3, 3, 3, 3, 3] and len(read_jsonl(out)) == 3


def test_a_rank_that_fails_while_the_model_loads_ends_the_run_with_one_line(
    tmp_path, capsys, monkeypatch
):
    """A rank dying while the ranks load (before any row): a traceback before; now one line
    and exit 1, no output written."""
    from moe_runtime.executor import WorkerError

    def dying_load(config):
        raise WorkerError("rank 1 died during init: injected")

    monkeypatch.setattr(rollout, "LLM", dying_load)
    source, out = write_jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out.jsonl"
    assert run("--input", source, "--output", out, *ARGS) == 1
    err = capsys.readouterr().err
    assert "error: the model failed to load: rank 1 died during init: injected\n" in err, err
    assert "Traceback" not in err and not out.exists()


def test_read_done_streams_and_decodes_only_the_keys(tmp_path, monkeypatch):
    """It read the whole file and decoded every row whole: 21 s and 600 MB for 121 MB of
    rows. Now one line at a time, the keys alone where the row is laid out as append_rows
    writes it; other layouts decoded whole, a torn last line found to the byte."""
    import tracemalloc

    out = tmp_path / "out.jsonl"
    bulk = {"token_ids": list(range(500)), "routed_experts": [[[1, 2, 3, 4, 5, 6]] * 26] * 500}
    append_rows(out, [{"id": f"r{i}", "sample_idx": i % 3, **bulk} for i in range(40)])
    with open(out, "a") as f:
        f.write(json.dumps({"sample_idx": 7, "id": 5}) + "\n")  # another layout
        f.write('{"id":"torn","sample_idx":0,"token_ids":[1,')
    size = out.stat().st_size
    assert size > 5_000_000
    tracemalloc.start()
    rows = read_done(out)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 2_000_000, f"read_done held {peak} bytes at once for a {size} byte file"
    expected = {(json.dumps(f"r{i}"), i % 3) for i in range(40)} | {("5", 7)}
    assert rows.done == expected
    assert rows.num_bytes == size and rows.num_whole_bytes == out.read_bytes().rindex(b"\n") + 1


def test_a_line_that_is_not_utf8_is_a_bad_row_and_a_bom_is_read(tmp_path, capsys):
    """The whole file was decoded at once: an error with no file or line, which skip could
    not skip; and a file opening with a BOM failed on its first row."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = json.dumps({"id": 1, "prompt": "ok"}).encode()
    bad = json.dumps({"id": 2, "prompt": "caf"}).encode().replace(b'caf"', b'caf\xff"')
    last = json.dumps({"id": "after", "prompt": [3, 4]}).encode()
    source.write_bytes(b"\xef\xbb\xbf" + good + b"\r\n" + bad + b"\r\n\r\n" + last + b"\r\n")
    args = ["--input", source, "--output", out, "--max-tokens", "2"]
    assert run(*args) == 2
    err = capsys.readouterr().err
    assert f"error: {source}:2: not UTF-8 text (byte 0xff)" in err, err
    assert run(*args, "--on-bad-row", "skip") == 0
    assert f"skipped {source}:2: not UTF-8 text" in capsys.readouterr().err
    assert [r["id"] for r in read_jsonl(out)] == [1, "after"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_ends_with_one_line_and_a_rerun_resumes(tmp_path, signum):
    """Ctrl-C ended in a KeyboardInterrupt traceback (and SIGTERM said nothing)."""
    rows = [{"id": i, "prompt": [i + 1, 7, 9], "n": 2, "max_tokens": 16} for i in range(20)]
    source, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    args = ["--input", source, "--output", out, "--batch-size", "2"]
    cmd = [sys.executable, "launch/rollout.py", "--config", str(TINY_CONFIG), "--no-progress"]
    proc = subprocess.Popen([*cmd, *map(str, args)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.stat().st_size > 0):
            assert proc.poll() is None and time.monotonic() < deadline, "no batch was written"
            time.sleep(0.005)
        proc.send_signal(signum)
        err = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err
    num_written = len(read_jsonl(out))
    assert 0 < num_written < 40 and out.read_bytes().endswith(b"\n")
    last = err.strip().splitlines()[-1]
    assert last == (
        f"rollout: stopped by {signum.name} after writing {num_written} rows to {out} this "
        "run; rerun the same command to resume"
    ), err
    assert "Traceback" not in err
    assert run(*args) == 0
    keys = [(r["id"], r["sample_idx"]) for r in read_jsonl(out)]
    assert len(keys) == len(set(keys)) == 40


def test_sigterm_while_the_ranks_load_ends_the_run_as_after_it(ray_head, tmp_path):
    """World size 2 on Ray: ray.init sets a SIGTERM handler of its own (sys.exit(15)); a
    SIGTERM while the ranks load ended the run with exit code 15 and no word of the output."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "prompt": [1, 2, 3]}])
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "launch/rollout.py", "--config", str(TINY_CONFIG), "--no-progress"]
    cmd += ["--input", str(source), "--output", str(out), "--set", "parallel.world_size=2"]
    env = {**ray_head.env, "RAY_ADDRESS": ray_head.gcs_address}  # the private head, no other
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        # Said once Ray is joined and the run's handler is back (waiting for Ray's own
        # "Connected" line raced ray.init's end on a loaded machine: exit code 15).
        for line in proc.stderr:
            if line.startswith("rollout: loading the model on 2 rank(s)"):
                break
        time.sleep(1.0)  # into the ranks' start-up
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    # (the ranks' own records, which Ray forwards whenever they come, may follow it)
    last = [line for line in err.strip().splitlines() if "(Worker pid=" not in line][-1]
    assert last.startswith("rollout: stopped by SIGTERM after writing 0 rows"), err


def test_a_run_at_world_size_2_resumes_at_world_size_1(ray_head, tmp_path):
    """The record names each kind of device once, however many ranks ran (two Ray ranks of one
    machine, then one rank in-process), so a resume at another EP degree, which changes no bit,
    is accepted and writes the rows the first run wrote."""
    source = write_jsonl(tmp_path / "in.jsonl", ROWS[:3])
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "launch/rollout.py", "--config", str(TINY_CONFIG), "--no-progress"]
    cmd += ["--input", str(source), "--output", str(out), *ARGS, "--set", "parallel.world_size=2"]
    env = {**ray_head.env, "RAY_ADDRESS": ray_head.gcs_address}  # the private head, no other
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (device,) = json.loads(settings_path(out).read_text())["runtime.devices"]
    assert device["device"] == "cpu"
    written = out.read_text().splitlines(keepends=True)
    assert len(written) > 1
    out.write_text(written[0])
    assert run("--input", source, "--output", out, *ARGS) == 0
    assert out.read_text().splitlines(keepends=True) == written


def test_a_stop_signal_during_score_is_acted_on_between_steps():
    """--score asked once, before its batch, and then scored the whole batch (a batch of long
    rows: 34 s past Ctrl-C, and the rows written). Now it asks between two steps, as a
    rollout batch does, and the batch is dropped."""
    from tqdm import tqdm

    from launch.rollout_io import Sample, Stopped

    llm = LLM(TINY_CONFIG, **{"scheduler.max_num_batched_tokens": 64})  # a few steps a batch
    try:
        batch = [Sample(i, 0, [i + 1] * 100, None, i + 1, token_ids=[5] * 100) for i in range(4)]
        asked = []

        def stop():
            asked.append(llm.engine.has_unfinished())
            if len(asked) == 3:
                raise Stopped(signal.SIGINT)

        with pytest.raises(Stopped), tqdm(disable=True) as progress:
            rollout.score_batch(llm, batch, progress, stop, num_top=0, routed=False)
        assert asked == [True, True, True]  # asked with the batch in flight, three steps in
        # Scoring has no deltas: its rows count on the bar as they finish (it stood at 0).
        with tqdm(file=io.StringIO(), mininterval=0) as progress:
            rows = rollout.score_batch(llm, batch, progress, lambda: None, num_top=0, routed=False)
            assert progress.n == len(rows) == len(batch)
    finally:
        llm.shutdown()


def test_an_unreadable_input_is_named_by_its_flag(tmp_path, capsys):
    """A missing --input printed "error: [Errno 2] No such file or directory: '...'", naming
    neither the flag nor, for a directory, what was wrong in words."""
    out = tmp_path / "out.jsonl"
    assert run("--input", tmp_path / "absent.jsonl", "--output", out) == 2
    err = capsys.readouterr().err
    assert f"error: --input '{tmp_path / 'absent.jsonl'}': No such file or directory" in err, err
    assert run("--input", tmp_path, "--output", out) == 2
    assert f"error: --input '{tmp_path}': Is a directory" in capsys.readouterr().err
    assert not out.exists()


def test_a_cluster_that_does_not_answer_ends_the_run_with_exit_1(tmp_path, capsys, monkeypatch):
    """RAY_ADDRESS where nothing listens is a failure to load, as generate.py (exit 1) and the
    server (exit 1) have it: a ConnectionError is an OSError, and the rollout took it for a
    refused input (exit 2), which a retrying wrapper must not retry."""
    from tests.ray_head import free_port

    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")
    source, out = write_jsonl(tmp_path / "in.jsonl", ROWS[:1]), tmp_path / "out.jsonl"
    assert run("--input", source, "--output", out, "--set", "parallel.world_size=2") == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: no Ray cluster answers at 127.0.0.1:"), last
    assert not out.exists() and not settings_path(out).exists()
