"""The OpenAI-compatible HTTP app over an EngineLoop: `create_app` and the small routes.

Routes: POST /v1/completions (launch.routes_completions), POST /v1/chat/completions
(launch.routes_chat), POST /admin/rebalance and /admin/update_weights (launch.routes_admin),
GET /v1/models, GET /health, GET /metrics (Prometheus, launch.metrics). Handlers are async and
await the loop's Futures, so concurrent clients share the engine's batches; the results do not
depend on that sharing (the runtime is batch-invariant). Floats are written by Python's json
(shortest repr, -Infinity allowed), so every logprob reaches the client with its exact bits.
With `server.api_key` set, every route but /health and /metrics needs `Authorization: Bearer`.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from launch.metrics import CONTENT_TYPE, ServerMetrics
from launch.protocol import ExactJSONResponse, describe_validation, error
from launch.routes_admin import add_admin_routes
from launch.routes_chat import add_chat_routes
from launch.routes_completions import add_completion_routes
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine_loop import EngineLoop

OPEN_PATHS = ("/health", "/metrics")


def create_app(loop: EngineLoop | None, config: RuntimeConfig, tokenizer) -> FastAPI:
    """The app; `app.state.engine_loop` may be None (503s) until the engine is ready."""
    app = FastAPI(title="moe-runtime", default_response_class=ExactJSONResponse)
    app.state.engine_loop = loop
    model_name = config.server.model_name

    def loop_stats():
        current = app.state.engine_loop
        return None if current is None else current.stats()

    metrics = ServerMetrics(loop_stats)
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.requests.labels(request.url.path, "400").inc()
        return error(400, *describe_validation(exc.errors()))

    if config.server.api_key:
        expected = f"Bearer {config.server.api_key}".encode()

        @app.middleware("http")
        async def _check_api_key(request: Request, call_next):
            if request.url.path in OPEN_PATHS:
                return await call_next(request)
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return error(401, "missing or wrong API key", None, "authentication_error")
            return await call_next(request)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        loop = request.app.state.engine_loop
        if loop is None:
            return ExactJSONResponse({"status": "loading"}, status_code=503)
        if not loop.is_healthy:
            return ExactJSONResponse({"status": "unavailable", "error": loop.error}, 503)
        counts = {"num_running": loop.num_running, "num_waiting": loop.num_waiting}
        return ExactJSONResponse({"status": "ok", **counts})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "moe-runtime",
            "max_model_len": config.scheduler.max_model_len,
        }
        return ExactJSONResponse({"object": "list", "data": [card]})

    add_completion_routes(app, config, tokenizer, metrics)
    add_chat_routes(app, config, tokenizer, metrics)
    add_admin_routes(app)
    return app
