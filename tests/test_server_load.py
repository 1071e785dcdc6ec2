"""A quick version of bench/serve_load.py: good and bad requests mixed under concurrency.

Every good request (completions, streamed completions, chat) must be answered in full, every
bad one must be a 400, and the server must stay healthy; a whole response being rendered holds
no other request.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

import launch.completions
from bench.serve_load import make_requests, run_load
from launch.openai.render import dumps, dumps_by_item
from tests.serving import running_server


def test_mixed_load_loses_nothing():
    requests = make_requests(120, bad_fraction=0.3, max_tokens=8, seed=1)
    with running_server() as server:
        report = asyncio.run(run_load(server.url, requests, concurrency=32))
        assert server.http.get("/health").status_code == 200
    assert report["num_answered"] == len(requests)
    assert report["num_failures"] == 0, report["failures"]
    assert report["num_bad"] > 20 and report["num_good"] > 60


def test_other_requests_are_answered_while_a_whole_response_is_rendered(monkeypatch):
    """A whole (not streamed) body of many samples with logprobs takes seconds to build and
    encode (11 MB for 512 samples x 30 tokens x 20 logprobs); built on the event loop, it held
    every stream's chunks and /health meanwhile. Here its rendering waits until /health has
    answered: on the event loop that wait held /health until its client gave up."""
    rendering, answered = threading.Event(), threading.Event()
    render_choice = launch.completions.completion_choice

    def held_choice(*args, **kwargs):
        if not rendering.is_set():
            rendering.set()
            answered.wait(timeout=60)
        return render_choice(*args, **kwargs)

    monkeypatch.setattr(launch.completions, "completion_choice", held_choice)
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "logprobs": 2}
    with running_server() as server, ThreadPoolExecutor(1) as pool:
        whole = pool.submit(server.http.post, "/v1/completions", json=body)
        assert rendering.wait(timeout=60)
        try:
            health = server.http.get("/health", timeout=20)
        finally:
            answered.set()
        assert health.status_code == 200
        response = whole.result(timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    (choice,) = response.json()["choices"]
    assert len(choice["token_ids"]) == 4 and len(choice["logprobs"]["token_logprobs"]) == 4


def test_a_body_encoded_by_item_is_the_same_text():
    body = {
        "id": "x",
        "choices": [{"text": "a\u00e9\n", "lp": [-0.1, float("-inf")]}, {"n": None}],
        "usage": {"prompt_tokens": 3},
        "weight_version": 0,
    }
    assert dumps_by_item(body, "choices") == dumps(body)
    assert dumps_by_item({**body, "choices": []}, "choices") == dumps({**body, "choices": []})


def test_a_body_of_millions_of_prompts_under_the_byte_limit_holds_no_other_request():
    """A 29 MB body (under the 32 MiB server.max_request_bytes) of 6 million one-token prompts
    was refused (more than server.max_sequences_per_request) only after JSON parsing and
    pydantic validation of its 6 million lists on the event loop, holding the GIL: every
    stream got no token and /health no answer for 7 s on a 2-core machine (a load balancer's
    probe timed out over a healthy server). Now its brackets are counted first, a 413."""
    body = json.dumps({"prompt": [[1]] * 6_000_000, "max_tokens": 1}).encode()
    assert len(body) < 32 * 1024 * 1024
    with running_server() as server:
        latencies: list[float] = []
        done = threading.Event()

        def probe() -> None:
            with httpx.Client(base_url=server.url, timeout=60) as client:
                while not done.is_set():
                    started = time.monotonic()
                    assert client.get("/health").status_code == 200
                    latencies.append(time.monotonic() - started)
                    time.sleep(0.02)

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        time.sleep(0.3)
        headers = {"content-type": "application/json"}
        response = server.http.post("/v1/completions", content=body, headers=headers)
        done.set()
        prober.join(timeout=60)
    assert response.status_code == 413, response.text
    assert "server.max_request_json_containers=262144" in response.json()["error"]["message"]
    assert len(latencies) >= 5  # engagement: /health was probed while the body was handled
    assert max(latencies) < 1.0, f"/health waited {max(latencies):.1f}s behind one request body"
