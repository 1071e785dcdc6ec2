"""OpenAI-compatible request schemas: every field checked here, before the engine sees it.

Requests forbid unknown fields and coerce nothing (strict), so every mistake is a 400 whose
message names the field. OpenAI's nullable fields take null as their default. OpenAI fields
this server does not implement are accepted only with a value that changes no output (a zero
penalty, an empty logit bias, no tools) and otherwise refused as not supported; `user` is
accepted and ignored. Sampling fields are shared by completions and chat completions and map
onto `SamplingParams` in one place (`sampling_params`), which therefore cannot refuse them.
No routes or responses here; the chat request and its messages (tool calls in a history among
them) are in launch.openai.chat_schemas.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
)

from launch.openai.errors import FieldError, UnknownModelError
from moe_runtime.config_fields import is_int
from moe_runtime.sampling_params import SamplingParams
from moe_runtime.seeds import MAX_SEED, from_signed_seed

MAX_N = 128
# Every stop string is searched on every token of every sample on the engine's one thread, so
# a request may not bring enough of them to slow the others (OpenAI allows 4).
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
# Nullable OpenAI fields whose null means the field's default; `echo` is completions' own,
# `logprobs` chat's (completions' logprobs default to null already).
NULL_IS_DEFAULT = ("temperature", "top_p", "n", "stream", "echo", "logprobs")


def _is_zero(value: Any) -> bool:
    return value is None or (type(value) in (int, float) and value == 0)


def _is_false(value: Any) -> bool:
    return value is None or value is False


def _is_empty(value: Any) -> bool:
    return value is None or value == {}


def _is_bool(value: Any) -> bool:
    return value is None or isinstance(value, bool)


def _is_text_format(value: Any) -> bool:
    return value is None or value == {"type": "text"}


def is_null(value: Any) -> bool:
    return value is None


def is_no_list(value: Any) -> bool:
    return value is None or value == []


def _null_or(*names: str) -> Callable[[Any], bool]:
    return lambda value: value is None or (isinstance(value, str) and value in names)


NO_TOOLS = "tool calls are not supported"
# OpenAI fields that are not implemented: {field: (the values accepted, as the error names
# them; a test of a value)}. Only values under which the output is what it is without the
# field pass, so nothing a client asks for is silently dropped. `parallel_tool_calls` and
# `tool_choice` change nothing without tools, which are refused; `best_of` is checked against
# `n` on its own.
NO_OP_VALUES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "frequency_penalty": ("0 or null", _is_zero),
    "presence_penalty": ("0 or null", _is_zero),
    "logit_bias": ("null or {}", _is_empty),
    "suffix": ("null", is_null),
    "response_format": ('{"type": "text"} or null', _is_text_format),
    "parallel_tool_calls": ("true, false or null; no tools are supported", _is_bool),
    "metadata": ("null or {}; nothing is stored", _is_empty),
    "store": ("false or null; nothing is stored", _is_false),
    "tools": (f"null or []; {NO_TOOLS}", is_no_list),
    "tool_choice": (f'null, "none" or "auto"; {NO_TOOLS}', _null_or("none", "auto")),
    "service_tier": ('null, "auto" or "default"', _null_or("auto", "default")),
    "modalities": ('null or ["text"]', lambda value: value is None or value == ["text"]),
    "reasoning_effort": ("null; the model does not reason", is_null),
    "include_obfuscation": ("false or null", _is_false),
}
TokenId = Annotated[StrictInt, Field(ge=0)]


def no_op_only(table: dict[str, tuple[str, Callable[[Any], bool]]], field: str, value: Any) -> Any:
    """value, if it is a no-op value of `field` (its table's entry); ValueError otherwise."""
    accepted, is_no_op = table[field]
    if not is_no_op(value):
        raise ValueError(f"{json.dumps(value)} is not supported (accepted: {accepted})")
    return value


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: Any = None  # OpenAI's padding of stream chunks: none here

    @field_validator("include_obfuscation", mode="before")
    @classmethod
    def _no_op_only(cls, value: Any, info) -> Any:
        return no_op_only(NO_OP_VALUES, info.field_name, value)


class SamplingFields(Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1)  # -1 or 0 (vLLM's): off
    seed: int | None = Field(None, ge=-(2**63), le=MAX_SEED)  # OpenAI's signed int64
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[StrictStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)  # within the token budget: check_served
    include_stop_str_in_output: bool = False
    return_routed_experts: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id: accepted and ignored
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logit_bias: Any = None

    @field_validator(*NULL_IS_DEFAULT, mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, value: Any, info) -> Any:
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator(*NO_OP_VALUES, mode="before", check_fields=False)
    @classmethod
    def _no_op_only(cls, value: Any, info) -> Any:
        return no_op_only(NO_OP_VALUES, info.field_name, value)

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info) -> StreamOptions | None:
        if value is not None and info.data.get("stream") is False:  # info.data: fields above
            raise ValueError("needs stream: true")
        return value

    @field_validator("stop")
    @classmethod
    def _few_short_stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if "" in strings:
            raise ValueError("strings must not be empty")
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"must hold at most {MAX_STOP_STRINGS} strings, got {len(strings)}")
        longest = max(map(len, strings), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(
                f"strings must be at most {MAX_STOP_CHARS} characters, got one of {longest}"
            )
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_served(
        self,
        model_name: str,
        vocab_size: int,
        max_logprobs: int,
        default_budget: int | None = None,
    ) -> None:
        """Refuses another model's name, more top logprobs than max_logprobs (the config's
        server.max_logprobs), stop token ids outside the vocabulary and a min_tokens over the
        token budget (default_budget where the request gives none; None: the context's end)."""
        if self.model is not None and self.model != model_name:
            raise UnknownModelError(self.model)
        num_top, field = self.num_top_logprobs(), self.top_logprobs_field()
        if num_top is not None and num_top > max_logprobs:
            message = f"{field}: {num_top} is more than server.max_logprobs={max_logprobs}"
            raise FieldError(field, message)
        budget, field = self.token_budget(), self.token_budget_field()
        if budget is None:
            budget, field = default_budget, f"the default {field}"
        if budget is not None and self.min_tokens > budget:
            message = f"min_tokens: {self.min_tokens} is more than {field}={budget}"
            raise FieldError("min_tokens", message)
        for token_id in self.stop_token_ids or ():
            if token_id >= vocab_size:
                message = f"token id {token_id} is outside the vocabulary [0, {vocab_size})"
                raise FieldError("stop_token_ids", f"stop_token_ids: {message}")

    def num_top_logprobs(self) -> int | None:
        raise NotImplementedError

    def token_budget(self) -> int | None:
        """The most tokens the client lets a sample generate, or None (the default)."""
        return self.max_tokens

    def token_budget_field(self) -> str:
        """The field `token_budget` reads, for errors to name."""
        return "max_tokens"

    def top_logprobs_field(self) -> str:
        """The field `num_top_logprobs` reads, for errors to name."""
        return "logprobs"

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """The request's SamplingParams; default_max_tokens where it gives no budget (None: to
        the context's end)."""
        budget = self.token_budget()
        return SamplingParams(
            max_tokens=default_max_tokens if budget is None else budget,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=None if self.seed is None else from_signed_seed(self.seed),
            logprobs=self.num_top_logprobs(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            n=self.n,
            stop=self.stop or (),
            return_routed_experts=self.return_routed_experts,
        )


class CompletionRequest(SamplingFields):
    """/v1/completions; `max_tokens` defaults to 16 as in OpenAI's API."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: the prompt alone, with echo
    logprobs: int | None = Field(None, ge=0)  # at most server.max_logprobs: check_served
    echo: bool = False
    best_of: int | None = None
    suffix: Any = None

    @field_validator("best_of", mode="before")
    @classmethod
    def _best_of_is_n(cls, value: Any, info) -> Any:
        n = info.data.get("n")  # absent when n itself is bad
        if value is not None and n is not None and value != n:
            raise ValueError(f"{json.dumps(value)} is not supported (accepted: null or n, {n})")
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        ok = (isinstance(value, str) and value) or (
            isinstance(value, list)
            and value
            and (
                all(is_int(t) for t in value)
                or all(isinstance(p, str) and p for p in value)
                or all(isinstance(p, list) and p and all(map(is_int, p)) for p in value)
            )
        )
        if not ok:
            raise ValueError(
                "must be a non-empty string, a non-empty list of token ids, or a list of either"
            )
        return value

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        if isinstance(self.prompt, str) or is_int(self.prompt[0]):
            return [self.prompt]
        return list(self.prompt)

    def num_top_logprobs(self) -> int | None:
        return self.logprobs


class UpdateWeightsRequest(Strict):
    path: str = Field(min_length=1)


class RebalanceRequest(Strict):
    """POST /admin/rebalance's body, optional (none: the defaults). `force` false skips the
    move when balancedness is at or above `eplb.balancedness_threshold`."""

    force: StrictBool = True


def utf8_encodable(text: str) -> str:
    """text, if UTF-8 can encode it (JSON may carry a lone surrogate such as \\ud800, which
    it cannot): the error then names the character's position in this field, not in the
    rendered chat template."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"holds {text[exc.start]!r} at position {exc.start}, which UTF-8 cannot encode "
            f"({exc.reason})"
        ) from None
    return text
