"""Strict JSON from the server and the rollout job: no NaN nor Infinity, which strict parsers
refuse. A -inf logprob is written as -9999.0 (vLLM's); a NaN logits row ends its sample at once
(finish_reason "error", no NaN logprob kept: tests/test_non_finite.py), which fails its own
response, stream or rollout row, with a message saying so, and nothing else.

The NaN and -inf come from a sampler whose logits rows are poisoned by the request's seed."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from launch import rollout, strict_json
from moe_runtime.worker.sampler import Sampler
from tests.invariance import TINY_CONFIG
from tests.serving import running_server

NEG_INF_SEED, NAN_SEED, CLEAN_SEED = 101, 202, 303
NAN_WORDS = "non-finite logits (NaN)"  # CompletionOutput.error of a NaN logits row


def strict_loads(text: str):
    """json.loads refusing NaN, Infinity and -Infinity, as strict parsers do."""

    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def poisoned(monkeypatch):
    """The sampler's logits: ids from 3 on at -inf in a row of seed NEG_INF_SEED (raw logprobs
    of -inf among its tops), the whole row NaN for NAN_SEED."""
    launch = Sampler.launch

    def poisoned_launch(self, logits, params, seeds, output_positions):
        logits = logits.clone()
        for row, seed in enumerate(seeds):
            if seed == NEG_INF_SEED:
                logits[row, 3:] = -math.inf
            elif seed == NAN_SEED:
                logits[row] = math.nan
        return launch(self, logits, params, seeds, output_positions)

    monkeypatch.setattr(Sampler, "launch", poisoned_launch)


def test_dumps_writes_minus_inf_as_the_floor_and_refuses_nan():
    body = {"a": [-math.inf, np.float64(-np.inf), 0.1, -2.5], "b": {"c": (1, -math.inf)}}
    assert strict_loads(strict_json.dumps(body)) == {
        "a": [-9999.0, -9999.0, 0.1, -2.5],
        "b": {"c": [1, -9999.0]},
    }
    assert strict_json.dumps({"x": 0.1}) == json.dumps({"x": 0.1})  # finite: as json writes
    for bad in (math.nan, math.inf, np.float64(np.nan)):
        with pytest.raises(strict_json.NonFiniteError, match="NaN logprob"):
            strict_json.dumps({"logprobs": [0.0, bad]})


def _completion(seed: int, **fields) -> dict:
    body = {"prompt": "abc", "max_tokens": 3, "temperature": 0.0, "logprobs": 5, "seed": seed}
    return {**body, **fields}


def test_server_writes_minus_inf_as_the_floor(poisoned):
    """-Infinity was written into bodies (status 200): a strict client refused the response.
    Now -inf is -9999.0. (A NaN request is a 500 naming it, whole or streamed, while those
    beside it are answered as alone: tests/test_non_finite.py.)"""
    with running_server() as server:
        http = server.http
        response = http.post("/v1/completions", json=_completion(NEG_INF_SEED))
        assert response.status_code == 200
        body = strict_loads(response.text)
        tops = body["choices"][0]["logprobs"]["top_logprob_ids"]
        assert all(top[str(t)] == -9999.0 for top in tops for t in range(3, 5)), tops
        chat = {
            "messages": [{"role": "user", "content": "abc"}],
            "max_tokens": 2,
            "temperature": 0.0,
            "seed": NEG_INF_SEED,
            "logprobs": True,
            "top_logprobs": 5,
        }
        response = http.post("/v1/chat/completions", json=chat)
        content = strict_loads(response.text)["choices"][0]["logprobs"]["content"]
        assert [e["logprob"] for e in content[0]["top_logprobs"]][3:] == [-9999.0, -9999.0]

        assert http.get("/health").status_code == 200  # the engine serves on


def test_rollout_writes_minus_inf_as_the_floor_and_leaves_a_nan_row_out(poisoned, tmp_path, capsys):
    """The rollout's rows were json.dumps' (-Infinity, NaN): a strict reader refused the
    line. Now -inf is -9999.0; a NaN row is left out, named, the others written, exit 1."""
    rows = [
        {"id": "inf", "prompt": [5, 6, 7], "seed": NEG_INF_SEED, "logprobs": 5},
        {"id": "nan", "prompt": [5, 6, 7], "seed": NAN_SEED, "logprobs": 5},
        {"id": "clean", "prompt": [5, 6, 7], "seed": CLEAN_SEED, "logprobs": 5},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "out.jsonl"
    argv = ["--config", str(TINY_CONFIG), "--no-progress", "--input", str(source)]
    code = rollout.main([*argv, "--output", str(output), "--max-tokens", "3"])
    err = capsys.readouterr().err
    assert code == 1, err
    written = [strict_loads(line) for line in output.read_text().splitlines()]
    assert [row["id"] for row in written] == ["inf", "clean"]
    assert any(lp == -9999.0 for top in written[0]["top_logprobs"] for lp in top.values())
    assert "row 'nan' sample 0 not written" in err and NAN_WORDS in err, err


def test_generate_prints_strict_json_and_names_a_nan_prompt(poisoned, capsys):
    """launch/generate.py printed json.dumps' lines (-Infinity, NaN). Now a -inf logprob is
    -9999.0; a prompt whose output holds a NaN is named on stderr, not printed, exit 1."""
    from launch import generate

    argv = ["--config", str(TINY_CONFIG), "--max-tokens", "3", "--logprobs", "5"]
    assert generate.main([*argv, "--prompt", "ab", "--seed", str(NEG_INF_SEED)]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    row = strict_loads(line)
    assert any(lp == -9999.0 for top in row["top_logprobs"] for lp in top.values())
    code = generate.main([*argv, "--prompt", "ab", "--prompt", "cd", "--seed", str(NAN_SEED)])
    captured = capsys.readouterr()
    assert code == 1 and captured.out == "", captured.out
    for index in (0, 1):
        assert f"error: prompt {index} not printed" in captured.err, captured.err
    assert NAN_WORDS in captured.err
