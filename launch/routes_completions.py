"""POST /v1/completions: whole responses and SSE streams in OpenAI's text_completion format.

Each choice carries the non-standard `token_ids`, and with `logprobs` the OpenAI fields
(`tokens`, `token_logprobs`, `top_logprobs` keyed by token text) plus the exact
`top_logprob_ids` ({token_id: logprob}). A streamed choice sends each step's new tokens as they
are sampled; its ids and logprobs are the same bits as the whole response's. Choice index is
`prompt_idx * n + sample_idx`. Responses carry the non-standard `weight_version`.
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
    CompletionRequest,
    ExactJSONResponse,
    dumps,
    generation_error,
    refusal,
)
from moe_runtime.config import RuntimeConfig
from moe_runtime.sequence import Sequence

DEFAULT_MAX_TOKENS = 16
ROUTE = "/v1/completions"


def add_completion_routes(
    app: FastAPI, config: RuntimeConfig, tokenizer, metrics: ServerMetrics
) -> None:
    model_name = config.server.model_name

    @app.post(ROUTE)
    async def completions(body: CompletionRequest, request: Request) -> JSONResponse:
        loop = request.app.state.engine_loop
        refused = refusal(loop, body.model, model_name)
        if refused is not None:
            return refused
        prompts = body.prompts()
        try:
            params = body.sampling_params(DEFAULT_MAX_TOKENS)
            stop = body.stop_strings()
            generation = Generation(loop, prompts, [params] * len(prompts), stop, metrics)
            if body.stream:
                await generation.started()
            else:
                groups = await generation.result()
        except Exception as exc:
            return generation_error(exc, metrics, ROUTE)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }
        if body.stream:
            metrics.requests.labels(ROUTE, "200").inc()
            chunks = _stream(generation, head, prompts, body, tokenizer)
            return StreamingResponse(chunks, media_type="text/event-stream")
        choices, num_out = [], 0
        for i, (prompt, group) in enumerate(zip(prompts, groups, strict=True)):
            for j, seq in enumerate(group):
                choice = _choice(i * body.n + j, prompt, seq, body, tokenizer)
                choices.append(choice)
                num_out += len(seq.output_token_ids)
        num_in = sum(len(group[0].prompt_token_ids) for group in groups)
        metrics.requests.labels(ROUTE, "200").inc()
        return ExactJSONResponse(
            {
                **head,
                "choices": choices,
                "usage": _usage(num_in, num_out),
                "weight_version": generation.weight_version,
            }
        )


def _choice(index: int, prompt, seq: Sequence, body: CompletionRequest, tokenizer) -> dict:
    """One sample: text cut before a stop string (its tokens kept), echo prepended."""
    token_ids = list(seq.output_token_ids)
    text, _ = cut_at_stop(tokenizer.decode(token_ids), body.stop_strings())
    logprobs: list[float | None] = list(seq.output_logprobs)
    tops: list[dict[int, float] | None] = list(seq.output_top_logprobs)
    if body.echo:
        prompt_ids = list(seq.prompt_token_ids)
        text = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)) + text
        token_ids = prompt_ids + token_ids
        # Prompt-token logprobs are not computed in this version: null for every prompt token.
        logprobs = [None] * len(prompt_ids) + logprobs
        tops = [None] * len(prompt_ids) + tops
    return {
        "index": index,
        "text": text,
        "finish_reason": seq.finish_reason,
        "logprobs": None
        if body.logprobs is None
        else completion_logprobs(token_ids, logprobs, tops, tokenizer, 0),
        "token_ids": token_ids,
    }


def completion_logprobs(token_ids, logprobs, tops, tokenizer, offset: int) -> dict:
    """OpenAI's completion logprobs block; text offsets start at `offset`."""
    tokens = [tokenizer.decode([t]) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": [None if top is None else by_text(top, tokenizer) for top in tops],
        "text_offset": offsets,
        "top_logprob_ids": [None if top is None else dict(top) for top in tops],
    }


def by_text(top: dict[int, float], tokenizer) -> dict[str, float]:
    """OpenAI's top_logprobs keyed by token text; on a collision the more likely id wins."""
    result: dict[str, float] = {}
    for token_id, logprob in top.items():
        key = tokenizer.decode([token_id])
        if key not in result or logprob > result[key]:
            result[key] = logprob
    return result


async def _stream(
    generation: Generation, head: dict, prompts: list, body: CompletionRequest, tokenizer
) -> AsyncIterator[str]:
    deltas: dict[int, TextDeltas] = {}
    offsets: dict[int, int] = {}
    num_in: dict[int, int] = {}
    num_out = 0
    try:
        async for event in generation.events():
            index = event.prompt_idx * body.n + event.sample_idx
            num_in[event.prompt_idx] = event.num_prompt_tokens
            num_out += len(event.token_ids)
            ids, lps, tops = list(event.token_ids), list(event.logprobs), list(event.top_logprobs)
            text = ""
            if index not in deltas:
                deltas[index] = TextDeltas(tokenizer, body.stop_strings())
                offsets[index] = 0
                if body.echo:
                    prompt = prompts[event.prompt_idx]
                    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                    text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
                    ids = list(prompt_ids) + ids
                    lps, tops = [None] * len(prompt_ids) + lps, [None] * len(prompt_ids) + tops
            text += deltas[index].push(event.token_ids, event.finish_reason is not None)
            choice = {
                "index": index,
                "text": text,
                "finish_reason": event.finish_reason,
                "logprobs": None,
                "token_ids": ids,
            }
            if body.logprobs is not None:
                choice["logprobs"] = completion_logprobs(ids, lps, tops, tokenizer, offsets[index])
                offsets[index] += sum(len(t) for t in choice["logprobs"]["tokens"])
            yield sse({**head, "choices": [choice], "weight_version": event.weight_version})
        if body.include_usage:
            usage = _usage(sum(num_in.values()), num_out)
            yield sse({**head, "choices": [], "usage": usage})
    except Exception as exc:  # a worker failure mid-stream: tell the client, then end
        yield sse({"error": {"message": f"{type(exc).__name__}: {exc}", "type": "internal_error"}})
    finally:
        generation.cancel()  # no-op once finished; aborts the request if the client left
    yield "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {dumps(payload)}\n\n"


def _usage(num_in: int, num_out: int) -> dict:
    return {"prompt_tokens": num_in, "completion_tokens": num_out, "total_tokens": num_in + num_out}
