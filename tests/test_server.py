"""The HTTP server: OpenAI client compatibility, online batch invariance, bad requests, shutdown.

One in-process server (uvicorn in a thread, tiny CPU config, one rank) serves most tests;
`serve_ep.py` itself runs once as a subprocess for start-up, a request and a draining SIGTERM.
Results are compared bit for bit (float.hex) with each other and with `LLM.generate`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from launch.completions import _Answered
from launch.generation import Backend, Generation
from launch.metrics import ServerMetrics
from launch.server_app import create_app
from moe_runtime import LLM, SamplingParams
from moe_runtime.config import load_config
from moe_runtime.engine import LLMEngine
from moe_runtime.engine.async_engine import AsyncEngine, EngineUnavailableError
from moe_runtime.engine.outputs import RequestOutput
from moe_runtime.engine.request import Request
from moe_runtime.engine.scheduler import Scheduler
from moe_runtime.executor import WorkerError
from moe_runtime.tokenizer import ByteTokenizer
from tests.invariance import TINY_CONFIG, fingerprint, mixed_prompts
from tests.serving import ServeEp, num_running, running_server, sse_events

ROOT = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 1024  # scheduler.max_model_len of the tiny config
TARGETS = [
    {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0.0},
    {
        "prompt": [5, 17, 99, 200, 3, 42, 7],
        "max_tokens": 12,
        "temperature": 0.9,
        "top_k": 50,
        "top_p": 0.95,
        "seed": 123,
    },
]
for _target in TARGETS:
    _target.update(logprobs=5, ignore_eos=True)


@pytest.fixture(scope="module")
def server():
    with running_server() as running:
        yield running


@pytest.fixture(scope="module")
def reference():
    """{target index: fingerprint} from LLM.generate in this process, one request at a time."""
    llm = LLM(TINY_CONFIG)
    keys = ("max_tokens", "temperature", "top_k", "top_p", "seed", "logprobs", "ignore_eos")
    result = {
        i: fingerprint(
            llm.generate([t["prompt"]], SamplingParams(**{k: t[k] for k in keys if k in t}))[0]
        )
        for i, t in enumerate(TARGETS)
    }
    llm.shutdown()
    return result


def http_fingerprint(choice: dict) -> tuple:
    """The same exact fingerprint as tests.invariance.fingerprint, from a JSON choice."""
    logprobs = choice["logprobs"]
    return (
        tuple(choice["token_ids"]),
        tuple(float.hex(x) for x in logprobs["token_logprobs"]),
        tuple(
            tuple((int(t), float.hex(lp)) for t, lp in top.items())
            for top in logprobs["top_logprob_ids"]
        ),
    )


def post(http: httpx.Client, body: dict | str) -> httpx.Response:
    if isinstance(body, str):
        headers = {"content-type": "application/json"}
        return http.post("/v1/completions", content=body, headers=headers)
    return http.post("/v1/completions", json=body)


def test_openai_client_text_and_token_prompts(server, reference):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    for i, target in enumerate(TARGETS):
        extra = {"top_k": target["top_k"]} if "top_k" in target else {}
        extra["ignore_eos"] = True
        out = client.completions.create(
            model=server.model,
            prompt=target["prompt"],
            max_tokens=target["max_tokens"],
            temperature=target["temperature"],
            top_p=target.get("top_p", 1.0),
            seed=target.get("seed"),
            logprobs=5,
            extra_body=extra,
        )
        choice = out.choices[0]
        assert out.object == "text_completion" and out.model == server.model
        assert choice.finish_reason == "length"
        assert len(choice.logprobs.token_logprobs) == target["max_tokens"]
        assert all(len(top) <= 5 for top in choice.logprobs.top_logprobs)
        assert out.usage.completion_tokens == target["max_tokens"]
        assert http_fingerprint(choice.model_dump()) == reference[i]
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.completions.create(model=server.model, prompt="a", frequency_penalty=0.5)


def test_health_and_models(server):
    health = server.http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert server.http.head("/health").status_code == 200  # probes that send HEAD (was 405)
    models = server.http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [server.model]


def _background_requests(num: int) -> list[dict]:
    prompts = mixed_prompts(num, 3, 60, seed=11)
    return [
        {
            "prompt": p if i % 3 else "".join(chr(97 + t % 26) for t in p),
            "max_tokens": 4 + i % 13,
            "temperature": 0.0 if i % 2 else 0.7,
            "seed": i,
            "n": 2 if i % 5 == 0 else 1,
            "logprobs": i % 6,
            "ignore_eos": True,
        }
        for i, p in enumerate(prompts)
    ]


def alone_and_together(server) -> tuple[list[tuple], list[tuple]]:
    """Target fingerprints served alone, then among 34 other concurrent clients (36 threads)."""
    alone = [http_fingerprint(post(server.http, t).json()["choices"][0]) for t in TARGETS]
    background = _background_requests(34)
    bodies = [*background[:17], TARGETS[0], *background[17:], TARGETS[1]]
    steps_before = server.async_engine.stats().num_steps
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        responses = list(pool.map(lambda b: post(server.http, b), bodies))
    num_steps = server.async_engine.stats().num_steps - steps_before
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    for body, response in zip(bodies, responses, strict=True):
        assert len(response.json()["choices"]) == body.get("n", 1)
    # Served one at a time, these requests would need one step per generated token.
    serial_steps = sum(b["max_tokens"] for b in bodies)
    assert num_steps < serial_steps / 2, f"{num_steps} steps: requests were not batched"
    together = [http_fingerprint(responses[i].json()["choices"][0]) for i in (17, -1)]
    return alone, together


def test_online_batch_invariance(server, reference):
    alone, together = alone_and_together(server)
    assert alone == [reference[i] for i in range(len(TARGETS))]
    assert together == alone


def test_online_batch_invariance_negative_control():
    with running_server({"kernels.mode": "fast"}) as fast_server:
        alone, together = alone_and_together(fast_server)
    assert together != alone, "fast mode matched too: the comparison cannot fail"


def test_floats_round_trip_exactly_through_json(server, reference):
    raw = post(server.http, TARGETS[1]).text
    choice = json.loads(raw)["choices"][0]
    assert http_fingerprint(choice) == reference[1]
    for value in choice["logprobs"]["token_logprobs"]:
        assert json.loads(json.dumps(value)).hex() == value.hex()


BAD_REQUESTS = [
    ('{"prompt": "a",', "malformed JSON"),
    ({"prompt": "a", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "stop": ["x"] * 33}, "at most 32 strings, got 33"),
    ({"prompt": "a", "stop": "x" * 1025}, "at most 1024 characters, got one of 1025"),
    ({"prompt": [1, 2, 600]}, "token id 600 is outside the vocabulary"),
    ({"prompt": [[1, 2], [3, 9999]]}, "prompt 1: token id 9999"),
    ({"prompt": [7] * (MAX_MODEL_LEN + 1)}, f"more than scheduler.max_model_len={MAX_MODEL_LEN}"),
    ({"prompt": []}, "prompt"),
]


def test_bad_requests_are_400s_while_good_ones_succeed(server):
    good = _background_requests(12)
    bodies = [*good, *(b for b, _ in BAD_REQUESTS)]
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        responses = list(pool.map(lambda b: post(server.http, b), bodies))
    assert [r.status_code for r in responses[: len(good)]] == [200] * len(good)
    for (body, problem), response in zip(BAD_REQUESTS, responses[len(good) :], strict=True):
        assert response.status_code == 400, (body, response.text)
        assert problem in response.json()["error"]["message"], (body, response.text)
    wrong_model = post(server.http, {"model": "other", "prompt": "a"})
    assert wrong_model.status_code == 404
    assert server.http.get("/health").status_code == 200


def test_stop_string_and_echo(server):
    base = {"prompt": "abc", "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    full = post(server.http, base).json()["choices"][0]
    ids, tokenizer = full["token_ids"], ByteTokenizer(512, bos_token_id=256)
    # A printable byte first seen at token k > 0 makes a stop string that cuts after token k.
    k = next(
        k
        for k in range(1, len(ids))
        if 33 <= ids[k] < 127 and chr(ids[k]) not in tokenizer.decode(ids[:k])
    )
    cut = post(server.http, {**base, "stop": ["#@!", chr(ids[k])], "logprobs": 1}).json()
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == ids[: k + 1]
    assert choice["text"] == tokenizer.decode(ids[:k])
    assert len(choice["logprobs"]["token_logprobs"]) == k + 1
    assert cut["usage"]["completion_tokens"] == k + 1

    echoed = post(server.http, {**base, "echo": True, "logprobs": 1}).json()["choices"][0]
    plain = post(server.http, {**base, "logprobs": 1}).json()["choices"][0]
    prompt_ids = tokenizer.encode("abc")
    assert echoed["token_ids"] == [*prompt_ids, *ids]
    assert echoed["text"] == "abc" + full["text"]
    echoed_logprobs = echoed["logprobs"]["token_logprobs"]
    assert echoed_logprobs[0] is None and None not in echoed_logprobs[1:]  # the prompt scored
    assert echoed_logprobs[len(prompt_ids) :] == plain["logprobs"]["token_logprobs"]


def _rescored(http: httpx.Client, prompt: list[int], stream: bool) -> tuple[dict, dict]:
    """A greedy completion of `prompt` with top-5 logprobs, and the echo of prompt plus that
    completion with max_tokens 0 (lm-eval-harness's loglikelihood request); -> both choices."""
    base = {"temperature": 0.0, "ignore_eos": True, "logprobs": 5}
    decoded = post(http, {**base, "prompt": prompt, "max_tokens": 10}).json()["choices"][0]
    body = {**base, "prompt": prompt + decoded["token_ids"], "max_tokens": 0, "echo": True}
    if not stream:
        return decoded, post(http, body).json()["choices"][0]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    (choice,) = [c for line in lines[:-1] for c in json.loads(line)["choices"]]
    return decoded, choice


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_zero_rescores_a_completion_to_decodes_bits(server, stream):
    """The prompt's logprobs under echo are teacher-forced (a scoring of its tokens after the
    first): re-scoring prompt + completion gives the completion's decode logprobs and top
    logprobs bit for bit; nothing is generated. Before, every prompt logprob was null and
    max_tokens 0 a 400, so evaluation harnesses could not score through the server."""
    prompt = [5, 17, 99, 200, 3, 42, 7]
    decoded, echoed = _rescored(server.http, prompt, stream)
    assert echoed["token_ids"] == prompt + decoded["token_ids"]
    assert echoed["finish_reason"] == "length"
    got, want = echoed["logprobs"], decoded["logprobs"]
    assert got["token_logprobs"][0] is None and None not in got["token_logprobs"][1:]
    for key in ("token_logprobs", "top_logprob_ids", "top_logprobs", "tokens"):
        assert got[key][len(prompt) :] == want[key], key
    assert [float.hex(x) for x in got["token_logprobs"][len(prompt) :]] == [
        float.hex(x) for x in want["token_logprobs"]
    ]
    assert got["text_offset"][len(prompt)] == len(ByteTokenizer(512).decode(prompt))


def test_echo_rescoring_control_fast_kernels_differ():
    """With fast kernels the re-scored completion's logprobs differ from its decode's: the
    comparison above can fail."""
    with running_server({"kernels.mode": "fast"}) as fast:
        prompt = [5, 17, 99, 200, 3, 42, 7]
        decoded, echoed = _rescored(fast.http, prompt, stream=False)
    assert (
        echoed["logprobs"]["token_logprobs"][len(prompt) :] != decoded["logprobs"]["token_logprobs"]
    )


def test_echo_with_logprobs_zero_scores_the_prompt_with_empty_tops(server):
    """logprobs 0: each scored prompt token gets its logprob and an empty top (decode's
    report at 0); the scoring returned no tops at all and the choice failed to render."""
    prompt = [1, 2, 3, 4, 5]
    for max_tokens in (0, 2):
        body = {"prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 0}
        response = post(server.http, body)
        assert response.status_code == 200, response.text
        logprobs = response.json()["choices"][0]["logprobs"]
        assert logprobs["top_logprob_ids"][1 : len(prompt)] == [{}] * (len(prompt) - 1)
        assert None not in logprobs["token_logprobs"][1:]


def test_echo_past_the_context_is_refused_before_its_prompt_is_scored(server):
    steps_before = server.async_engine.call(lambda e: e.stats().num_steps).result(timeout=30)
    body = {"prompt": [7] * 1020, "max_tokens": 16, "echo": True, "logprobs": 1}
    response = post(server.http, body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    steps_after = server.async_engine.call(lambda e: e.stats().num_steps).result(timeout=30)
    assert steps_after == steps_before, "the prompt was scored before the refusal"


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_a_drain_finishes_an_echo_request_whose_prompt_is_being_scored(max_tokens):
    """Scoring and generation are queued together: a drain that begins while the prompt is
    scored lets the request finish (it failed with 503 once its scoring was done)."""
    prompt = [(i * 7) % 250 + 1 for i in range(900)]
    with running_server() as running:
        body = {"prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 1}
        body.update(seed=1, ignore_eos=True)  # unseeded, a draw could hit EOS (CI: 901 of 904)
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(post, running.http, body)
            deadline = time.monotonic() + 30
            while running.async_engine.stats().num_running == 0:
                assert time.monotonic() < deadline and not sent.done()
                time.sleep(0.005)
            running.async_engine.shutdown(drain_timeout_s=60)
            response = sent.result(timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert len(choice["token_ids"]) == len(prompt) + max_tokens
    assert choice["finish_reason"] == "length"


def test_weight_versions_count_the_prompts_scoring():
    """A response's first_weight_version is the oldest over its prompts' scorings too: a weight
    update between the scoring and the completion gave prompt logprobs of one version and
    tokens of the next under the newer version alone."""
    scoring = RequestOutput("score-1", [1, 2], [], True, weight_version=3, first_weight_version=2)
    generated = RequestOutput("r", [1, 2], [], True, weight_version=4, first_weight_version=4)

    async def respond(stream: bool) -> list[dict]:
        generation = Generation(
            _Answered([generated]), [[1, 2]], [], ServerMetrics(lambda: None), 0.0, stream
        )
        await generation.start()
        response = await generation.response({}, lambda i, o: [{}], True, [scoring])
        if not stream:
            return [json.loads(response.body)]
        events = [chunk async for chunk in response.body_iterator]
        return [json.loads(e[6:]) for e in events if e.startswith("data: {")]

    (whole,) = asyncio.run(respond(stream=False))
    assert (whole["weight_version"], whole["first_weight_version"]) == (4, 2)
    *chunks, usage_chunk = asyncio.run(respond(stream=True))
    assert [c["first_weight_version"] for c in [*chunks, usage_chunk]] == [2, 2]
    assert usage_chunk["weight_version"] == 4


def test_a_whole_response_holds_no_deltas():
    """A whole (not streamed) response is built from the submission's outputs; its deltas were
    also queued for the event loop and held unread until it ended: a large response's output
    twice over in memory. A stream still gets every delta."""
    outputs = [RequestOutput(f"r{i}", [1, 2], [], True) for i in range(3)]

    async def queued(stream: bool) -> int:
        metrics = ServerMetrics(lambda: None)
        generation = Generation(_Answered(outputs), [[1, 2]] * 3, [], metrics, 0.0, stream)
        await generation.start()
        await asyncio.sleep(0)  # the end marker's callback has run too
        return generation._queue.qsize() + (generation._first is not None)

    assert asyncio.run(queued(stream=False)) <= 1  # the end marker alone
    assert asyncio.run(queued(stream=True)) == 4  # three deltas and the end


def test_max_tokens_zero_needs_echo_and_a_one_token_prompt_has_nothing_to_score(server):
    refused = post(server.http, {"prompt": "abc", "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    one = {"prompt": [7], "max_tokens": 0, "echo": True, "logprobs": 2, "n": 2}
    body = post(server.http, one).json()
    assert [c["logprobs"]["token_logprobs"] for c in body["choices"]] == [[None], [None]]
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1}
    outside = post(server.http, {"prompt": [7, 99999], "max_tokens": 0, "echo": True})
    assert outside.status_code == 400 and "99999" in outside.json()["error"]["message"]


def test_async_engine_worker_failure_fails_pending_and_reports_dead():
    """max_restarts 0: the engine is dead for good as its requests fail. The ones that never
    ran were told 'it is rebuilding its workers' with a Retry-After, and /health said
    'recovering', a moment before the rebuild was refused."""
    config = load_config(TINY_CONFIG, {"parallel.max_restarts": 0, "scheduler.max_num_seqs": 1})
    engine = LLMEngine(config)
    run_step = engine.executor.execute
    all_queued = threading.Event()
    calls = []

    def broken(per_rank_chunks):
        calls.append(1)
        if len(calls) == 1:
            all_queued.wait(30)  # the other two are queued, then admitted behind the first
            return run_step(per_rank_chunks)
        raise WorkerError("rank 0 failed step 2: injected")

    engine.executor.execute = broken  # before the engine thread exists: no race
    async_engine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    futures = [async_engine.submit([[1, 2, 3]], [params]) for _ in range(3)]
    all_queued.set()
    with pytest.raises(WorkerError, match="injected"):  # in the failed step
        futures[0].result(timeout=10)
    for future in futures[1:]:  # admitted, never run: one sequence a step
        with pytest.raises(EngineUnavailableError, match="injected") as failed:
            future.result(timeout=10)
        assert "failed before the request ran" in str(failed.value), failed.value
        assert "max_restarts=0" in str(failed.value), failed.value
        # no rebuild is coming, so none is promised
        assert "rebuilding" not in str(failed.value) and failed.value.retry_after_s is None
    assert async_engine.has_given_up, async_engine.error
    assert not async_engine.is_healthy and "injected" in async_engine.error
    with pytest.raises(EngineUnavailableError, match="dead"):
        async_engine.submit([[1, 2, 3]], [params])

    async def health() -> httpx.Response:
        app = create_app(config, Backend(async_engine, engine.tokenizer))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/health")

    assert asyncio.run(health()).status_code == 503
    async_engine.shutdown(drain_timeout_s=1)


def test_async_engine_scorings_settle_with_score_bits_and_a_cancelled_one_is_aborted():
    """Scorings have no deltas: each is settled when its requests finish, with LLM's bits; a
    cancelled one is aborted (its long prefill is not run through), and a bad one refused."""
    sequences, prompt_lens = [[5, 6, 7, 8, 9], [1, 2, 3]], [2, 1]
    llm = LLM(TINY_CONFIG)
    want = [fingerprint(o) for o in llm.score_outputs(sequences, prompt_lens, logprobs=3)]
    llm.shutdown()
    async_engine = AsyncEngine(LLMEngine(load_config(TINY_CONFIG)))
    try:
        got = async_engine.submit_scores(sequences, prompt_lens, logprobs=3).result(timeout=60)
        assert [fingerprint(whole.outputs[0]) for whole in got] == want
        # 8 x 1000 tokens at 512 a step: 16 steps at least, run through.
        long = [[(i * k) % 250 + 1 for i in range(1000)] for k in range(1, 9)]
        cancelled = async_engine.submit_scores(long, [1] * 8)
        deadline = time.monotonic() + 30
        while async_engine.stats().num_running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert cancelled.cancel()
        steps_at_cancel = async_engine.stats().num_steps
        while num_running(async_engine):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        num_after = async_engine.stats().num_steps - steps_at_cancel
        assert num_after <= 3, f"the cancelled scoring ran {num_after} more steps"
        with pytest.raises(ValueError, match="prompt_len"):
            async_engine.submit_scores([[1, 2]], [2]).result(timeout=60)
        assert async_engine.submit_scores([[1, 2]], [1]).result(timeout=60)[0].is_finished
    finally:
        async_engine.shutdown(drain_timeout_s=1)


def test_async_engine_stats_count_the_step_or_call_that_answered():
    """`stats` (what /metrics and /health read) already counts the step that finished a
    request when its last delta and its result are handed out, and a call's effect when its
    result is: a scrape right after a response showed the finished request still running, its
    KV blocks in use and its last step uncounted (a rebalance's answer, before its balancedness)."""
    async_engine = AsyncEngine(LLMEngine(load_config(TINY_CONFIG)))
    seen = {}

    def on_output(_prompt_idx: int, delta: RequestOutput) -> None:  # on the loop thread
        if delta.is_finished:
            seen["last delta"] = async_engine.stats()

    gate = threading.Event()

    def rebalance(engine: LLMEngine) -> dict:
        gate.wait()  # its done-callback is added first: it runs as the result is handed out
        return engine.rebalance(force=False)  # one rank: balanced, skipped, measured

    try:
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        done = async_engine.submit([[1, 2, 3]], [params], on_output)
        done.result(timeout=60)
        call = async_engine.call(rebalance)
        call.add_done_callback(lambda _future: seen.setdefault("call", async_engine.stats()))
        gate.set()
        report = call.result(timeout=60)
        finished = seen["last delta"]
        assert (finished.num_running, finished.num_waiting) == (0, 0)
        assert finished.kv_cache_usage == (0.0,)
        assert finished.num_steps == async_engine.stats().num_steps == 3
        assert seen["call"].last_balancedness == report["balancedness_before"] == 1.0
    finally:
        async_engine.shutdown(drain_timeout_s=1)


def test_async_engine_cancel_aborts_and_shutdown_drains():
    engine = LLMEngine(load_config(TINY_CONFIG))
    step = engine.step

    def slow_step():  # >= 10 ms a step: 600 tokens cannot fit a 3 s drain, 5 fit it easily
        time.sleep(0.01)
        return step()

    engine.step = slow_step
    async_engine = AsyncEngine(engine)
    long = SamplingParams(max_tokens=600, ignore_eos=True, temperature=0.0)
    cancelled = async_engine.submit([[1, 2, 3]], [long])
    deadline = time.monotonic() + 30
    while async_engine.stats().num_running == 0:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert cancelled.cancel()
    while num_running(async_engine):  # aborted long before 600 steps
        assert time.monotonic() < deadline
        time.sleep(0.005)
    short = async_engine.submit(["abc"], [SamplingParams(max_tokens=5, ignore_eos=True)])
    too_long = async_engine.submit([[4, 5]], [long])
    async_engine.shutdown(drain_timeout_s=3.0)
    assert len(short.result(timeout=0)[0].token_ids) == 5
    with pytest.raises(EngineUnavailableError):
        too_long.result(timeout=0)
    assert not async_engine.is_healthy


def test_a_submission_of_many_prompts_costs_the_engine_thread_linear_work(monkeypatch):
    """A request of N prompts: each delta asked whether all N had finished (O(N^2) in all:
    8000 two-token prompts took 35 s, stalling every stream), and its abort scanned the
    queues once a prompt (3 s). Counted, not timed: Request.is_finished evaluations and
    Scheduler.abort passes."""
    num_checks, num_aborts = [0], [0]
    is_finished, abort = Request.is_finished, Scheduler.abort

    def counted_is_finished(request):
        num_checks[0] += 1
        return is_finished.fget(request)

    def counted_abort(scheduler, request_ids):
        num_aborts[0] += 1
        return abort(scheduler, request_ids)

    monkeypatch.setattr(Request, "is_finished", property(counted_is_finished))
    monkeypatch.setattr(Scheduler, "abort", counted_abort)
    async_engine = AsyncEngine(LLMEngine(load_config(TINY_CONFIG)))
    try:
        n = 400
        prompts = [[65 + i % 20, 66] for i in range(n)]
        params = [SamplingParams(max_tokens=1, ignore_eos=True)] * n
        outputs = async_engine.submit(prompts, params, lambda i, delta: None).result(timeout=120)
        assert len(outputs) == n and all(o.is_finished for o in outputs)
        assert num_checks[0] <= 8 * n, num_checks[0]  # was ~n^2 / 2 = 80,000
        steps = async_engine.stats().num_steps
        cancelled = async_engine.submit(prompts, [SamplingParams(max_tokens=50)] * n)
        deadline = time.monotonic() + 30
        while async_engine.stats().num_steps == steps:  # it runs
            assert time.monotonic() < deadline
            time.sleep(0.005)
        num_aborts[0] = 0
        assert cancelled.cancel()
        while num_running(async_engine):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert num_aborts[0] == 1  # one pass for all n (was n)
    finally:
        async_engine.shutdown(drain_timeout_s=1)


def test_an_idle_engine_keeps_no_answered_or_cancelled_request_alive(monkeypatch):
    """Once a request is answered, or cancelled and aborted, nothing of the engine holds it
    while the engine sits idle. Before, the scheduler listed its released sequences until the
    next step, and the loop thread's locals held the last submission admitted and the last
    cancelled, each with its requests' whole outputs (tokens, logprobs dicts, routed experts:
    hundreds of MB for a large request with logprobs), until another request came."""
    refs: list[weakref.ref] = []
    enqueue = LLMEngine._enqueue

    def spy(engine, request):
        refs.append(weakref.ref(request))
        return enqueue(engine, request)

    monkeypatch.setattr(LLMEngine, "_enqueue", spy)
    async_engine = AsyncEngine(LLMEngine(load_config(TINY_CONFIG)))
    try:
        short = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2)
        async_engine.submit([[1, 2, 3]], [short], lambda i, delta: None).result(timeout=60)
        long = SamplingParams(max_tokens=600, ignore_eos=True)
        cancelled = async_engine.submit([[4, 5]], [long])
        deadline = time.monotonic() + 60
        while async_engine.stats().num_running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert cancelled.cancel()
        while num_running(async_engine):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert len(refs) == 2
        # The loop settles a request before its pass ends: a bounded wait, then none is left.
        deadline = time.monotonic() + 10
        gc.collect()
        while any(ref() is not None for ref in refs):
            assert time.monotonic() < deadline, [ref() for ref in refs]
            time.sleep(0.05)
            gc.collect()
    finally:
        async_engine.shutdown(drain_timeout_s=1)


def test_serve_ep_subprocess_starts_answers_and_drains_on_sigterm():
    serve = ServeEp()
    proc = serve.proc
    try:
        with httpx.Client(base_url=serve.ready_url(30), timeout=30) as http:
            assert http.get("/health").status_code == 200
            assert post(http, {"prompt": "hi", "max_tokens": 3}).status_code == 200
            # Long enough to be running when SIGTERM comes (it is sent the moment /health
            # counts it), short enough to drain well inside the 30 s timeouts: 500 tokens
            # took 10 s on a 2-core machine under load.
            body = {"prompt": [1, 2], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
            with ThreadPoolExecutor(1) as pool:
                in_flight = pool.submit(post, http, body)
                while http.get("/health").json()["num_running"] == 0:
                    assert not in_flight.done(), "finished before SIGTERM could be sent"
                proc.send_signal(signal.SIGTERM)
                response = in_flight.result(timeout=30)
        assert response.status_code == 200
        assert len(response.json()["choices"][0]["token_ids"]) == body["max_tokens"]
        assert proc.wait(timeout=15) == 0
    finally:
        serve.kill()


@pytest.mark.parametrize(
    ("first", "second"),
    [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGTERM)],
    ids=["ctrl-c-twice", "sigterm-twice"],
)
def test_a_second_stop_signal_ends_the_drain_at_once_without_a_traceback(first, second):
    """Ctrl-C twice (uvicorn's log offers "CTRL+C to force quit"): the second one only made
    uvicorn stop waiting for the connections, so the drain still ran its whole course (two
    2000-token requests: some 20 s), and the app's shutdown, skipped, was cancelled with an
    ERROR traceback. A second SIGTERM logged nothing and changed nothing (a client that stopped
    reading held the exit until the drain timeout). Now either ends the requests in flight at
    once saying so, one line logs the cut, and the exit is 0."""
    serve = ServeEp("--drain-timeout-s", "120", "--set", "scheduler.max_model_len=2048")
    proc = serve.proc
    body = {"prompt": [1, 2], "max_tokens": 2000, "ignore_eos": True}
    try:
        url = serve.ready_url(30)
        with httpx.Client(base_url=url, timeout=60) as http, ThreadPoolExecutor(2) as pool:
            stream = pool.submit(_stream_until_done, url, body)
            whole = pool.submit(post, http, body)
            while http.get("/health").json()["num_running"] < 2:
                assert not whole.done(), whole.result()
            proc.send_signal(first)
            serve.wait_for("draining requests in flight", 10)
            proc.send_signal(second)
            started = time.monotonic()
            assert proc.wait(timeout=60) == 0
            elapsed = time.monotonic() - started
            last_event, answer = stream.result(timeout=10), whole.result(timeout=10)
    finally:
        serve.kill()
    output = "".join(serve.rest("stdout") + serve.rest("stderr"))
    assert elapsed < 8, f"exited {elapsed:.1f}s after the second signal:\n{output[-3000:]}"
    cut = f"serve_ep: a second stop signal ({second.name}): the drain was cut short"
    assert output.count(cut) == 1, output[-3000:]
    assert "drain was cut short" in last_event["error"]["message"], last_event
    assert answer.status_code == 503, answer.text
    assert "drain was cut short" in answer.json()["error"]["message"]
    assert "Traceback" not in output, output[-3000:]


def _stream_until_done(url: str, body: dict) -> dict:
    """A streamed completion read up to data: [DONE] (asserted): its last event."""
    with httpx.Client(base_url=url, timeout=60) as http:
        return sse_events(http, "/v1/completions", body)[-1]


def test_serve_ep_listens_while_loading_and_exits_1_when_the_engine_fails():
    # device cuda on a machine without one: the config is valid, the engine load is not.
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    result = subprocess.run(
        [
            sys.executable,
            "launch/serve_ep.py",
            "--config",
            str(TINY_CONFIG),
            "--port",
            "0",
            "--set",
            "parallel.device=cuda",
            "--set",
            "kernels.mode=fast",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "listening on" in result.stdout and "the engine failed to load" in result.stdout
    assert "ready on" not in result.stdout


NULLABLE = {"temperature": None, "top_p": None, "n": None, "stream": None, "echo": None}


@pytest.mark.parametrize("field", sorted(NULLABLE))
def test_null_is_the_default_of_a_nullable_openai_field(server, field):
    """OpenAI's spec marks these nullable (its client sends null for None): the default's
    bits, not a 400."""
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "seed": 3, "logprobs": 1, "ignore_eos": True}
    plain = post(server.http, body)
    nulled = post(server.http, {**body, field: None})
    assert nulled.status_code == 200, nulled.text
    assert http_fingerprint(nulled.json()["choices"][0]) == http_fingerprint(
        plain.json()["choices"][0]
    )


def test_openai_client_sends_none_and_user_and_retrieves_the_model(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    out = client.completions.create(
        model=server.model, prompt="Hi", max_tokens=2, temperature=None, top_p=None, user="alice"
    )
    assert len(out.choices) == 1 and out.usage.completion_tokens <= 2
    assert client.models.retrieve(server.model).id == server.model


NO_OP_FIELDS = {
    "user": "alice",
    "frequency_penalty": 0,
    "presence_penalty": 0.0,
    "logit_bias": {},
    "suffix": None,
    "best_of": 2,
    "n": 2,
}


def test_openai_fields_with_values_that_change_nothing_are_accepted(server):
    body = {"prompt": [9, 8, 7], "max_tokens": 4, "seed": 5, "logprobs": 1, "n": 2}
    plain = post(server.http, body).json()["choices"]
    given = post(server.http, {**body, **NO_OP_FIELDS})
    assert given.status_code == 200, given.text
    assert list(map(http_fingerprint, given.json()["choices"])) == list(
        map(http_fingerprint, plain)
    )
    for field in ("nonsense", "response_format", "store"):  # unknown here (the latter: chat's)
        error = post(server.http, {**body, field: None}).json()["error"]
        assert error["param"] == field and "Extra inputs are not permitted" in error["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 0.5),
        ("frequency_penalty", False),
        ("presence_penalty", -1),
        ("logit_bias", {"5": 100}),
        ("best_of", 3),  # n is 1
        ("suffix", "!"),
    ],
)
def test_unimplemented_openai_values_are_refused_as_not_supported(server, field, value):
    error = post(server.http, {"prompt": "a", field: value}).json()["error"]
    assert error["param"] == field and "is not supported" in error["message"], error
    assert error["message"].startswith(f"{field}: ")


def test_a_model_is_retrieved_by_its_id(server):
    (listed,) = server.http.get("/v1/models").json()["data"]
    assert server.http.get(f"/v1/models/{server.model}").json() == listed
    other = server.http.get("/v1/models/org/other")
    assert other.status_code == 404
    assert other.json() == {
        "error": {
            "message": "model 'org/other' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_unknown_model_is_coded_model_not_found_as_openai_does(server, path):
    """OpenAI answers another model with a 404 coded "model_not_found" (its type an
    invalid_request_error); clients key on the code."""
    prompt = {"messages": [{"role": "user", "content": "a"}]} if "chat" in path else {"prompt": "a"}
    response = server.http.post(path, json={**prompt, "model": "gpt-4"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "model",
        "model_not_found",
    )


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "body", "param", "num_tokens"),
    [
        ("/v1/completions", {"prompt": [7] * (MAX_MODEL_LEN + 1)}, "prompt", MAX_MODEL_LEN + 1),
        ("/v1/completions", {"prompt": "x" * MAX_MODEL_LEN, "max_tokens": 1}, "prompt", 1025),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * MAX_MODEL_LEN}]},
            "messages",
            None,  # the template's
        ),
    ],
)
def test_a_prompt_past_the_whole_context_is_coded_context_length_exceeded(
    server, path, body, param, num_tokens, stream
):
    """OpenAI's code for it, which clients such as LiteLLM key on (it was null): whole and
    streamed (the refusal comes before the first event), worded as OpenAI words it."""
    if num_tokens is None:
        num_tokens = len(server.engine.tokenizer.apply_chat_template(body["messages"]))
    response = server.http.post(path, json={**body, "stream": stream})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", param)
    assert error["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens; the prompt has "
        f"{num_tokens} tokens, more than scheduler.max_model_len={MAX_MODEL_LEN}"
    )


def test_a_batch_prompt_past_the_context_is_named_by_its_index(server):
    response = post(server.http, {"prompt": [[1, 2], [7] * (MAX_MODEL_LEN + 3)]})
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["param"]) == (
        400,
        "context_length_exceeded",
        "prompt",
    )
    assert error["message"].startswith("This model's maximum context length is 1024 tokens;")
    assert error["message"].endswith(
        "has 1027 tokens, more than scheduler.max_model_len=1024 (prompt 1)"
    )


def test_text_prompts_are_encoded_off_the_engine_thread():
    """The engine's thread runs every step: a long text's tokenization there stalled every
    stream (a 50 MB prompt: seconds). The engine's checks still see the ids."""
    with running_server() as running:
        tokenizer = running.engine.tokenizer
        threads = []
        encode = tokenizer.encode

        def recording_encode(text):
            threads.append(threading.current_thread().name)
            return encode(text)

        tokenizer.encode = recording_encode
        body = {"prompt": ["ab", "cd"], "max_tokens": 2, "echo": True, "logprobs": 1}
        response = post(running.http, body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"].startswith("ab")
        assert len(threads) == 2 and "engine-loop" not in threads, threads
        response = post(running.http, {"prompt": ["ab", "c" * 2000], "max_tokens": 2})
        error = response.json()["error"]
        assert (response.status_code, error["code"]) == (400, "context_length_exceeded")
        assert error["message"].endswith(
            "has 2001 tokens, more than scheduler.max_model_len=1024 (prompt 1)"
        ), error


def test_more_sequences_than_server_max_sequences_per_request_is_a_400():
    """prompts x n past the limit is refused before anything is queued (one body of a million
    prompts held the engine's thread for an hour and GBs of sequence state); at it, served."""
    with running_server({"server.max_sequences_per_request": 4}) as small:
        body = {"prompt": [[1, 2], [3, 4], [5, 6]], "n": 2, "max_tokens": 1}
        response = post(small.http, body)
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (400, "prompt"), response.text
        assert error["message"] == (
            "prompt: 3 prompts x n=2 = 6 sequences, more than "
            "server.max_sequences_per_request=4 in one request"
        )
        assert small.engine.stats().num_steps == 0  # nothing ran
        response = post(small.http, {**body, "prompt": [[1, 2], [3, 4]]})
        assert response.status_code == 200 and len(response.json()["choices"]) == 4
        # A chat's n past it named `messages` ("messages: SamplingParams.n=8 ..."): it is n.
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        num_steps = small.engine.stats().num_steps
        response = small.http.post("/v1/chat/completions", json={**chat, "n": 5})
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (400, "n"), response.text
        assert error["message"] == (
            "n: 5 samples, more than server.max_sequences_per_request=4 in one request"
        )
        assert small.engine.stats().num_steps == num_steps  # nothing more ran
        response = small.http.post("/v1/chat/completions", json={**chat, "n": 4})
        assert response.status_code == 200 and len(response.json()["choices"]) == 4


@pytest.mark.parametrize(("value", "status"), [(False, 200), (None, 200), (True, 400)])
def test_stream_options_include_obfuscation_is_accepted_off(server, value, status):
    """OpenAI's stream_options.include_obfuscation (padding added to chunks): off changes
    nothing, on is not supported."""
    options = {"include_usage": True, "include_obfuscation": value}
    body = {"prompt": "a", "max_tokens": 2, "stream": True, "stream_options": options}
    response = post(server.http, body)
    assert response.status_code == status, response.text
    if status == 400:
        error = response.json()["error"]
        assert error["param"] == "stream_options" and "is not supported" in error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stop_token_ids_outside_the_vocabulary_are_400s_naming_the_field(server, path):
    vocab = server.engine.config.model.vocab_size
    prompt = {"messages": [{"role": "user", "content": "a"}]} if "chat" in path else {"prompt": "a"}
    for ids in ([-5], [vocab], [3, 10**6]):
        response = server.http.post(path, json={**prompt, "stop_token_ids": ids})
        assert response.status_code == 400, (ids, response.text)
        error = response.json()["error"]
        assert error["param"] == "stop_token_ids", (ids, error)
    last = server.http.post(path, json={**prompt, "max_tokens": 2, "stop_token_ids": [vocab - 1]})
    assert last.status_code == 200, last.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_min_tokens_holds_stop_ids_off_within_the_token_budget(server, path):
    """min_tokens was refused as an unknown field; now it reaches SamplingParams (a stop id
    is never sampled before it) and a value over the token budget is a 400 naming it."""
    is_chat = "chat" in path
    prompt = {"messages": [{"role": "user", "content": "a"}]} if is_chat else {"prompt": "a"}
    bad = [
        ({"min_tokens": -1}, "greater than or equal to 0"),
        ({"min_tokens": 1.0}, "valid integer"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens: 5 is more than max_tokens=4"),
        (
            {"max_completion_tokens": 3, "min_tokens": 4}
            if is_chat
            else {"min_tokens": 17},  # over the default max_tokens, 16
            "more than max_completion_tokens=3" if is_chat else "the default max_tokens=16",
        ),
    ]
    for body, problem in bad:
        response = server.http.post(path, json={**prompt, **body})
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == "min_tokens" and problem in error["message"], (body, error)
    greedy = {**prompt, "max_tokens": 6, "temperature": 0.0}
    free = server.http.post(path, json=greedy).json()["choices"][0]["token_ids"]
    body = {**greedy, "stop_token_ids": [free[1]], "min_tokens": 6}
    held = server.http.post(path, json=body).json()["choices"][0]
    assert free[1] not in held["token_ids"] and len(held["token_ids"]) == 6


@pytest.mark.parametrize(
    ("body", "param", "problem"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options", "needs stream: true"),
        ({"stream_options": {}, "stream": False}, "stream_options", "needs stream: true"),
        ({"stop": ""}, "stop", "must not be empty"),
        ({"stop": ["x", ""]}, "stop", "must not be empty"),
        ({"stop_token_ids": [-5]}, "stop_token_ids", "greater than or equal to 0"),
    ],
)
def test_request_field_combinations_openai_refuses(server, body, param, problem):
    response = post(server.http, {"prompt": "a", "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and problem in error["message"], error


@pytest.mark.parametrize(
    ("content_type", "content"),
    [("text/plain", b'{"prompt": "a"}'), ("application/x-www-form-urlencoded", b"prompt=a")],
)
def test_a_body_that_is_not_json_content_says_so(server, content_type, content):
    """`curl -d` sends a form: the 400 says what the body must be, not only that it is not
    a dictionary."""
    headers = {"content-type": content_type}
    response = server.http.post("/v1/completions", content=content, headers=headers)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "must be JSON" in message and "application/json" in message, message


def test_health_while_shutting_down_says_so():
    """/health of a draining or stopped engine was 503 with "error": null."""
    config = load_config(TINY_CONFIG)
    engine = LLMEngine(config)
    async_engine = AsyncEngine(engine)
    app = create_app(config, Backend(async_engine, engine.tokenizer))

    async def health() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/health")

    assert asyncio.run(health()).status_code == 200
    async_engine.shutdown(drain_timeout_s=1)
    response = asyncio.run(health())
    assert response.status_code == 503
    assert response.json() == {
        "status": "unavailable",
        "error": "the server is shutting down: it takes no new requests",
    }


def test_top_logprobs_follow_server_max_logprobs():
    """The HTTP bound on logprobs / top_logprobs was a constant 20 whatever the config, and
    beside it the engine's own (the vocabulary) left generate and score unbounded: both follow
    server.max_logprobs now, and the 400 names the field and the key with its value."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True}
    with running_server({"server.max_logprobs": 3}) as small:
        refused = post(small.http, {"prompt": "a", "max_tokens": 1, "logprobs": 4})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "logprobs"
        assert error["message"] == "logprobs: 4 is more than server.max_logprobs=3"
        refused = small.http.post("/v1/chat/completions", json={**chat, "top_logprobs": 4})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "top_logprobs"
        assert "top_logprobs: 4 is more than server.max_logprobs=3" in refused.text
        echo = {"prompt": "ab", "max_tokens": 0, "echo": True, "logprobs": 4}
        assert post(small.http, echo).status_code == 400
        assert post(small.http, {"prompt": "a", "max_tokens": 1, "logprobs": 3}).status_code == 200
    with running_server({"server.max_logprobs": 25}) as wide:
        answered = post(wide.http, {"prompt": "a", "max_tokens": 1, "logprobs": 25})
        assert answered.status_code == 200, answered.text
        assert len(answered.json()["choices"][0]["logprobs"]["top_logprob_ids"][0]) == 25
        answered = wide.http.post("/v1/chat/completions", json={**chat, "top_logprobs": 25})
        assert answered.status_code == 200, answered.text
