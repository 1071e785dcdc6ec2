"""Admin routes: POST /admin/rebalance and POST /admin/update_weights.

Both run on the engine thread between two steps (AsyncEngine.call), so they never overlap a
step; requests in flight continue afterwards. A rebalance answers with the engine's report as
JSON; a weight update with the new `weight_version`. Failures answer through the one error map
(launch.openai.errors) and leave the server serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from launch.generation import ready
from launch.openai.errors import FieldError, answer
from launch.openai.render import ExactJSONResponse
from launch.openai.schemas import UpdateWeightsRequest
from moe_runtime.engine import LLMEngine


def add_admin_routes(app: FastAPI) -> None:
    @app.post("/admin/rebalance")
    async def rebalance(request: Request) -> Response:
        return await answer(_on_engine(request, lambda engine: engine.rebalance()))

    @app.post("/admin/update_weights")
    async def update_weights(body: UpdateWeightsRequest, request: Request) -> Response:
        def update(engine: LLMEngine) -> dict:
            try:
                return {"weight_version": engine.update_weights(body.path)}
            except ValueError as exc:  # refused on every rank before anything changed
                raise FieldError("path", f"path: {exc}") from None

        return await answer(_on_engine(request, update))


async def _on_engine(request: Request, fn: Callable[[LLMEngine], dict]) -> Response:
    engine = ready(request.app.state.backend).engine
    return ExactJSONResponse(await asyncio.wrap_future(engine.call(fn)))
