"""POST /v1/chat/completions: OpenAI's chat.completion and chat.completion.chunk formats.

Messages become a prompt through the tokenizer's chat template (the model's own from
tokenizer_config.json, else moe_runtime.chat_template's documented default). Logprobs follow
OpenAI's `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}` with the exact
`token_id` added to every entry; each choice carries `token_ids`, each response
`weight_version` (both non-standard). Streamed deltas carry the same bits as whole responses.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from launch.generation import Generation, TextDeltas, cut_at_stop
from launch.metrics import ServerMetrics
from launch.protocol import (
    ChatCompletionRequest,
    ExactJSONResponse,
    generation_error,
    refusal,
)
from launch.routes_completions import sse
from moe_runtime.config import RuntimeConfig

ROUTE = "/v1/chat/completions"


def add_chat_routes(app: FastAPI, config: RuntimeConfig, tokenizer, metrics: ServerMetrics) -> None:
    model_name = config.server.model_name
    max_model_len = config.scheduler.max_model_len

    @app.post(ROUTE)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse:
        loop = request.app.state.engine_loop
        refused = refusal(loop, body.model, model_name)
        if refused is not None:
            return refused
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            prompt_ids = tokenizer.apply_chat_template(messages)
            room = max(1, max_model_len - len(prompt_ids))  # too long a prompt fails below
            params = body.sampling_params(body.token_budget() or room)
            generation = Generation(loop, [prompt_ids], [params], body.stop_strings(), metrics)
            if body.stream:
                await generation.started()
            else:
                groups = await generation.result()
        except Exception as exc:
            if isinstance(exc, ValueError) and "prompt" in str(exc):
                exc = ValueError(f"messages: {exc}")
            return generation_error(exc, metrics, ROUTE)
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": model_name,
        }
        metrics.requests.labels(ROUTE, "200").inc()
        if body.stream:
            chunks = _stream(generation, head, body, tokenizer)
            return StreamingResponse(chunks, media_type="text/event-stream")
        choices, num_out = [], 0
        for j, seq in enumerate(groups[0]):
            text, _ = cut_at_stop(tokenizer.decode(seq.output_token_ids), body.stop_strings())
            ids, lps, tops = seq.output_token_ids, seq.output_logprobs, seq.output_top_logprobs
            choices.append(
                {
                    "index": j,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": chat_logprobs(ids, lps, tops, tokenizer) if body.logprobs else None,
                    "finish_reason": seq.finish_reason,
                    "token_ids": list(ids),
                }
            )
            num_out += len(ids)
        num_in = len(groups[0][0].prompt_token_ids)
        usage = {"prompt_tokens": num_in, "completion_tokens": num_out}
        usage["total_tokens"] = num_in + num_out
        return ExactJSONResponse(
            {
                **head,
                "object": "chat.completion",
                "choices": choices,
                "usage": usage,
                "weight_version": generation.weight_version,
            }
        )


def chat_logprobs(token_ids, logprobs, tops, tokenizer) -> dict:
    """OpenAI's chat logprobs block, with the exact `token_id` on every entry."""
    return {
        "content": [
            {
                **_entry(token_id, logprob, tokenizer),
                "top_logprobs": [_entry(t, lp, tokenizer) for t, lp in top.items()],
            }
            for token_id, logprob, top in zip(token_ids, logprobs, tops, strict=True)
        ]
    }


def _entry(token_id: int, logprob: float, tokenizer) -> dict:
    token = tokenizer.decode([token_id])
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode("utf-8")),
        "token_id": token_id,
    }


async def _stream(
    generation: Generation, head: dict, body: ChatCompletionRequest, tokenizer
) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}
    deltas: dict[int, TextDeltas] = {}
    num_in, num_out = 0, 0
    try:
        async for event in generation.events():
            index = event.sample_idx
            num_in, num_out = event.num_prompt_tokens, num_out + len(event.token_ids)
            delta = {}
            if index not in deltas:
                deltas[index] = TextDeltas(tokenizer, body.stop_strings())
                delta["role"] = "assistant"
            delta["content"] = deltas[index].push(event.token_ids, event.finish_reason is not None)
            ids = list(event.token_ids)
            logprobs = None
            if body.logprobs:
                logprobs = chat_logprobs(ids, event.logprobs, event.top_logprobs, tokenizer)
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": event.finish_reason,
                "token_ids": ids,
            }
            yield sse({**head, "choices": [choice], "weight_version": event.weight_version})
        if body.include_usage:
            usage = {"prompt_tokens": num_in, "completion_tokens": num_out}
            usage["total_tokens"] = num_in + num_out
            yield sse({**head, "choices": [], "usage": usage})
    except Exception as exc:  # a worker failure mid-stream: tell the client, then end
        yield sse({"error": {"message": f"{type(exc).__name__}: {exc}", "type": "internal_error"}})
    finally:
        generation.cancel()  # no-op once finished; aborts the request if the client left
    yield "data: [DONE]\n\n"
