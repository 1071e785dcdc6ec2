"""SSE streaming of /v1/completions: the same bits as whole responses, alone or among many.

Streamed token ids and logprobs are compared bit for bit (float.hex) with the non-streamed
response and with `LLM.generate`, alone and among 34 concurrent clients (engagement: they
shared steps; negative control: a fast-mode server's bits differ there); stop strings end a
sample early and never reach the streamed text; a client that leaves aborts its request.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from moe_runtime import SamplingParams
from tests.serving import merge_completion_chunks, num_running, running_server, sse_events
from tests.test_server import TARGETS, _background_requests, http_fingerprint, post
from tests.test_server_metrics import scrape

COMPLETIONS = "/v1/completions"
MESSAGE = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def server():
    with running_server() as running:
        yield running


def streamed(server, body: dict) -> dict[int, dict]:
    return merge_completion_chunks(sse_events(server.http, COMPLETIONS, body))


def test_an_event_is_one_line_whatever_the_text():
    """A token's text may hold characters JSON leaves raw that str.splitlines (httpx's
    iter_lines) takes for line ends; the event stays one line and decodes to the same text."""
    import json

    from launch.openai.render import sse

    text = "a\x85b\u2028c\u2029d\n\r\x1c\x1d\x1e\x0b\x0c\u00e9"
    event = sse({"choices": [{"text": text}]})
    line, blank = event.splitlines(keepends=True)
    assert blank == "\n" and line.startswith("data: ") and line.endswith("\n")
    assert json.loads(line[len("data: ") : -1])["choices"][0]["text"] == text
    assert "\u00e9" in line  # other non-ASCII text stays as it is


def test_stream_chunks_are_openai_format_and_end_with_done(server):
    chunks = sse_events(server.http, COMPLETIONS, {**TARGETS[0], "max_tokens": 5})
    assert len(chunks) == 5  # one chunk per sampled token
    for chunk in chunks:
        assert chunk["object"] == "text_completion" and chunk["model"] == server.model
        assert chunk["id"] == chunks[0]["id"] and "weight_version" in chunk
        (choice,) = chunk["choices"]
        assert len(choice["token_ids"]) == 1 and len(choice["logprobs"]["token_logprobs"]) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]


def test_streamed_equals_whole_response(server):
    for target in TARGETS:
        whole = post(server.http, target).json()["choices"][0]
        (choice,) = streamed(server, target).values()
        assert http_fingerprint(choice) == http_fingerprint(whole)
        assert choice["text"] == whole["text"] and choice["finish_reason"] == "length"


def streamed_alone_and_together(server) -> tuple[list[tuple], list[tuple]]:
    """Target fingerprints streamed alone, then among 34 other concurrent clients (half of them
    streaming too); checks the concurrent requests really shared steps."""
    alone = [http_fingerprint(streamed(server, t)[0]) for t in TARGETS]
    background = _background_requests(34)
    jobs = [(b, i % 2 == 0) for i, b in enumerate(background)]  # half of them stream too
    jobs = [*jobs[:17], (TARGETS[0], True), *jobs[17:], (TARGETS[1], True)]

    def run(job):
        body, is_stream = job
        if is_stream:
            return streamed(server, body)
        return dict(enumerate(post(server.http, body).json()["choices"]))

    steps_before = server.async_engine.stats().num_steps
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    num_steps = server.async_engine.stats().num_steps - steps_before
    for (body, _), result in zip(jobs, results, strict=True):
        assert sorted(result) == list(range(body.get("n", 1)))
        assert all(len(c["token_ids"]) == body["max_tokens"] for c in result.values())
    # Engagement: served one at a time, these requests would need a step per generated token.
    serial_steps = sum(body["max_tokens"] for body, _ in jobs)
    assert num_steps < serial_steps / 2, f"{num_steps} steps: requests were not batched"
    together = [http_fingerprint(results[i][0]) for i in (17, -1)]
    return alone, together


def test_streamed_batch_invariance_among_concurrent_clients(server):
    alone, together = streamed_alone_and_together(server)
    assert together == alone


def test_streamed_batch_invariance_negative_control():
    with running_server({"kernels.mode": "fast"}) as fast_server:
        alone, together = streamed_alone_and_together(fast_server)
    assert together != alone, "fast mode matched too: the comparison cannot fail"


def test_stream_n_and_several_prompts_with_usage(server):
    body = {
        "prompt": ["ab", "xyz"],
        "n": 2,
        "max_tokens": 4,
        "seed": 9,
        "temperature": 0.8,
        "logprobs": 2,
        "ignore_eos": True,
    }
    whole = post(server.http, body).json()
    chunks = sse_events(
        server.http, COMPLETIONS, {**body, "stream_options": {"include_usage": True}}
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    merged = merge_completion_chunks(chunks[:-1])
    assert sorted(merged) == [0, 1, 2, 3]
    for choice in whole["choices"]:
        assert http_fingerprint(merged[choice["index"]]) == http_fingerprint(choice)
    assert merged[0]["token_ids"] != merged[1]["token_ids"]  # n samples get their own seeds


def test_stop_string_ends_stream_early_and_is_never_sent(server):
    base = {"prompt": "abc", "max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    full = post(server.http, base).json()["choices"][0]
    ids, text, decode = full["token_ids"], full["text"], server.engine.tokenizer.decode
    # A two-character stop string that first appears after the start of the text.
    at = next(i for i in range(1, len(text) - 1) if text.find(text[i : i + 2]) == i)
    stop = text[at : at + 2]
    k = next(k for k in range(len(ids)) if stop in decode(ids[: k + 1]))  # completing token
    body = {**base, "stop": [stop, "never-there"], "logprobs": 1}
    whole = post(server.http, body).json()
    (choice,) = streamed(server, body).values()
    assert choice["finish_reason"] == "stop" == whole["choices"][0]["finish_reason"]
    assert choice["stop_reason"] == stop == whole["choices"][0]["stop_reason"]
    assert choice["token_ids"] == ids[: k + 1] == whole["choices"][0]["token_ids"]
    assert choice["text"] == text[:at] == whole["choices"][0]["text"]
    assert whole["usage"]["completion_tokens"] == k + 1  # the engine stopped early
    # include_stop_str_in_output: the same tokens, the text up to the stop string's end.
    kept = {**body, "include_stop_str_in_output": True}
    (choice,) = streamed(server, kept).values()
    whole = post(server.http, kept).json()["choices"][0]
    assert choice["token_ids"] == ids[: k + 1] == whole["token_ids"]
    assert choice["text"] == text[: at + 2] == whole["text"]


def test_client_leaving_a_stream_aborts_its_request(server):
    """...and its samples count as finished by 'abort' (the metrics had no word of them);
    samples that end count by their own finish_reason."""
    finished = "moe_samples_finished_total{{finish_reason={}}}".format
    before = scrape(server)
    body = {"prompt": [1, 2, 3], "max_tokens": 900, "temperature": 0, "ignore_eos": True, "n": 2}
    with server.http.stream("POST", COMPLETIONS, json={**body, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    deadline = time.monotonic() + 20
    while num_running(server.async_engine):  # aborted long before 900 tokens
        assert time.monotonic() < deadline, "the request kept running after its client left"
        time.sleep(0.01)
    assert post(server.http, {**body, "max_tokens": 2}).status_code == 200
    after = scrape(server)
    assert after[finished("abort")] == before[finished("abort")] + 2
    assert after[finished("length")] == before[finished("length")] + 2


@pytest.mark.parametrize("route", [COMPLETIONS, "/v1/chat/completions"])
def test_client_leaving_a_stream_before_its_first_token_aborts_it(server, route):
    """The engine's thread held by a call while the client waits for a stream's first token
    and leaves: its request never runs. A chat stream left so stayed queued, then ran all its
    tokens for nobody (its 499 counted all the same)."""
    busy = server.async_engine.call(lambda engine: time.sleep(3.0))
    prompt = {"prompt": [1, 2, 3]} if route == COMPLETIONS else {"messages": [MESSAGE]}
    body = {**prompt, "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    with pytest.raises(httpx.ReadTimeout):
        with server.http.stream("POST", route, json=body, timeout=0.5):
            pass
    assert not busy.done()  # engagement: the client left before the engine could admit it
    busy.result(timeout=30)
    # Asked after a step has run (a call waits for the steps before it): an admitted request
    # would still be unfinished, waiting or running, 900 tokens from its end.
    server.async_engine.submit([[1]], [SamplingParams(max_tokens=1)]).result(timeout=30)
    unfinished = server.async_engine.call(lambda engine: engine.has_unfinished())
    assert not unfinished.result(timeout=30)


@pytest.mark.parametrize("route", [COMPLETIONS, "/v1/chat/completions"])
def test_client_leaving_a_whole_completion_aborts_its_request(server, route):
    """Not streamed: the client gives up (a read timeout closes its connection) long before
    900 tokens; the request is aborted instead of running on for nobody."""
    prompt = {"prompt": [1, 2, 3]} if route == COMPLETIONS else {"messages": [MESSAGE]}
    body = {**prompt, "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    left = f"moe_http_requests_total{{route={route},status=499}}"
    left_before = scrape(server).get(left, 0)
    with pytest.raises(httpx.ReadTimeout):
        server.http.post(route, json=body, timeout=1.0)
    deadline = time.monotonic() + 20
    while num_running(server.async_engine):
        assert time.monotonic() < deadline, "the request kept running after its client left"
        time.sleep(0.01)
    assert scrape(server).get(left, 0) == left_before + 1


def test_openai_client_streams(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    target = TARGETS[1]
    stream = client.completions.create(
        model=server.model,
        prompt=target["prompt"],
        max_tokens=target["max_tokens"],
        temperature=target["temperature"],
        top_p=target["top_p"],
        seed=target["seed"],
        logprobs=5,
        stream=True,
        extra_body={"top_k": target["top_k"], "ignore_eos": True},
    )
    chunks = [chunk.model_dump() for chunk in stream]
    (choice,) = merge_completion_chunks(chunks).values()
    whole = post(server.http, target).json()["choices"][0]
    assert http_fingerprint(choice) == http_fingerprint(whole)


def test_usage_chunk_carries_the_weight_version(server):
    """Every response carries `weight_version`; a stream's usage chunk is one of its chunks."""
    body = {"prompt": "ab", "n": 2, "max_tokens": 2, "stream_options": {"include_usage": True}}
    whole = post(server.http, {"prompt": "ab", "n": 2, "max_tokens": 2}).json()
    chunks = sse_events(server.http, COMPLETIONS, body)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert [c["weight_version"] for c in chunks] == [whole["weight_version"]] * len(chunks)
    firsts = [c["first_weight_version"] for c in chunks]  # no update while they ran
    assert (
        firsts
        == [whole["first_weight_version"]] * len(chunks)
        == [whole["weight_version"]] * len(chunks)
    )


def test_usage_chunk_names_the_oldest_first_weight_version():
    """A stream over two prompts, one begun at version 0 and one at version 1: the usage chunk
    said 1 (version 0 was read as unset), telling the client the whole response was version
    1's."""
    from concurrent.futures import Future

    from launch.generation import _END, Generation
    from moe_runtime.engine.outputs import CompletionOutput, RequestOutput

    def delta(first: int, last: int) -> RequestOutput:
        sample = CompletionOutput(0, [3], [0.0], [{}], "x", "length", 0)
        return RequestOutput("r", [1, 2], [sample], True, last, first)

    async def events() -> list[str]:
        generation = Generation.__new__(Generation)  # its stream alone, fed by hand
        generation._queue = asyncio.Queue()
        generation._first = (0, delta(0, 1))
        generation._queue.put_nowait((1, delta(1, 1)))
        generation._queue.put_nowait(_END)
        generation.future = Future()
        generation.future.set_result(None)
        return [e async for e in generation._events({}, lambda i, d: [{"index": i}], True)]

    chunks = [json.loads(e[len("data: ") :]) for e in asyncio.run(events()) if "{" in e]
    assert [c["first_weight_version"] for c in chunks] == [0, 1, 0], chunks
    assert chunks[-1]["weight_version"] == 1 and "usage" in chunks[-1]
