"""OpenAI-compatible request schemas, the exact-float JSON response and error bodies.

Requests forbid unknown fields and coerce nothing (strict), so every mistake is a 400 whose
message names the field. Sampling fields are shared by completions and chat completions and
map onto `SamplingParams` in one place. No routes here.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from moe_runtime.engine_loop import EngineUnavailableError
from moe_runtime.sampling_params import SamplingParams

MAX_LOGPROBS = 20
MAX_N = 128
MAX_SEED = 2**63 - 1  # seeds are 63-bit (moe_runtime.sampler)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k_off_or_positive(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must be -1 (off) or an int >= 1")
        return value

    def stop_strings(self) -> list[str]:
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop or []) if s]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def num_top_logprobs(self) -> int | None:
        raise NotImplementedError

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            logprobs=self.num_top_logprobs(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            n=self.n,
        )


class CompletionRequest(SamplingFields):
    """/v1/completions; `max_tokens` defaults to 16 as in OpenAI's API."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        ok = isinstance(value, str) or (
            isinstance(value, list)
            and value
            and (
                all(is_token_id(t) for t in value)
                or all(isinstance(p, str) for p in value)
                or all(isinstance(p, list) and all(is_token_id(t) for t in p) for p in value)
            )
        )
        if not ok:
            raise ValueError("must be a string, a non-empty list of token ids, or a list of either")
        return value

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        if isinstance(self.prompt, str) or is_token_id(self.prompt[0]):
            return [self.prompt]
        return list(self.prompt)

    def num_top_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """/v1/chat/completions; `max_tokens` (or `max_completion_tokens`) defaults to the room
    left in the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def num_top_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("SamplingParams.top_logprobs needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    path: str = Field(min_length=1)


class ExactJSONResponse(JSONResponse):
    """Python's json: floats as shortest round-tripping repr, and -Infinity for filtered tokens."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


def dumps(content: Any) -> str:
    return json.dumps(content, ensure_ascii=False, separators=(",", ":"), default=_plain)


def _plain(value: Any) -> Any:
    """numpy/torch scalars and arrays in engine reports, as plain JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def param_of(message: str) -> str | None:
    """The request field an engine/SamplingParams error message is about."""
    if message.startswith("messages:"):
        return "messages"
    if "token id" in message or "prompt" in message:
        return "prompt"
    if message.startswith("SamplingParams."):
        return message.split(".", 1)[1].split(" ", 1)[0]
    return None


def describe_validation(errors: list[dict]) -> tuple[str, str | None]:
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


def error_body(status: int, message: str, param: str | None, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
) -> JSONResponse:
    return ExactJSONResponse(error_body(status, message, param, kind), status_code=status)


def refusal(loop, model: str | None = None, served: str | None = None) -> JSONResponse | None:
    """503 while the engine loads, 404 for a model name other than the served one; None when
    the request may go on."""
    if loop is None:
        return error(503, "the engine is still loading", None, "unavailable")
    if model is not None and model != served:
        return error(404, f"model {model!r} does not exist", "model", "not_found_error")
    return None


def generation_error(exc: Exception, metrics, route: str) -> JSONResponse:
    """The response for a request that failed before answering: 400 for a bad request (the
    message names the field), 503 when the engine cannot take it, 500 for a worker failure."""
    if isinstance(exc, ValueError):
        response = error(400, str(exc), param_of(str(exc)))
    elif isinstance(exc, EngineUnavailableError):
        response = error(503, str(exc), None, "unavailable")
    else:
        response = error(500, f"{type(exc).__name__}: {exc}", None, "internal_error")
    metrics.requests.labels(route, str(response.status_code)).inc()
    return response
