"""SamplingParams: per-request sampling settings, validated once at construction.

Noise is a function of (seed, output position, vocab id) only, so a request samples the same
tokens whatever else shares its step. `logprobs_mode` says what the reported logprobs are:
"raw" (log_softmax of the model's logits, what `score()` returns) or "processed" (after
temperature, top-k and top-p, the distribution actually sampled from; a greedy sample, which
samples from no distribution, reports raw logprobs, as vLLM's greedy path does). `min_tokens`
follows the same rule: the ids it holds off (EOS, stop_token_ids) are -inf in what is sampled
from, so in "processed" logprobs, and keep the model's own logprobs in "raw" ones.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields

import numpy as np

from moe_runtime.config_fields import check_field_types
from moe_runtime.seeds import MAX_SEED, SEED_BITS

LOGPROBS_MODES = ("raw", "processed")
# Temperatures below this are greedy, as in vLLM and SGLang: logits divided by a temperature
# near float32's smallest normal (1.2e-38) overflow to inf, and argmax then takes the first.
GREEDY_TEMPERATURE = 1e-5
# The largest temperature: the sampler divides by it in float32, where a larger one is inf, the
# logits then 0 and the -inf of held-off ids NaN, which argmax takes (EOS before min_tokens).
MAX_TEMPERATURE = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: to the context's end (vLLM's meaning)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 (vLLM's two spellings): off
    seed: int | None = None
    logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    logprobs_mode: str = "raw"
    # Strings that end a sample once its text holds one; the text stops before it, the token
    # completing it is kept, finish_reason is "stop".
    stop: tuple[str, ...] = field(default_factory=tuple)
    # Report, per output token, the [MoE layer][K] logical experts that routed it.
    return_routed_experts: bool = False
    # Output tokens before EOS, stop_token_ids and stop strings may end a sample: until then
    # the ids are masked to -inf before sampling (`ids_held_off`) and stop strings do not stop.
    min_tokens: int = 0
    # The text keeps the stop string (or stop id's or EOS's text) that ended the sample.
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.stop is None:  # no stop strings
            object.__setattr__(self, "stop", ())
        if self.stop_token_ids is None:  # no stop ids, as stop=None is no stop strings
            object.__setattr__(self, "stop_token_ids", ())
        # Types first (a bool is an int, "no" is truthy): each message names its field. The
        # ranges below then compare Python numbers only.
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        check_field_types("SamplingParams", SamplingParams, values)
        for name, value in values.items():
            if name in _NUMBERS and value is not None:  # numpy's scalars as Python's: they
                object.__setattr__(self, name, _NUMBERS[name](value))  # reach JSON and hashes
        _check(
            self.max_tokens is None or self.max_tokens >= 1,  # None: to the context's end
            "max_tokens",
            self.max_tokens,
            "an int >= 1",
        )
        _check(
            0.0 <= self.temperature <= MAX_TEMPERATURE,
            "temperature",
            self.temperature,
            f"a finite number >= 0 (below {GREEDY_TEMPERATURE:g}: greedy) and at most "
            f"float32's largest, {MAX_TEMPERATURE:g}",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(self.top_k >= -1, "top_k", self.top_k, "-1 or 0 (off) or an int >= 1")
        if self.top_k == 0:  # vLLM's off; one spelling here, so a request's record is one
            object.__setattr__(self, "top_k", -1)
        _check(
            self.seed is None or 0 <= self.seed <= MAX_SEED,
            "seed",
            self.seed,
            f"None or an int in [0, 2**{SEED_BITS} - 1]",
        )
        ok = self.logprobs is None or self.logprobs >= 0
        _check(ok, "logprobs", self.logprobs, "None or an int >= 0")
        _check(self.n >= 1, "n", self.n, "an int >= 1")
        _check(
            0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),  # None: any
            "min_tokens",
            self.min_tokens,
            f"an int >= 0 and <= max_tokens ({self.max_tokens})",
        )
        _check(
            self.logprobs_mode in LOGPROBS_MODES,
            "logprobs_mode",
            self.logprobs_mode,
            f"one of {LOGPROBS_MODES}",
        )
        ids = self.stop_token_ids
        converted = _token_ids(ids)
        _check(converted is not None, "stop_token_ids", ids, "a list of token ids (ints >= 0)")
        object.__setattr__(self, "stop_token_ids", converted)
        stop = self.stop
        is_strings = isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)
        _check(isinstance(stop, str) or is_strings, "stop", stop, "a string or a list of strings")
        stop = (stop,) if isinstance(stop, str) else stop
        # An empty string would stop every sample at once (as vLLM and the HTTP API refuse
        # it; it was dropped without a word).
        _check(all(stop), "stop", self.stop, "non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def may_stop(self, num_output_tokens: int) -> bool:
        """Whether a stop id, EOS or stop string may end a sample of num_output_tokens tokens
        (its newest counted): past min_tokens. The one place the sampler's hold-off, the
        scheduler's stop ids and the detokenizer's stop strings take the boundary from."""
        return num_output_tokens > self.min_tokens

    def ids_held_off(self, output_position: int, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The ids the sampler masks to -inf for the output token at output_position (0: the
        first): before min_tokens, stop_token_ids and the EOS ids (unless ignore_eos), as vLLM's
        min-tokens processor; none after. A function of the request alone."""
        if self.may_stop(output_position + 1):
            return ()
        if self.ignore_eos:
            return self.stop_token_ids
        return (*self.stop_token_ids, *eos_token_ids)


def finish_reason(
    params: SamplingParams,
    token_id: int,
    num_output_tokens: int,
    num_tokens: int,
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
) -> str | None:
    """Why a sample ends once token_id is its newest token (num_output_tokens and num_tokens
    count it), or None: a stop token or one of the EOS ids ("stop"), max_tokens or the context
    ("length"). Stop strings are the detokenizer's. The scheduler ends samples by it; a worker's
    decode lookahead leaves out the samples it ends. Before min_tokens only the length ends a sample
    (the sampler never draws the stop ids then; this holds where it did not, as vLLM's)."""
    may_stop = params.may_stop(num_output_tokens)
    if may_stop and token_id in params.stop_token_ids:
        return "stop"
    if may_stop and not params.ignore_eos and token_id in eos_token_ids:
        return "stop"
    if ends_by_length(params, num_output_tokens, num_tokens, max_model_len):
        return "length"
    return None


def stop_token_reason(
    params: SamplingParams, token_id: int, eos_token_ids: tuple[int, ...]
) -> int | None:
    """The stop_reason of a sample that finish_reason ended with "stop" at token_id: the id
    where it is one of stop_token_ids, None where it is EOS (vLLM's rule: EOS comes first)."""
    if not params.ignore_eos and token_id in eos_token_ids:
        return None
    return token_id if token_id in params.stop_token_ids else None


def ends_by_length(
    params: SamplingParams, num_output_tokens: int, num_tokens: int, max_model_len: int
) -> bool:
    """Whether a sample of these counts ends whatever its newest token is (max_tokens or the
    context): known before the token is."""
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return True
    return num_tokens >= max_model_len


# The numeric fields, by the Python type each is stored as.
_NUMBERS = {"temperature": float, "top_p": float} | dict.fromkeys(
    ("max_tokens", "top_k", "seed", "logprobs", "n", "min_tokens"), int
)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")


def _token_ids(ids: object) -> tuple[int, ...] | None:
    """A list of token ids as Python ints (numpy's and torch's integer scalars index as ints,
    as a prompt's do), or None where one is no id: a bool, a float, a negative."""
    if not isinstance(ids, (list, tuple)):
        return None
    try:
        converted = tuple(operator.index(t) for t in ids if not _is_boolean(t))
    except TypeError:
        return None
    ok = len(converted) == len(ids) and all(t >= 0 for t in converted)
    return converted if ok else None


def _is_boolean(value: object) -> bool:
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")
