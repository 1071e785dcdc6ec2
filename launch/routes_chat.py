"""POST /v1/chat/completions: OpenAI's chat.completion and chat.completion.chunk formats.

Messages become a prompt through the tokenizer's chat template (the model's own from
tokenizer_config.json, else moe_runtime.chat_template's documented default). Logprobs follow
OpenAI's `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}` with the exact
`token_id` added to every entry; each choice carries `token_ids` (and `routed_experts` when
asked), each response `weight_version` (all non-standard). Streamed deltas carry the same bits
as whole responses.
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from launch.generation import Backend, Generation, ready, sse_stream
from launch.metrics import ServerMetrics
from launch.openai.errors import FieldError, answer
from launch.openai.render import ExactJSONResponse, chat_choice, usage
from launch.openai.schemas import ChatCompletionRequest
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.outputs import RequestOutput

ROUTE = "/v1/chat/completions"


def add_chat_routes(app: FastAPI, config: RuntimeConfig, metrics: ServerMetrics) -> None:
    @app.post(ROUTE)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        response = await answer(_chat(body, request.app.state.backend, config, metrics))
        metrics.count(ROUTE, response.status_code)
        return response


async def _chat(
    body: ChatCompletionRequest,
    backend: Backend | None,
    config: RuntimeConfig,
    metrics: ServerMetrics,
) -> Response:
    backend = ready(backend)
    body.check_model(config.server.model_name)
    tokenizer = backend.tokenizer
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    prompt_ids = tokenizer.apply_chat_template(messages)
    room = max(1, config.scheduler.max_model_len - len(prompt_ids))  # too long fails below
    params = body.sampling_params(body.token_budget() or room)
    generation = Generation(backend.engine, [prompt_ids], [params], metrics)
    try:
        outputs = await (generation.started() if body.stream else generation.result())
    except ValueError as exc:  # the engine's prompt checks
        raise FieldError("messages", f"messages: {exc}") from None
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": config.server.model_name,
    }
    if body.stream:
        has_role: set[int] = set()  # samples whose first chunk (with the role) went out

        def choices(_prompt_idx: int, delta: RequestOutput) -> list[dict]:
            result = []
            for out in delta.outputs:
                message = {"content": out.text}
                if out.index not in has_role:
                    message = {"role": "assistant", **message}
                    has_role.add(out.index)
                result.append(chat_choice("delta", message, out, tokenizer, body.logprobs))
            return result

        head = {**head, "object": "chat.completion.chunk"}
        chunks = sse_stream(generation, head, choices, body.include_usage)
        return StreamingResponse(chunks, media_type="text/event-stream")
    (whole,) = outputs
    num_out = sum(len(out.token_ids) for out in whole.outputs)
    return ExactJSONResponse(
        {
            **head,
            "object": "chat.completion",
            "choices": [
                chat_choice(
                    "message",
                    {"role": "assistant", "content": out.text},
                    out,
                    tokenizer,
                    body.logprobs,
                )
                for out in whole.outputs
            ],
            "usage": usage(len(whole.prompt_token_ids), num_out),
            "weight_version": whole.weight_version,
        }
    )
