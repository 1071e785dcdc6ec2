"""A sample whose logits turn non-finite (NaN: a bad weight update, say) ends at that step with
finish_reason "error" and the tokens before it, its KV blocks freed; the rest of its batch runs
on, bit for bit as alone. Every surface refuses it by name: the server (a 500, or a stream's
error event then [DONE]), the rollout job and generate.py (the row left out, exit 1).

The NaN comes from a sampler whose logits rows are poisoned by the request's seed from output
position NAN_FROM on: what log_softmax makes of a NaN logits row, a NaN chosen logprob."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from launch import generate, rollout
from moe_runtime import LLM, SamplingParams
from moe_runtime.seeds import derive_seed
from moe_runtime.worker.model_runner import ModelRunner
from moe_runtime.worker.sampler import Sampler
from tests.invariance import TINY_CONFIG, fingerprint, record_steps
from tests.serving import running_server, sse_events

NAN_SEED, CLEAN_SEED = 202, 303
NAN_FROM = 3  # the first output position whose logits are NaN
FIRST_NAN_SEED = 404  # NaN from output position 0: the first token fails
PAIR_SEED = 505  # with n = 2: sample 1's seed is poisoned from NAN_FROM, sample 0's is not
MAX_TOKENS = 8
PROMPT, OTHER = [72, 101, 108, 108, 111], [5, 6, 7, 8, 9, 10]
WORDS = "non-finite logits (NaN)"
# Scorings (prompt_len 1): NAN_SCORED's logits NaN from scored token NAN_SCORED_FROM on.
SCORED, NAN_SCORED = [11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26]
NAN_SCORED_FROM = 2


@pytest.fixture
def poisoned(monkeypatch):
    """The sampler's logits rows of seed NAN_SEED (and of PAIR_SEED's sample 1) all NaN from
    output position NAN_FROM on, of FIRST_NAN_SEED from position 0."""
    launch = Sampler.launch
    nan_from = {NAN_SEED: NAN_FROM, FIRST_NAN_SEED: 0, derive_seed(PAIR_SEED, 1): NAN_FROM}

    def poisoned_launch(self, logits, params, seeds, output_positions):
        logits = logits.clone()
        for row, (seed, position) in enumerate(zip(seeds, output_positions, strict=True)):
            if seed in nan_from and position >= nan_from[seed]:
                logits[row] = math.nan
        return launch(self, logits, params, seeds, output_positions)

    monkeypatch.setattr(Sampler, "launch", poisoned_launch)


@pytest.fixture
def poisoned_scoring(monkeypatch):
    """The scored logits rows of a sequence that starts with NAN_SCORED all NaN from scored
    token NAN_SCORED_FROM on (with prompt_len 1 the row at position p scores token p + 1,
    the p-th scored)."""
    score = ModelRunner._score

    def poisoned_score(self, logits, score_rows, row_owners, out):
        def is_poisoned(row: int) -> bool:
            chunk, position = row_owners[row]
            is_marked = list(chunk.seq.token_ids[: len(NAN_SCORED)]) == NAN_SCORED
            return is_marked and position >= NAN_SCORED_FROM

        rows = [row for row in score_rows if is_poisoned(row)]
        if rows:
            logits = logits.clone()
            logits[rows] = math.nan
        return score(self, logits, score_rows, row_owners, out)

    monkeypatch.setattr(ModelRunner, "_score", poisoned_score)


@pytest.fixture
def llm():
    llm = LLM(TINY_CONFIG)
    yield llm
    llm.shutdown()


def _params(seed: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.8, seed=seed, logprobs=5, ignore_eos=True
    )


def test_nan_logits_end_the_sample_at_that_step_and_free_its_blocks(poisoned, llm):
    """It ran on to max_tokens with NaN logprobs ("length"), every step spent on it."""
    before = SamplingParams(max_tokens=NAN_FROM, temperature=0.8, seed=NAN_SEED, logprobs=5)
    clean = llm.generate([PROMPT], before)[0]  # its tokens before the NaN
    engine = llm.engine
    steps = record_steps(llm)
    bad, other = engine.add_requests([PROMPT, OTHER], [_params(NAN_SEED), _params(CLEAN_SEED)])
    (bad_seq,), (other_seq,) = bad.samples, other.samples
    deltas, blocks = [], engine.block_managers[0]
    while not bad_seq.is_finished:
        deltas += [d for d in engine.step() if d.request_id == bad.request_id]
    # The step that sampled position NAN_FROM ended it: its blocks are free (the neighbour's
    # alone are held), nothing else of it is scheduled after.
    assert not other_seq.is_finished and bad_seq.block_table == []
    assert blocks.num_free_blocks == blocks.num_blocks - len(other_seq.block_table)
    while engine.has_unfinished():
        engine.step()
    ran = sum(1 for step in steps for item in step if item.seq_id == bad_seq.seq_id)
    assert ran == NAN_FROM + 1, ran  # its prefill, then a decode a token before the NaN

    out = engine.output(bad)
    assert (out.finish_reason, len(out.token_ids)) == ("error", NAN_FROM)
    assert WORDS in out.error and f"output token {NAN_FROM}" in out.error, out.error
    assert all(math.isfinite(lp) for lp in out.logprobs)
    assert fingerprint(out) == fingerprint(clean)
    # Its last delta reports the end alone: no token, no text, finish_reason "error".
    last = deltas[-1].outputs[0]
    assert deltas[-1].is_finished and last.token_ids == [] and last.finish_reason == "error"
    assert [d.outputs[0].finish_reason for d in deltas[:-1]] == [None] * NAN_FROM
    assert blocks.num_free_blocks == blocks.num_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_a_nan_neighbour_changes_no_bit_of_a_request(poisoned, overlap):
    """The requests beside a NaN one finish normally with the bits they have alone, with a
    decode launched ahead too (it held the NaN sample, ended on the driver: dropped)."""
    llm = LLM(TINY_CONFIG, **{"scheduler.overlap_decode": overlap})
    try:
        _check_neighbours(llm)
        stats = llm.engine.worker_stats()[0]
        assert (stats["num_lookahead_hits"] > 0) is overlap, stats
        assert (stats["num_lookahead_misses"] > 0) is overlap, stats
    finally:
        llm.shutdown()


def _check_neighbours(llm: LLM) -> None:
    prompts = [OTHER, PROMPT, [9, 8, 7]]
    params = [_params(CLEAN_SEED), _params(NAN_SEED), _params(CLEAN_SEED + 1)]
    alone = [llm.generate([p], [s])[0] for p, s in zip(prompts, params, strict=True)]
    together = llm.generate(prompts, params)
    assert [o.finish_reason for o in together] == ["length", "error", "length"]
    for i in (0, 2):
        assert len(together[i].token_ids) == MAX_TOKENS
        assert fingerprint(together[i]) == fingerprint(alone[i])
    assert together[1].token_ids == alone[1].token_ids  # (the NaN one ends where alone)


def _completion(seed: int, **fields) -> dict:
    body = {"prompt": "abc", "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": seed}
    return {**body, **fields}


def test_server_fails_a_nan_request_alone(poisoned):
    """Without logprobs asked the NaN never reached the body: a 200 with garbage tokens. Now
    the request is a 500 naming the non-finite logits (streamed: an error event, then [DONE]),
    its neighbours are answered as alone, and the engine serves on."""
    with running_server() as server:
        http = server.http
        alone = http.post("/v1/completions", json=_completion(CLEAN_SEED)).json()
        with ThreadPoolExecutor(4) as pool:
            nan_future = pool.submit(http.post, "/v1/completions", json=_completion(NAN_SEED))
            clean = [
                pool.submit(http.post, "/v1/completions", json=_completion(CLEAN_SEED))
                for _ in range(3)
            ]
            failed = nan_future.result()
            answers = [f.result() for f in clean]
        assert failed.status_code == 500, failed.text
        error = failed.json()["error"]
        assert WORDS in error["message"] and error["type"] == "internal_error", error
        assert "prompt 0" in error["message"], error
        for answer in answers:
            assert answer.status_code == 200
            assert answer.json()["choices"] == alone["choices"]

        chat = {
            "messages": [{"role": "user", "content": "abc"}],
            "max_tokens": MAX_TOKENS,
            "seed": NAN_SEED,
        }
        response = http.post("/v1/chat/completions", json=chat)
        assert response.status_code == 500 and WORDS in response.text, response.text

        events = sse_events(http, "/v1/completions", _completion(NAN_SEED, stream=True))
        assert WORDS in events[-1]["error"]["message"], events
        assert all(c["finish_reason"] is None for e in events[:-1] for c in e["choices"])
        assert http.get("/health").status_code == 200  # the engine serves on


def test_a_stream_failing_at_its_first_token_is_a_500(poisoned):
    """Its first delta is awaited before the response starts: a 200 stream of one error event
    becomes a 500 body naming the logits, as unstreamed; the engine serves on."""
    with running_server() as server:
        http = server.http
        for path, body in (
            ("/v1/completions", _completion(FIRST_NAN_SEED, stream=True)),
            ("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "abc"}], "max_tokens": MAX_TOKENS,
                "seed": FIRST_NAN_SEED, "stream": True,
            }),
        ):  # fmt: skip
            response = http.post(path, json=body)
            assert response.status_code == 500, (path, response.text)
            error = response.json()["error"]
            assert WORDS in error["message"] and error["type"] == "internal_error", error
        assert http.post("/v1/completions", json=_completion(CLEAN_SEED)).status_code == 200
        assert http.get("/health").status_code == 200


def test_a_failed_sample_ends_its_streamed_siblings_as_error_not_abort(poisoned):
    """A stream of n = 2 whose sample 1 fails mid-stream: the server cancels sample 0 with
    it. Sample 0 was counted as "abort", which README keeps for a client that left; an
    unstreamed request's siblings count as "error"."""
    from tests.test_server_admin import metrics

    finished = "moe_samples_finished_total{{finish_reason={}}}".format
    body = _completion(PAIR_SEED, n=2, ignore_eos=True)
    with running_server() as server:
        for stream in (True, False):
            before = metrics(server)
            if stream:
                events = sse_events(server.http, "/v1/completions", body)
                assert WORDS in events[-1]["error"]["message"], events
            else:
                response = server.http.post("/v1/completions", json=body)
                assert response.status_code == 500, response.text
            after = metrics(server)
            delta = {r: after[finished(r)] - before[finished(r)] for r in ("abort", "error")}
            assert delta == {"abort": 0, "error": 2}, (stream, delta)


def test_rollout_and_generate_leave_a_nan_row_out(poisoned, tmp_path, capsys):
    """A sample whose logits were NaN is left out by name (it ended at that step with
    "error"), the others written, exit 1."""
    rows = [
        {"id": "nan", "prompt": PROMPT, "seed": NAN_SEED},
        {"id": "clean", "prompt": PROMPT, "seed": CLEAN_SEED},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "out.jsonl"
    argv = ["--config", str(TINY_CONFIG), "--no-progress", "--input", str(source)]
    code = rollout.main([*argv, "--output", str(output), "--max-tokens", str(MAX_TOKENS)])
    err = capsys.readouterr().err
    assert code == 1, err
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["id"] for row in written] == ["clean"]
    assert "row 'nan' sample 0 not written" in err and WORDS in err, err

    argv = ["--config", str(TINY_CONFIG), "--max-tokens", str(MAX_TOKENS)]
    code = generate.main([*argv, "--prompt", "ab", "--seed", str(NAN_SEED)])
    captured = capsys.readouterr()
    assert code == 1 and captured.out == "", captured.out
    assert "error: prompt 0 not printed" in captured.err and WORDS in captured.err


def test_a_nan_in_a_scoring_ends_it_as_error_naming_the_token(poisoned_scoring, llm):
    """score_outputs said "scored" over NaN logprobs, and only writing them as JSON refused
    them. Now the scoring ends with finish_reason "error" naming its first NaN token, every
    logprob kept (score's lists hold the NaN); its neighbour's bits are those it has alone."""
    bad, good = llm.score_outputs([NAN_SCORED, SCORED], [1, 1], use_tqdm=False)
    assert bad.finish_reason == "error", bad
    assert WORDS in bad.error and f"at scored token {NAN_SCORED_FROM}:" in bad.error, bad.error
    assert len(bad.logprobs) == len(NAN_SCORED) - 1
    assert [math.isnan(x) for x in bad.logprobs] == [i >= NAN_SCORED_FROM for i in range(5)]
    assert (good.finish_reason, good.error) == ("scored", None)
    (alone,) = llm.score_outputs([SCORED], [1], use_tqdm=False)
    assert [float.hex(x) for x in good.logprobs] == [float.hex(x) for x in alone.logprobs]
    (listed,) = llm.score([NAN_SCORED], [1], use_tqdm=False)
    assert [math.isnan(x) for x in listed] == [i >= NAN_SCORED_FROM for i in range(5)]


def test_server_fails_an_echo_whose_scoring_is_nan_with_the_engines_words(poisoned_scoring):
    """An echo's prompt scoring with NaN logits was refused only when its logprobs were
    written as JSON. Now it is a 500 naming the prompt and the scored token, counted as an
    "error", and the engine serves on."""
    from tests.test_server_admin import metrics

    finished = "moe_samples_finished_total{{finish_reason={}}}".format
    echo = {"max_tokens": 2, "echo": True, "logprobs": 1, "temperature": 0.0}
    with running_server() as server:
        before = metrics(server)
        failed = server.http.post("/v1/completions", json={**echo, "prompt": NAN_SCORED})
        assert failed.status_code == 500, failed.text
        message = failed.json()["error"]["message"]
        assert f"prompt 0: {WORDS} at scored token {NAN_SCORED_FROM}:" in message, message
        after = metrics(server)
        assert after[finished("error")] - before[finished("error")] == 1
        assert after[finished("abort")] == before[finished("abort")]
        clean = server.http.post("/v1/completions", json={**echo, "prompt": SCORED})
        assert clean.status_code == 200, clean.text
        assert server.http.get("/health").status_code == 200


def test_a_score_run_leaves_a_nan_scoring_out_with_the_engines_words(
    poisoned_scoring, tmp_path, capsys
):
    """rollout --score named such a row by the JSON write's refusal ("a value of nan has no
    JSON form"); now by the scored token, as a rollout row is named; the others written."""
    rows = [
        {
            "id": "nan",
            "sample_idx": 0,
            "prompt_token_ids": NAN_SCORED[:1],
            "token_ids": NAN_SCORED[1:],
        },
        {"id": "clean", "sample_idx": 0, "prompt_token_ids": SCORED[:1], "token_ids": SCORED[1:]},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "scores.jsonl"
    argv = ["--config", str(TINY_CONFIG), "--no-progress", "--input", str(source), "--score"]
    code = rollout.main([*argv, "--output", str(output)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert [json.loads(line)["id"] for line in output.read_text().splitlines()] == ["clean"]
    named = f"row 'nan' sample 0 not written: {WORDS} at scored token {NAN_SCORED_FROM}:"
    assert named in err, err
