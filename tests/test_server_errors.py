"""The one exception -> HTTP error map (launch/openai/errors.py): by type, for every route."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.exceptions import HTTPException

from launch.openai.errors import (
    AuthenticationError,
    ContextLengthExceeded,
    FieldError,
    UnknownModelError,
    error_body,
    error_response,
)
from launch.server_app import create_app
from moe_runtime.config import load_config
from moe_runtime.engine.async_engine import EngineUnavailableError
from moe_runtime.engine.balancer import RebalanceError
from moe_runtime.executor import WorkerError
from tests.invariance import TINY_CONFIG


@pytest.mark.parametrize(
    ("exc", "status", "kind", "param", "code"),
    [
        (
            FieldError("messages", "messages: prompt is empty"),
            400,
            "invalid_request_error",
            "messages",
            None,
        ),
        (ValueError("prompt is empty"), 400, "invalid_request_error", None, None),  # no words
        # OpenAI's type and codes for these, which clients key on (they were null)
        (UnknownModelError("other"), 404, "invalid_request_error", "model", "model_not_found"),
        (
            AuthenticationError("wrong API key"),
            401,
            "authentication_error",
            None,
            "invalid_api_key",
        ),
        (EngineUnavailableError("the engine is dead"), 503, "unavailable", None, None),
        # every rank refused the move: nothing changed, the old placement serves
        (
            RebalanceError("a rank failed while moving experts; the old placement is in use"),
            409,
            "conflict_error",
            None,
            "rebalance_refused",
        ),
        (WorkerError("rank 1 failed"), 500, "internal_error", None, None),
        (RuntimeError("invalid prompt token"), 500, "internal_error", None, None),
        (HTTPException(405, "Method Not Allowed"), 405, "invalid_request_error", None, None),
    ],
)
def test_status_by_exception_type(exc, status, kind, param, code):
    """The status is the response's; the body's `code` is OpenAI's, a string or null, never
    the status."""
    response = error_response(exc)
    error = json.loads(response.body)["error"]
    assert response.status_code == status
    assert (error["code"], error["type"], error["param"]) == (code, kind, param)
    assert str(exc.detail if isinstance(exc, HTTPException) else exc) in error["message"]


def test_the_context_length_error_has_its_openai_code():
    exceeded = ContextLengthExceeded("max_tokens", "This model's maximum context length is 8")
    error = error_body(exceeded)["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")
    assert error["message"] == "This model's maximum context length is 8"
    assert error_response(exceeded).status_code == 400


def test_every_engine_route_is_503_while_loading():
    app = create_app(load_config(TINY_CONFIG))
    requests = [
        ("POST", "/v1/completions", {"prompt": "a"}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
        ("POST", "/admin/rebalance", None),
        ("POST", "/admin/update_weights", {"path": "/x"}),
        ("GET", "/health", None),
    ]

    async def send() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.request(m, path, json=body) for m, path, body in requests]

    responses = asyncio.run(send())
    assert [r.status_code for r in responses] == [503] * len(requests)
    assert all(r.json()["error"]["type"] == "unavailable" for r in responses[:-1])
    assert responses[-1].json() == {"status": "loading"}


def _post_completions(app, bodies: list) -> list[httpx.Response]:
    """Each body (bytes, or an async iterator: sent chunked) POSTed to /v1/completions in
    turn, in process."""

    async def send() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        headers = {"content-type": "application/json"}
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [
                await client.post("/v1/completions", content=body, headers=headers)
                for body in bodies
            ]

    return asyncio.run(send())


def test_a_body_past_max_request_bytes_is_a_413_and_runs_nothing():
    """By its content-length, or counted as it comes (chunked); one byte under the limit goes
    on to the route (a 503 here: no engine). A 50 MB prompt was encoded and checked token by
    token on the engine's thread before its 400, stalling every stream for seconds."""
    app = create_app(load_config(TINY_CONFIG, {"server.max_request_bytes": 64}))
    under = json.dumps({"prompt": "a" * 30}).encode()
    over = json.dumps({"prompt": "a" * 60}).encode()
    assert len(under) <= 64 < len(over)

    async def chunked(data: bytes):
        for i in range(0, len(data), 10):
            yield data[i : i + 10]

    responses = _post_completions(app, [over, chunked(over), under, chunked(under)])
    assert [r.status_code for r in responses] == [413, 413, 503, 503]
    error = responses[0].json()["error"]
    assert error["message"] == ("the request body is larger than server.max_request_bytes=64"), (
        error
    )
    assert responses[1].json() == responses[0].json()


def test_max_request_bytes_is_validated():
    with pytest.raises(ValueError, match="server.max_request_bytes must be an int >= 1, got 0"):
        load_config(TINY_CONFIG, {"server.max_request_bytes": 0})
    with pytest.raises(ValueError, match="server.max_request_json_containers must be an int >= 1"):
        load_config(TINY_CONFIG, {"server.max_request_json_containers": 0})


def test_a_body_opening_more_json_containers_than_the_limit_is_a_413_and_runs_nothing():
    """Arrays and objects outside strings count, brackets inside a string do not (a text
    prompt of them goes on to the route: a 503 here, no engine). A body of 6 million one-token
    prompts under the byte limit was parsed and validated for 9 s on the event loop
    (test_server_load has the live server's case)."""
    app = create_app(load_config(TINY_CONFIG, {"server.max_request_json_containers": 8}))
    eight = json.dumps({"prompt": [[1]] * 6}).encode()  # the outer object, its list, 6 prompts
    nine = json.dumps({"prompt": [[1]] * 7}).encode()
    text = json.dumps({"prompt": '[{"a": [1]}]' * 20 + '\\"[[\\"'}).encode()
    assert text.count(b"[") + text.count(b"{") > 8  # the exact count runs (it is 1)

    responses = _post_completions(app, [nine, eight, text])
    assert [r.status_code for r in responses] == [413, 503, 503]
    assert responses[0].json()["error"]["message"] == (
        "the request body opens more JSON arrays and objects than "
        "server.max_request_json_containers=8"
    )


def test_a_client_without_the_key_is_refused_before_its_body_is_read():
    """The body limit runs inside the API-key check: a keyless client gets its 401 without
    the server buffering its body (up to server.max_request_bytes each, before)."""
    config = load_config(TINY_CONFIG, {"server.max_request_bytes": 64, "server.api_key": "secret"})
    app = create_app(config)
    over = json.dumps({"prompt": "a" * 100}).encode()

    async def send() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        headers = {"content-type": "application/json"}
        keyed = {**headers, "authorization": "Bearer secret"}
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [
                (await client.post("/v1/completions", content=over, headers=h)).status_code
                for h in (headers, keyed)
            ]

    assert asyncio.run(send()) == [401, 413]
