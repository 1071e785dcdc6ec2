"""The OpenAI-compatible HTTP app: `create_app` and the small routes.

Routes: POST /v1/completions (launch.routes_completions), POST /v1/chat/completions
(launch.routes_chat), POST /admin/rebalance and /admin/update_weights (launch.routes_admin),
GET /v1/models, GET /health, GET /metrics (Prometheus, launch.metrics). Handlers are async and
await the AsyncEngine's Futures, so concurrent clients share the engine's batches; the results
do not depend on that sharing (the runtime is batch-invariant). The app serves
`app.state.backend` (a launch.generation.Backend), None (503s) until the engine is ready.
With `server.api_key` set, every route but /health and /metrics needs `Authorization: Bearer`.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from launch.generation import Backend
from launch.metrics import CONTENT_TYPE, ServerMetrics
from launch.openai.errors import AuthenticationError, error_response
from launch.openai.render import ExactJSONResponse
from launch.routes_admin import add_admin_routes
from launch.routes_chat import add_chat_routes
from launch.routes_completions import add_completion_routes
from moe_runtime.config import RuntimeConfig

OPEN_PATHS = ("/health", "/metrics")


def create_app(config: RuntimeConfig, backend: Backend | None = None) -> FastAPI:
    app = FastAPI(title="moe-runtime", default_response_class=ExactJSONResponse)
    app.state.backend = backend

    def engine_stats():
        current = app.state.backend
        return None if current is None else current.engine.stats()

    metrics = ServerMetrics(engine_stats)
    app.state.metrics = metrics

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
    async def health(request: Request) -> Response:
        backend = request.app.state.backend
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

    add_completion_routes(app, config, metrics)
    add_chat_routes(app, config, metrics)
    add_admin_routes(app)
    return app
