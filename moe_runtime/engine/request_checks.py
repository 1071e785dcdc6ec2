"""RequestChecks: what the engine refuses before it queues anything, as a ValueError naming it.

A prompt (text or token ids) must encode to a non-empty list of ints inside the vocabulary and
fit the context (`scheduler.max_model_len`; PromptTooLongError); with its max_tokens it must
fit too (ContextLengthError, which names the budget); a request may not ask for more top
logprobs than the vocabulary holds or `server.max_logprobs`, nor stop on an id outside it. A
scoring's sequence must hold a prompt and at least one token to score. Batches are checked all
or none, the bad item named by its index. The checks read only the config and the tokenizer:
the engine, a front end or a rollout job can run them ahead of anything else.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

from moe_runtime.config import RuntimeConfig
from moe_runtime.config_fields import is_int
from moe_runtime.sampling_params import SamplingParams


class ContextLengthError(ValueError):
    """A prompt that fits the context, but not with its max_tokens (as OpenAI and vLLM refuse).

    `field` names the budget in the message, so a front end can speak of its own field."""

    def __init__(
        self, num_prompt_tokens: int, max_tokens: int, max_model_len: int, field: str = "max_tokens"
    ) -> None:
        self.num_prompt_tokens, self.max_tokens = num_prompt_tokens, max_tokens
        self.max_model_len = max_model_len
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} tokens and {field} is {max_tokens} "
            f"({num_prompt_tokens + max_tokens} in all). The context is "
            "scheduler.max_model_len."
        )


class PromptTooLongError(ValueError):
    """A prompt (or scored sequence: `what`) longer than the whole context. `message` is the
    text before `check_all` names the item of a batch (`str(exc)` then starts "prompt 1: ")."""

    def __init__(self, num_tokens: int, max_model_len: int, what: str = "prompt") -> None:
        self.num_tokens, self.max_model_len, self.what = num_tokens, max_model_len, what
        self.message = (
            f"{what} has {num_tokens} tokens, more than scheduler.max_model_len={max_model_len}"
        )
        super().__init__(self.message)


class RequestChecks:
    def __init__(self, config: RuntimeConfig, tokenizer) -> None:
        self.vocab_size = config.model.vocab_size
        self.max_model_len = config.scheduler.max_model_len
        self.max_n = config.server.max_sequences_per_request
        self.max_logprobs = config.server.max_logprobs
        self.tokenizer = tokenizer

    def requests(
        self, prompts: list[str | list[int]], params: list[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Each prompt's token ids, checked with its params (max_tokens, logprobs, stop ids)
        or, without params, alone; the bad prompt named by its index when there are several."""
        if params is None:
            return check_all(self.encode, ("prompt", prompts))
        return check_all(self.request, ("prompt", prompts), ("SamplingParams", params))

    def request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """A request's prompt token ids, or ValueError naming what the engine cannot run: a bad
        prompt, a prompt and max_tokens past the context (ContextLengthError), more top
        logprobs than the vocabulary has, a stop id outside it, more samples than
        server.max_sequences_per_request (each holds engine state: an n of 2**40 hung)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.n > self.max_n:
            raise ValueError(
                f"SamplingParams.n={params.n} is more samples of one prompt than "
                f"server.max_sequences_per_request={self.max_n}"
            )
        token_ids = self.encode(prompt)
        budget, field = params.max_tokens, "max_tokens"
        if budget is None:  # to the context's end: room for one token at least
            budget, field = 1, "max_tokens (None: one token at least)"
        if len(token_ids) + budget > self.max_model_len:
            raise ContextLengthError(len(token_ids), budget, self.max_model_len, field)
        self.num_top(params.logprobs)
        outside = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if outside:  # never sampled: a stop that could never end the sample
            raise ValueError(
                f"SamplingParams.stop_token_ids: token id {outside[0]} is outside the "
                f"vocabulary [0, {self.vocab_size})"
            )
        return token_ids

    def num_top(self, logprobs: int | None) -> None:
        """Refuse more top logprobs a position than the vocabulary has tokens, or than
        server.max_logprobs."""
        if logprobs is not None and logprobs > self.vocab_size:
            raise ValueError(
                f"SamplingParams.logprobs={logprobs} asks for more top logprobs than the "
                f"vocabulary's {self.vocab_size} tokens"
            )
        if logprobs is not None and logprobs > self.max_logprobs:
            raise ValueError(
                f"SamplingParams.logprobs={logprobs} is more than "
                f"server.max_logprobs={self.max_logprobs}"
            )

    def scores(
        self, sequences: list[list[int]], prompt_lens: list[int]
    ) -> list[tuple[list[int], list[int]]]:
        """Each scoring's (prompt ids, ids to score); the bad one named by its index."""
        return check_all(self.score, ("sequence", sequences), ("prompt_lens", prompt_lens))

    def score(self, token_ids: list[int], prompt_len: int) -> tuple[list[int], list[int]]:
        """A scoring's (prompt ids, ids to score), or ValueError naming what the engine cannot
        run: bad ids, a sequence past the context, a prompt_len leaving nothing on either side."""
        token_ids = token_id_list(token_ids)
        self.validate(token_ids, what="scored sequence (prompt and scored tokens)")
        last = len(token_ids) - 1
        if last < 1:
            raise ValueError(
                f"a scored sequence needs 2 tokens at least (a prompt and a token to score), "
                f"got {len(token_ids)}"
            )
        if hasattr(prompt_len, "__index__") and not isinstance(prompt_len, bool):
            prompt_len = operator.index(prompt_len)  # numpy's ints too
        if not is_int(prompt_len) or not 1 <= prompt_len <= last:
            raise ValueError(
                f"prompt_len must be an int in [1, {last}] for a sequence of "
                f"{len(token_ids)} tokens, got {prompt_len!r}"
            )
        return token_ids[:prompt_len], token_ids[prompt_len:]

    def encode(self, prompt: str | list[int] | Mapping) -> list[int]:
        """Token ids of a prompt (text through the tokenizer; vLLM's prompt dicts unwrapped:
        prompt_text_or_ids), validated."""
        prompt = prompt_text_or_ids(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = token_id_list(prompt)
        self.validate(token_ids)
        return token_ids

    def validate(self, token_ids: list[int], what: str = "prompt") -> None:
        """Refuse an empty prompt, a non-int or out-of-vocabulary id, a prompt past the context.
        `what` the ids are, for the message."""
        if not token_ids:
            raise ValueError(f"{what} is empty")
        if len(token_ids) > self.max_model_len:  # first: no id-by-id pass over a huge prompt
            raise PromptTooLongError(len(token_ids), self.max_model_len, what)
        for t in token_ids:
            if not is_int(t):
                raise ValueError(f"token ids must be ints, got {t!r} ({type(t).__name__})")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t!r} is outside the vocabulary [0, {self.vocab_size})")


def check_all(
    check: Callable[..., Any], items: tuple[str, list], args: tuple[str, list] | None = None
) -> list:
    """check(item[, arg]) for every item (and its arg) before any result is used; a ValueError
    or TypeError (its type kept) names the bad item's index when there are several. items /
    args: (name, values)."""
    what, values = items
    if args is not None:
        # Paired one to one, so both are counted: score(seqs, 3) met len()'s bare TypeError.
        for name, given in ((f"{what}s", values), args):
            if not hasattr(given, "__len__"):
                raise ValueError(f"{name} must be a list, got {type(given).__name__}")
        if len(args[1]) != len(values):
            raise ValueError(f"got {len(args[1])} {args[0]} for {len(values)} {what}s")
    calls = [(v,) for v in values] if args is None else list(zip(values, args[1], strict=True))
    results = []
    for i, call in enumerate(calls):
        try:
            results.append(check(*call))
        except (ValueError, TypeError) as exc:
            if len(values) > 1:
                exc.args = (f"{what} {i}: {exc}",)
            raise
    return results


# vLLM's prompt dicts' keys: TextPrompt's text, TokensPrompt's ids.
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def prompt_text_or_ids(prompt):
    """A prompt as text or token ids: vLLM's {"prompt": text} and {"prompt_token_ids": ids}
    unwrapped (keys with None values ignored, as vLLM's optional fields are); any other key,
    both keys or neither, bytes (whose iteration gives ints: they were taken as ids) and sets
    (no order) refused naming what was given."""
    if isinstance(prompt, (bytes, bytearray)):
        raise ValueError(
            f"a prompt must be text or a list of token ids, got {type(prompt).__name__}"
        )
    if isinstance(prompt, (set, frozenset)):
        raise ValueError("a prompt's token ids must be ordered (a list), got a set")
    if not isinstance(prompt, Mapping):
        return prompt
    given = {key: value for key, value in prompt.items() if value is not None}
    other = sorted(str(key) for key in given if key not in PROMPT_KEYS)
    if other:
        raise ValueError(
            f"prompt dict keys {other} are not supported (only one of {list(PROMPT_KEYS)})"
        )
    if len(given) != 1:
        raise ValueError(
            f"a prompt dict needs exactly one of {list(PROMPT_KEYS)}, got "
            f"{sorted(given) or 'neither'}"
        )
    ((key, value),) = given.items()
    if key == "prompt" and not isinstance(value, str):
        raise ValueError(f"'prompt' must be text, got {type(value).__name__}")
    if key == "prompt_token_ids" and isinstance(value, (str, Mapping)):
        raise ValueError(f"'prompt_token_ids' must be a list of ints, got {type(value).__name__}")
    return prompt_text_or_ids(value)


def token_id_list(tokens) -> list[int]:
    """A prompt's ids as Python ints: numpy's and torch's integer scalars (which index as
    ints) converted; anything else kept for `RequestChecks.validate` to name."""
    try:
        return [t if isinstance(t, (int, float, str)) else operator.index(t) for t in tokens]
    except TypeError as exc:
        raise ValueError(f"a prompt must be text or a list of token ids: {exc}") from None
