"""POST /v1/completions: whole responses and SSE streams in OpenAI's text_completion format.

Each choice carries the non-standard `token_ids` (and `routed_experts` when asked), and with
`logprobs` the OpenAI fields plus the exact `top_logprob_ids` (launch.openai.render). A
streamed choice sends each step's new tokens as they are sampled, the same bits as the whole
response's. Choice index is `prompt_idx * n + sample_idx`. Responses carry the non-standard
`weight_version`.
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from launch.generation import Backend, Generation, ready, sse_stream
from launch.metrics import ServerMetrics
from launch.openai.errors import FieldError, answer
from launch.openai.render import ExactJSONResponse, completion_choice, usage
from launch.openai.schemas import CompletionRequest
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.outputs import CompletionOutput, RequestOutput

DEFAULT_MAX_TOKENS = 16
ROUTE = "/v1/completions"


def add_completion_routes(app: FastAPI, config: RuntimeConfig, metrics: ServerMetrics) -> None:
    model_name = config.server.model_name

    @app.post(ROUTE)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        response = await answer(_complete(body, request.app.state.backend, model_name, metrics))
        metrics.count(ROUTE, response.status_code)
        return response


async def _complete(
    body: CompletionRequest, backend: Backend | None, model_name: str, metrics: ServerMetrics
) -> Response:
    backend = ready(backend)
    body.check_model(model_name)
    prompts, params = body.prompts(), body.sampling_params(DEFAULT_MAX_TOKENS)
    generation = Generation(backend.engine, prompts, [params] * len(prompts), metrics)
    try:
        outputs = await (generation.started() if body.stream else generation.result())
    except ValueError as exc:  # the engine's prompt checks
        raise FieldError("prompt", str(exc)) from None
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
    }
    render = _Choices(body, prompts, backend.tokenizer)
    if body.stream:
        chunks = sse_stream(generation, head, render.streamed, body.include_usage)
        return StreamingResponse(chunks, media_type="text/event-stream")
    num_in = sum(len(whole.prompt_token_ids) for whole in outputs)
    num_out = sum(len(out.token_ids) for whole in outputs for out in whole.outputs)
    return ExactJSONResponse(
        {
            **head,
            "choices": render.whole(outputs),
            "usage": usage(num_in, num_out),
            "weight_version": max(whole.weight_version for whole in outputs),
        }
    )


class _Choices:
    """The choices of one request, whole or a delta at a time (text offsets carried on)."""

    def __init__(self, body: CompletionRequest, prompts: list, tokenizer) -> None:
        self._body, self._prompts, self._tokenizer = body, prompts, tokenizer
        self._with_logprobs = body.logprobs is not None
        self._offsets: dict[int, int] = {}  # choice index -> text offset of its next token

    def whole(self, outputs: list[RequestOutput]) -> list[dict]:
        return [self._choice(i, req, out) for i, req in enumerate(outputs) for out in req.outputs]

    def streamed(self, prompt_idx: int, delta: RequestOutput) -> list[dict]:
        return [self._choice(prompt_idx, delta, out) for out in delta.outputs]

    def _choice(self, prompt_idx: int, output: RequestOutput, out: CompletionOutput) -> dict:
        index = prompt_idx * self._body.n + out.index
        echo = None
        if self._body.echo and index not in self._offsets:  # its first chunk
            prompt, ids = self._prompts[prompt_idx], output.prompt_token_ids
            echo = (prompt if isinstance(prompt, str) else self._tokenizer.decode(ids), ids)
        offset = self._offsets.setdefault(index, 0)
        choice = completion_choice(index, out, self._tokenizer, self._with_logprobs, echo, offset)
        if self._with_logprobs:
            self._offsets[index] += sum(len(t) for t in choice["logprobs"]["tokens"])
        return choice
