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
