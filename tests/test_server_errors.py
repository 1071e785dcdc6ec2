"""The one exception -> HTTP error map (launch/openai/errors.py): by type, for every route."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from launch.openai.errors import FieldError, UnknownModelError, error_body
from launch.server_app import create_app
from moe_runtime.config import load_config
from moe_runtime.engine.async_engine import EngineUnavailableError
from moe_runtime.executor import WorkerError
from tests.invariance import TINY_CONFIG


@pytest.mark.parametrize(
    ("exc", "code", "kind", "param"),
    [
        (
            FieldError("messages", "messages: prompt is empty"),
            400,
            "invalid_request_error",
            "messages",
        ),
        (ValueError("prompt is empty"), 400, "invalid_request_error", None),  # no word matching
        (UnknownModelError("other"), 404, "not_found_error", "model"),
        (EngineUnavailableError("the engine is dead"), 503, "unavailable", None),
        (WorkerError("rank 1 failed"), 500, "internal_error", None),
        (RuntimeError("invalid prompt token"), 500, "internal_error", None),
    ],
)
def test_status_by_exception_type(exc, code, kind, param):
    error = error_body(exc)["error"]
    assert (error["code"], error["type"], error["param"]) == (code, kind, param)
    assert str(exc) in error["message"]


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
