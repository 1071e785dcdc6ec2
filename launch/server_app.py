"""The OpenAI-compatible HTTP app over an EngineLoop: schemas and `create_app`.

Routes: POST /v1/completions, GET /v1/models, GET /health. Handlers are async and await the
loop's Futures, so concurrent clients share the engine's batches; the results do not depend on
that sharing (the runtime is batch-invariant). Floats are written by Python's json (shortest
repr, -Infinity allowed), so every logprob reaches the client with its exact bits.
Non-standard additions: `token_ids` per choice and `logprobs.top_logprob_ids` (exact ids, since
byte-level token strings collide). Not here yet: streaming, chat, metrics, API keys.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine_loop import EngineLoop, EngineUnavailableError
from moe_runtime.sampling_params import SamplingParams
from moe_runtime.sequence import Sequence

MAX_LOGPROBS = 20


class CompletionRequest(BaseModel):
    """OpenAI /v1/completions fields we honour; any other field is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    stop: str | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    stream: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        ok = isinstance(value, str) or (
            isinstance(value, list)
            and value
            and (
                all(_is_token_id(t) for t in value)
                or all(isinstance(p, str) for p in value)
                or all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in value)
            )
        )
        if not ok:
            raise ValueError("must be a string, a non-empty list of token ids, or a list of either")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k_off_or_positive(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must be -1 (off) or an int >= 1")
        return value

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, value: bool) -> bool:
        if value:
            raise ValueError("streaming is not supported yet; send stream=false")
        return value

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        if isinstance(self.prompt, str) or _is_token_id(self.prompt[0]):
            return [self.prompt]
        return list(self.prompt)

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            logprobs=self.logprobs,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            n=self.n,
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]
    top_logprob_ids: list[dict[int, float] | None]  # non-standard: exact ids


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None
    token_ids: list[int]  # non-standard


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class ExactJSONResponse(JSONResponse):
    """Python's json: floats as shortest round-tripping repr, and -Infinity for filtered tokens."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def create_app(loop: EngineLoop | None, config: RuntimeConfig, tokenizer) -> FastAPI:
    """The app; `app.state.engine_loop` may be None (503s) until the engine is ready."""
    app = FastAPI(title="moe-runtime", default_response_class=ExactJSONResponse)
    app.state.engine_loop = loop
    model_name = config.server.model_name

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, *_describe_validation(exc.errors()))

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        loop = request.app.state.engine_loop
        if loop is None:
            return ExactJSONResponse({"status": "loading"}, status_code=503)
        if not loop.is_healthy:
            return ExactJSONResponse({"status": "unavailable", "error": loop.error}, 503)
        counts = {"num_running": loop.num_running, "num_waiting": loop.num_waiting}
        return ExactJSONResponse({"status": "ok", **counts})

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

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> JSONResponse:
        loop = request.app.state.engine_loop
        if loop is None:
            return _error(503, "the engine is still loading", None, "unavailable")
        if body.model is not None and body.model != model_name:
            return _error(404, f"model {body.model!r} does not exist", "model", "not_found_error")
        prompts = body.prompts()
        try:
            params = body.sampling_params()
            future = loop.submit_batch(prompts, [params] * len(prompts))
            groups = await asyncio.wrap_future(future)
        except ValueError as exc:
            return _error(400, str(exc), _param_of(str(exc)))
        except EngineUnavailableError as exc:
            return _error(503, str(exc), None, "unavailable")
        except Exception as exc:  # a worker failure
            return _error(500, f"{type(exc).__name__}: {exc}", None, "internal_error")
        choices, completion_tokens = [], 0
        for i, (prompt, group) in enumerate(zip(prompts, groups, strict=True)):
            for j, seq in enumerate(group):
                choice, num_generated = _choice(i * body.n + j, prompt, seq, body, tokenizer)
                choices.append(choice)
                completion_tokens += num_generated
        prompt_tokens = sum(len(group[0].prompt_token_ids) for group in groups)
        response = CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model_name,
            choices=choices,
            usage=CompletionUsage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            ),
        )
        return ExactJSONResponse(response.model_dump())

    return app


def _choice(
    index: int, prompt: str | list[int], seq: Sequence, body: CompletionRequest, tokenizer
) -> tuple[CompletionChoice, int]:
    """(choice, tokens generated) for one sample: stop strings cut, echo prepended."""
    token_ids = list(seq.output_token_ids)
    text = tokenizer.decode(token_ids)
    finish_reason = seq.finish_reason
    cut = _cut_at_stop(token_ids, body.stop_strings(), tokenizer)
    if cut is not None:
        num_kept, text = cut
        token_ids, finish_reason = token_ids[:num_kept], "stop"
    num_out = len(token_ids)
    logprobs: list[float | None] = list(seq.output_logprobs[:num_out])
    top_ids: list[dict[int, float] | None] = list(seq.output_top_logprobs[:num_out])
    if body.echo:
        prompt_ids = list(seq.prompt_token_ids)
        text = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)) + text
        token_ids = prompt_ids + token_ids
        # Prompt-token logprobs are not computed in this version: null for every prompt token.
        logprobs = [None] * len(prompt_ids) + logprobs
        top_ids = [None] * len(prompt_ids) + top_ids
    choice_logprobs = None
    if body.logprobs is not None:
        tokens = [tokenizer.decode([t]) for t in token_ids]
        offsets, offset = [], 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        choice_logprobs = CompletionLogprobs(
            tokens=tokens,
            token_logprobs=logprobs,
            top_logprobs=[None if top is None else _by_text(top, tokenizer) for top in top_ids],
            text_offset=offsets,
            top_logprob_ids=top_ids,
        )
    choice = CompletionChoice(
        index=index,
        text=text,
        finish_reason=finish_reason,
        logprobs=choice_logprobs,
        token_ids=token_ids,
    )
    return choice, num_out


def _cut_at_stop(token_ids: list[int], stops: list[str], tokenizer) -> tuple[int, str] | None:
    """(tokens kept, text before the stop) at the first token whose text completes a stop string.

    The engine does not know stop strings yet, so the request ran to its own end; this only
    truncates. Quadratic in the output length (prefix decodes), fine at completion sizes.
    """
    if not stops:
        return None
    for num_kept in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:num_kept])
        hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
        if hits:
            return num_kept, text[: min(hits)]
    return None


def _by_text(top: dict[int, float], tokenizer) -> dict[str, float]:
    """OpenAI's top_logprobs keyed by token text; on a collision the more likely id wins."""
    by_text: dict[str, float] = {}
    for token_id, logprob in top.items():
        key = tokenizer.decode([token_id])
        if key not in by_text or logprob > by_text[key]:
            by_text[key] = logprob
    return by_text


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _param_of(message: str) -> str | None:
    if "token id" in message or "prompt" in message:
        return "prompt"
    if message.startswith("SamplingParams."):
        return message.split(".", 1)[1].split(" ", 1)[0]
    return None


def _describe_validation(errors: list[dict]) -> tuple[str, str | None]:
    """(message naming the field, param) from pydantic/FastAPI validation errors."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"malformed JSON body: {detail}".rstrip(": "), None
    messages, param = [], None
    for err in errors[:3]:
        loc = [str(part) for part in err.get("loc", ()) if part != "body"]
        field = loc[0] if loc else "body"
        param = param or field
        detail = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        messages.append(f"{'.'.join(loc) or 'body'}: {detail}")
    return "; ".join(messages), param


def _error(
    status: int, message: str, param: str | None, kind: str = "invalid_request_error"
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return ExactJSONResponse(body, status_code=status)
