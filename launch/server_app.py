"""The OpenAI-compatible HTTP app: `create_app`, its route table and the small routes.

Routes: POST /v1/completions and /v1/chat/completions (launch.completions), POST
/admin/rebalance and /admin/update_weights (on the engine thread between two steps), GET
/v1/models, GET /health, GET /metrics (Prometheus, launch.metrics). Handlers await the
AsyncEngine's Futures, so concurrent clients share the engine's batches; the results do not
depend on that sharing (the runtime is batch-invariant). The app serves `app.state.backend`
(launch.generation.Backend), None (503s) until the engine is ready. Errors answer through
launch.openai.errors. With `server.api_key` set, every route but /health and /metrics needs
`Authorization: Bearer`.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from launch.completions import chat, complete
from launch.generation import Backend, ready
from launch.metrics import CONTENT_TYPE, ServerMetrics
from launch.openai.errors import AuthenticationError, FieldError, answer, error_response
from launch.openai.render import ExactJSONResponse
from launch.openai.schemas import ChatCompletionRequest, CompletionRequest, UpdateWeightsRequest
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine import LLMEngine

OPEN_PATHS = ("/health", "/metrics")
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def create_app(config: RuntimeConfig, backend: Backend | None = None) -> FastAPI:
    app = FastAPI(title="moe-runtime", default_response_class=ExactJSONResponse)
    app.state.backend = backend

    def engine_stats():
        current = app.state.backend
        return None if current is None else current.engine.stats()

    metrics = ServerMetrics(engine_stats)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        response = error_response(exc)
        metrics.count(request.url.path, response.status_code)
        return response

    if config.server.api_key:
        expected = f"Bearer {config.server.api_key}".encode()

        @app.middleware("http")
        async def _check_api_key(request: Request, call_next):
            if request.url.path in OPEN_PATHS:
                return await call_next(request)
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return error_response(AuthenticationError("missing or wrong API key"))
            return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        backend = app.state.backend
        if backend is None:
            return ExactJSONResponse({"status": "loading"}, status_code=503)
        engine = backend.engine
        if not engine.is_healthy:
            return ExactJSONResponse({"status": "unavailable", "error": engine.error}, 503)
        stats = engine.stats()
        counts = {"num_running": stats.num_running, "num_waiting": stats.num_waiting}
        return ExactJSONResponse({"status": "ok", **counts})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        card = {
            "id": config.server.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "moe-runtime",
            "max_model_len": config.scheduler.max_model_len,
        }
        return ExactJSONResponse({"object": "list", "data": [card]})

    _add_post_routes(app, config, metrics)
    return app


def _add_post_routes(app: FastAPI, config: RuntimeConfig, metrics: ServerMetrics) -> None:
    async def counted(route: str, response: Awaitable[Response]) -> Response:
        response = await answer(response)
        metrics.count(route, response.status_code)
        return response

    @app.post(COMPLETIONS)
    async def completions(body: CompletionRequest) -> Response:
        return await counted(COMPLETIONS, complete(body, app.state.backend, config, metrics))

    @app.post(CHAT)
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        return await counted(CHAT, chat(body, app.state.backend, config, metrics))

    async def on_engine(fn: Callable[[LLMEngine], dict]) -> Response:
        # on the engine thread between two steps: never during one; requests in flight go on
        engine = ready(app.state.backend).engine
        return ExactJSONResponse(await asyncio.wrap_future(engine.call(fn)))

    @app.post("/admin/rebalance")
    async def rebalance() -> Response:
        return await answer(on_engine(lambda engine: engine.rebalance()))

    @app.post("/admin/update_weights")
    async def update_weights(body: UpdateWeightsRequest) -> Response:
        def update(engine: LLMEngine) -> dict:
            try:
                return {"weight_version": engine.update_weights(body.path)}
            except ValueError as exc:  # refused on every rank before anything changed
                raise FieldError("path", f"path: {exc}") from None

        return await answer(on_engine(update))
