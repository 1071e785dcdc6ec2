"""The OpenAI-compatible HTTP app: `create_app`, its route table and the small routes.

Routes: POST /v1/completions and /v1/chat/completions (launch.completions), POST
/admin/rebalance (optional body {"force": bool}) and /admin/update_weights (on the engine
thread between two steps), GET /v1/models and /v1/models/{model}, GET /health, GET /metrics
(Prometheus, launch.metrics). Handlers await the AsyncEngine's Futures, so concurrent clients
share the engine's batches; the results do not depend on that sharing (the runtime is
batch-invariant). The app serves `app.state.backend` (launch.generation.Backend), None (503s)
until the engine is ready. Errors answer through launch.openai.errors. With `server.api_key`
set, every route but /health and /metrics needs `Authorization: Bearer <key>` (the scheme in
any case). Every response, errors, 401s and unknown paths included, is counted in
`moe_http_requests_total{route, status}` (route: the path of the route the request's path
matches, else "unmatched").
A client that leaves before its completion's answer is ready has the answer cancelled (its
requests aborted, 499 counted); a stream's own response aborts it once streaming.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from launch.completions import chat, complete
from launch.generation import Backend, ready
from launch.metrics import CONTENT_TYPE, ServerMetrics
from launch.openai.chat_schemas import ChatCompletionRequest
from launch.openai.errors import (
    AuthenticationError,
    FieldError,
    UnknownModelError,
    answer,
    error_response,
)
from launch.openai.render import ExactJSONResponse
from launch.openai.schemas import CompletionRequest, RebalanceRequest, UpdateWeightsRequest
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine import LLMEngine

OPEN_PATHS = ("/health", "/metrics")
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


# No body (or an empty one) is the defaults; JSON null or anything not an object is a 400.
OptionalRebalanceBody = Annotated[RebalanceRequest, Body(default_factory=RebalanceRequest)]


def create_app(config: RuntimeConfig, backend: Backend | None = None) -> FastAPI:
    app = FastAPI(title="moe-runtime", default_response_class=ExactJSONResponse)
    app.state.backend = backend
    # First, so that it runs inside the API-key check (middleware added later wraps it): a
    # client without the key is refused before its body is read.
    app.add_middleware(
        _LimitBody,
        max_bytes=config.server.max_request_bytes,
        max_containers=config.server.max_request_json_containers,
    )

    def engine_stats():
        current = app.state.backend
        return None if current is None else current.engine.stats()

    metrics = ServerMetrics(engine_stats)

    @app.exception_handler(RequestValidationError)
    @app.exception_handler(HTTPException)  # no such route or method, a body that is not UTF-8
    async def _invalid(_request: Request, exc: Exception) -> Response:
        return error_response(exc)

    if config.server.api_key:
        expected = config.server.api_key.encode()

        @app.middleware("http")
        async def _check_api_key(request: Request, call_next):
            if request.url.path in OPEN_PATHS:
                return await call_next(request)
            # RFC 7235: the scheme is case-insensitive, the credentials are not
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            is_bearer = scheme.lower() == "bearer"
            if not (hmac.compare_digest(given.lstrip(" ").encode(), expected) and is_bearer):
                return error_response(AuthenticationError("missing or wrong API key"))
            return await call_next(request)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: probes that read the status only
    async def health() -> Response:
        backend = app.state.backend
        if backend is None:
            return ExactJSONResponse({"status": "loading"}, status_code=503)
        engine = backend.engine
        if not engine.is_healthy:  # dead, rebuilding, or draining (no error of its own)
            error = engine.error or "the server is shutting down: it takes no new requests"
            return ExactJSONResponse({"status": "unavailable", "error": error}, 503)
        stalled = engine.stalled  # a rank silent inside a step or call: requests wait on it
        if stalled is not None:
            return ExactJSONResponse({"status": "stalled", "error": stalled}, 503)
        dead = engine.dead_ranks  # died since the last step or check: the next request fails
        if dead:
            error = f"ranks {dead} died; the engine rebuilds them before its next step"
            return ExactJSONResponse({"status": "unavailable", "error": error}, 503)
        stats = engine.stats()
        counts = {"num_running": stats.num_running, "num_waiting": stats.num_waiting}
        return ExactJSONResponse({"status": "ok", **counts})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if app.state.backend is not None:
            await metrics.refresh_rank_stats(app.state.backend.engine)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    card = {
        "id": config.server.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "moe-runtime",
        "max_model_len": config.scheduler.max_model_len,
    }

    @app.get("/v1/models")
    async def models() -> Response:
        return ExactJSONResponse({"object": "list", "data": [card]})

    @app.get("/v1/models/{model:path}")  # a model id may hold a slash ("org/name")
    async def model(model: str) -> Response:
        if model != card["id"]:
            return error_response(UnknownModelError(model))
        return ExactJSONResponse(card)

    _add_post_routes(app, config, metrics)
    for route in app.routes:  # a series per route from the first scrape on (at 0)
        if isinstance(route, APIRoute):
            metrics.requests.labels(route.path, "200")
    app.add_middleware(_CountResponses, metrics=metrics, router=app.router)  # sees the 401s
    return app


class _LimitBody:
    """ASGI middleware reading a request's whole body before the app does, answering 413 (and
    running nothing) past max_bytes: by its content-length at once, else as it arrives; and
    where the whole body opens more than max_containers JSON arrays and objects
    (json_containers). Why: a 50 MB prompt was parsed, encoded and checked token by token
    before being refused as too long, holding the engine's thread and other streams for
    seconds; millions of small lists under the byte limit took as long to parse and validate
    (moe_runtime/config.py's server.max_request_json_containers says why)."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_containers: int) -> None:
        self.app, self.max_bytes, self.max_containers = app, max_bytes, max_containers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nothing to answer
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body", False):
                break
        body: bytes | None = b"".join(chunks)
        chunks.clear()
        if json_containers(body, self.max_containers) > self.max_containers:
            return await self._refuse(
                scope,
                receive,
                send,
                f"the request body opens more JSON arrays and objects than "
                f"server.max_request_json_containers={self.max_containers}",
            )

        async def replay() -> dict:
            nonlocal body
            if body is None:
                return await receive()  # what follows the body: the client leaving
            message = {"type": "http.request", "body": body, "more_body": False}
            body = None  # held by the app now, not twice
            return message

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, why: str = "") -> None:
        why = why or f"the request body is larger than server.max_request_bytes={self.max_bytes}"
        await error_response(HTTPException(413, why))(scope, receive, send)


# A JSON string: its quotes and what they hold, escapes included (the unrolled form: no
# backtracking).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_containers(body: bytes, most: int) -> int:
    """The arrays and objects a JSON body opens ('[' and '{' outside its strings), counted
    exactly only where the bytes hold more than `most` of the two brackets together (a count
    in C first, ~10 ms for 32 MiB; strings left out after, <= 0.7 s), so a text prompt full of
    brackets is not refused for them. A malformed body (a string left open) may count high:
    it is no request either."""
    quick = body.count(b"[") + body.count(b"{")
    if quick <= most:
        return quick
    outside = _JSON_STRING.sub(b"", body)
    return outside.count(b"[") + outside.count(b"{")


class _CountResponses:
    """ASGI middleware counting each response's status as it starts (streams included), under
    the route the request's path matches: the router's choice, or, for a response given before
    routing (a 401), the route the router would have chosen."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, router: Router) -> None:
        self.app, self.metrics, self.router = app, metrics, router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route") or _matching_route(self.router, scope)
                self.metrics.count(getattr(route, "path", "unmatched"), message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


def _matching_route(router: Router, scope: Scope) -> BaseRoute | None:
    """The route `router` hands `scope` to: the first full match (path and method), else the
    first partial one (the path only: a 405), else None."""
    matches = [(route, route.matches(scope)[0]) for route in router.routes]
    full = [route for route, match in matches if match is Match.FULL]
    partial = [route for route, match in matches if match is Match.PARTIAL]
    return next(iter(full + partial), None)


async def unless_disconnected(request: Request, response: Awaitable[Response]) -> Response:
    """The awaited response, or, if the client leaves first, nothing for it: the response is
    cancelled (cancelling a Generation's wait aborts its requests) and a 499 closes the
    exchange. Why: a whole (not streamed) completion would otherwise run to max_tokens for
    nobody, taking batch slots and KV blocks from the clients still waiting."""
    answer_task = asyncio.ensure_future(answer(response))
    left = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({answer_task, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not answer_task.done():  # the client left (or this handler was cancelled itself)
            answer_task.cancel()
    if answer_task.done() and not answer_task.cancelled():
        return answer_task.result()
    return Response(status_code=499)


async def _until_disconnected(request: Request) -> None:
    # The body is read already: the next message is the client leaving (or never comes).
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _add_post_routes(app: FastAPI, config: RuntimeConfig, metrics: ServerMetrics) -> None:
    @app.post(COMPLETIONS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        received = time.monotonic()  # its time to first token counts from here
        completion = complete(body, app.state.backend, config, metrics, received)
        return await unless_disconnected(request, completion)

    @app.post(CHAT)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        received = time.monotonic()
        completion = chat(body, app.state.backend, config, metrics, received)
        return await unless_disconnected(request, completion)

    async def on_engine(fn: Callable[[LLMEngine], dict]) -> Response:
        # on the engine thread between two steps: never during one; requests in flight go on
        engine = ready(app.state.backend).engine
        return ExactJSONResponse(await asyncio.wrap_future(engine.call(fn)))

    @app.post("/admin/rebalance")
    async def rebalance(body: OptionalRebalanceBody) -> Response:
        return await answer(on_engine(lambda engine: engine.rebalance(force=body.force)))

    @app.post("/admin/update_weights")
    async def update_weights(body: UpdateWeightsRequest) -> Response:
        def update(engine: LLMEngine) -> dict:
            try:
                return {"weight_version": engine.update_weights(body.path)}
            except ValueError as exc:  # refused on every rank before anything changed
                raise FieldError("path", f"path: {exc}") from None

        return await answer(on_engine(update))
