"""Admin routes: POST /admin/rebalance and POST /admin/update_weights.

Both run on the engine loop thread between two steps (EngineLoop.call), so they never overlap
a step; requests in flight continue afterwards. A rebalance answers with the engine's report
as JSON; a weight update with the new `weight_version`. Failures answer with an error naming
the problem and leave the server serving.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from launch.protocol import ExactJSONResponse, UpdateWeightsRequest, error, refusal
from moe_runtime.engine_loop import EngineUnavailableError


def add_admin_routes(app: FastAPI) -> None:
    @app.post("/admin/rebalance")
    async def rebalance(request: Request) -> JSONResponse:
        return await _on_loop(request, lambda engine: engine.rebalance(), None)

    @app.post("/admin/update_weights")
    async def update_weights(body: UpdateWeightsRequest, request: Request) -> JSONResponse:
        def update(engine) -> dict:
            return {"weight_version": engine.update_weights(body.path)}

        return await _on_loop(request, update, "path")


async def _on_loop(request: Request, fn, param: str | None) -> JSONResponse:
    loop = request.app.state.engine_loop
    refused = refusal(loop)
    if refused is not None:
        return refused
    try:
        result = await asyncio.wrap_future(loop.call(fn))
    except EngineUnavailableError as exc:
        return error(503, str(exc), None, "unavailable")
    except (ValueError, FileNotFoundError) as exc:
        return error(400, f"{param or 'request'}: {exc}", param)
    except Exception as exc:
        return error(500, f"{type(exc).__name__}: {exc}", None, "internal_error")
    return ExactJSONResponse(result)
