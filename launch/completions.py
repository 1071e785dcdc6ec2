"""POST /v1/completions and /v1/chat/completions, in OpenAI's text_completion and
chat.completion(.chunk) formats, whole or streamed (the same bits either way).

Completion choices are indexed `prompt_idx * n + sample_idx`; their logprobs add the exact
`top_logprob_ids` to OpenAI's fields. Chat messages become a prompt through the tokenizer's chat
template (the model's own, else moe_runtime.chat_template's documented default); chat logprobs
are OpenAI's `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}` plus the exact
`token_id`. Every choice carries `token_ids` (and `routed_experts` when asked), every response
`weight_version` (all non-standard; launch.openai.render).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import replace

from fastapi.responses import Response

from launch.generation import Backend, Generation, SampleFailedError, check_samples, ready
from launch.metrics import ServerMetrics
from launch.openai.chat_schemas import ChatCompletionRequest
from launch.openai.errors import ContextLengthExceeded, FieldError
from launch.openai.render import Echo, TextOffsets, chat_choice, completion_choice
from launch.openai.schemas import CompletionRequest
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.async_engine import AsyncEngine
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.outputs import CompletionOutput, RequestOutput
from moe_runtime.engine.request_checks import (
    ContextLengthError,
    PromptTooLongError,
    RequestChecks,
)
from moe_runtime.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 16


async def complete(
    body: CompletionRequest,
    backend: Backend | None,
    config: RuntimeConfig,
    metrics: ServerMetrics,
    received: float,
) -> Response:
    """/v1/completions; `received` (time.monotonic) is when the request came, for its metrics."""
    backend = ready(backend)
    prompts, engine = body.prompts(), backend.engine
    _check_completion(body, config, len(prompts))
    params = None if body.max_tokens == 0 else body.sampling_params(DEFAULT_MAX_TOKENS)
    num_top = body.logprobs if body.echo else None
    # The prompts are scored for echo's logprobs or routed experts.
    is_scored = body.echo and (num_top is not None or body.return_routed_experts)
    ids, version = [], 0
    with _engine_checks():
        # Text tokenized off the engine's thread and the event loop: a long prompt's encoding
        # held every stream. Each prompt is checked here as the engine checks it alone (ids in
        # the vocabulary, inside the context), needing no engine: a rebuilding engine's 503
        # hid the 400 of a request no engine runs. The engine checks the ids again with their
        # params (`prompts` keeps the text, for echo).
        checks = RequestChecks(config, backend.tokenizer)
        encoded = await asyncio.to_thread(checks.requests, prompts)
    if is_scored or params is None:
        # Scored, or alone (max_tokens 0): every prompt is checked on the engine's thread
        # before anything runs, so a refusal costs no scoring. A plain completion skips this
        # round trip (the engine checks it as it is admitted).
        with _engine_checks():
            ids, version = await asyncio.wrap_future(
                engine.call(lambda e: _checked(e, encoded, params))
            )
    # The scoring and the generation are queued back to back (a drain admits both or neither),
    # and leave together: a failure or a client that goes cancels both.
    scores = _PromptScores(
        engine, ids if is_scored else [], num_top, body.return_routed_experts, len(prompts)
    )
    generation = None
    try:
        with _engine_checks():
            if params is not None:
                generation = Generation(
                    engine, encoded, [params] * len(prompts), metrics, received, body.stream
                )
            scored = await scores.outputs()
            if generation is None:  # echo alone: nothing to generate
                answered = _Answered(_prompts_alone(ids, scored, body.n, version))
                generation = Generation(answered, prompts, [], metrics, received, body.stream)
            await generation.start()
    except BaseException as exc:
        scores.cancel()
        if generation is not None and isinstance(exc, SampleFailedError):
            generation.fail()  # counted as "error", not as a client that left
        elif generation is not None:
            generation.future.cancel()
        raise
    # (MoE layers, K) of a routed-experts row: a prompt with no rows of its own has [0, L, K]
    width = config.model.routed_width if body.return_routed_experts else None
    choices = _Choices(body, prompts, backend.tokenizer, scored, width)
    head = _head("cmpl", "text_completion", config, backend)
    also = [whole for whole in scored if whole is not None]
    return await generation.response(head, choices, body.include_usage, also)


def _check_completion(body: CompletionRequest, config: RuntimeConfig, num_prompts: int) -> None:
    """The completion's refusals that need no engine: the model and ids it names, max_tokens 0
    without echo, more sequences than server.max_sequences_per_request."""
    server = config.server
    body.check_served(
        server.model_name, config.model.vocab_size, server.max_logprobs, DEFAULT_MAX_TOKENS
    )
    if body.max_tokens == 0 and not body.echo:
        raise FieldError("max_tokens", "max_tokens: 0 needs echo: true (else nothing comes back)")
    most = config.server.max_sequences_per_request
    if num_prompts * body.n > most:
        raise FieldError(
            "prompt",
            f"prompt: {num_prompts} prompts x n={body.n} = {num_prompts * body.n} sequences, "
            f"more than server.max_sequences_per_request={most} in one request",
        )


def _head(id_prefix: str, kind: str, config: RuntimeConfig, backend: Backend) -> dict:
    """The fields every response and chunk of a request opens with (OpenAI's `object` is
    `kind`)."""
    return {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": config.server.model_name,
        "system_fingerprint": backend.system_fingerprint,
    }


@contextmanager
def _engine_checks() -> Iterator[None]:
    """The engine's refusals of a request as the HTTP errors that name its field."""
    try:
        yield
    except ContextLengthError as exc:
        raise ContextLengthExceeded("max_tokens", str(exc)) from None
    except PromptTooLongError as exc:
        raise _prompt_too_long(exc, "prompt") from None
    except FieldError:
        raise
    except ValueError as exc:  # the engine's prompt checks
        raise FieldError("prompt", str(exc)) from None


def _prompt_too_long(exc: PromptTooLongError, param: str) -> ContextLengthExceeded:
    """The engine's refusal of a prompt past the context, worded as OpenAI words it (clients
    such as LiteLLM key on its code); a batch's bad prompt is named at the end."""
    where = str(exc).removesuffix(exc.message).removesuffix(": ")  # "prompt 1" in a batch
    message = (
        f"This model's maximum context length is {exc.max_model_len} tokens; the prompt has "
        f"{exc.num_tokens} tokens, more than scheduler.max_model_len={exc.max_model_len}"
    )
    return ContextLengthExceeded(param, f"{message} ({where})" if where else message)


def _checked(
    engine: LLMEngine, prompts: list[str | list[int]], params: SamplingParams | None
) -> tuple[list[list[int]], int]:
    """Each prompt's token ids, checked as the engine checks a request (with max_tokens when
    generating), and the weights' version now."""
    ids = engine.check_requests(prompts, None if params is None else [params] * len(prompts))
    return ids, engine.weight_version


class _PromptScores:
    """Each prompt's tokens after its first, scored teacher-forced (LLMEngine's
    add_score_requests): their logprobs, top logprobs and (asked) routed experts as decoding
    them reports. None for a one-token prompt, and for all when `ids` is empty (nothing asked)."""

    def __init__(
        self,
        engine: AsyncEngine,
        ids: list[list[int]],
        num_top: int | None,
        return_routed_experts: bool,
        num_prompts: int,
    ) -> None:
        self._num_prompts = num_prompts
        self._scorable = [i for i, t in enumerate(ids) if len(t) >= 2]
        self._future: Future | None = None
        if self._scorable:
            sequences, prompt_lens = [ids[i] for i in self._scorable], [1] * len(self._scorable)
            self._future = engine.submit_scores(
                sequences, prompt_lens, num_top, return_routed_experts
            )

    async def outputs(self) -> list[RequestOutput | None]:
        scored: list[RequestOutput | None] = [None] * self._num_prompts
        if self._future is not None:
            whole = await asyncio.wrap_future(self._future)
            for i, output in zip(self._scorable, whole, strict=True):
                check_samples(i, output)  # NaN logits: the engine's words, not the JSON's
                scored[i] = output
        return scored

    def cancel(self) -> None:
        if self._future is not None:
            self._future.cancel()


def _prompts_alone(
    ids: list[list[int]], scored: list[RequestOutput | None], n: int, version: int
) -> list[RequestOutput]:
    """The outputs of prompts with nothing generated (max_tokens 0): n empty samples each,
    with the weight versions of its scoring (else of the check before it)."""
    outputs = []
    for token_ids, scoring in zip(ids, scored, strict=True):
        last = version if scoring is None else scoring.weight_version
        first = version if scoring is None else scoring.first_weight_version
        empty = [
            CompletionOutput(
                index=i,
                token_ids=[],
                logprobs=[],
                top_logprobs=[],
                text="",
                finish_reason="length",
                seed=0,
                weight_version=last,
                first_weight_version=first,
            )
            for i in range(n)
        ]
        outputs.append(
            RequestOutput(
                request_id=f"echo-{uuid.uuid4().hex}",
                prompt_token_ids=token_ids,
                outputs=empty,
                is_finished=True,
                weight_version=last,
                first_weight_version=first,
            )
        )
    return outputs


class _Answered:
    """Generation's engine for requests whose outputs are known before they run: each is
    handed out as one delta and the submission is done."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self._outputs = outputs

    def submit(self, _prompts, _params, on_output) -> Future:
        for prompt_idx, output in enumerate(self._outputs):
            on_output(prompt_idx, output)
        future: Future = Future()
        future.set_result(self._outputs)
        return future


class _Choices:
    """A request's choices, whole or a delta at a time (text offsets carried on)."""

    def __init__(
        self,
        body: CompletionRequest,
        prompts: list,
        tokenizer,
        scored: list[RequestOutput | None],
        routed_width: tuple[int, int] | None = None,
    ) -> None:
        """routed_width: (MoE layers, K) where routed experts were asked (`Echo.of`)."""
        self._body, self._prompts, self._tokenizer = body, prompts, tokenizer
        self._scored = scored  # each prompt's scoring, for echo's logprobs
        self._routed_width = routed_width
        self._with_logprobs = body.logprobs is not None
        self._offsets: dict[int, TextOffsets] = {}  # choice index -> its tokens' text offsets

    def __call__(self, prompt_idx: int, output: RequestOutput) -> list[dict]:
        return [self._choice(prompt_idx, output, out) for out in output.outputs]

    def _choice(self, prompt_idx: int, output: RequestOutput, out: CompletionOutput) -> dict:
        index = prompt_idx * self._body.n + out.index
        echo, start = None, 0
        if self._body.echo and index not in self._offsets:  # its first chunk
            prompt, ids = self._prompts[prompt_idx], output.prompt_token_ids
            text = prompt if isinstance(prompt, str) else self._tokenizer.decode(ids)
            scoring = self._scored[prompt_idx]
            scored = None if scoring is None else scoring.outputs[0]
            echo = Echo.of(text, ids, scored, self._routed_width)
            # The prompt's tokens may begin with what its text drops (a sentencepiece space).
            pieces = b"".join(self._tokenizer.token_bytes(t) for t in ids)
            start = len(text) - len(pieces.decode("utf-8", errors="replace"))
        offsets = self._offsets.setdefault(index, TextOffsets(start))
        return completion_choice(
            index, out, self._tokenizer, offsets if self._with_logprobs else None, echo
        )


async def chat(
    body: ChatCompletionRequest,
    backend: Backend | None,
    config: RuntimeConfig,
    metrics: ServerMetrics,
    received: float,
) -> Response:
    """/v1/chat/completions; `received` as `complete`'s."""
    backend = ready(backend)
    server = config.server
    body.check_served(server.model_name, config.model.vocab_size, server.max_logprobs)
    most = config.server.max_sequences_per_request
    if body.n > most:  # (else the engine's refusal, named as a fault of `messages`)
        raise FieldError(
            "n",
            f"n: {body.n} samples, more than server.max_sequences_per_request={most} in "
            "one request",
        )
    tokenizer = backend.tokenizer
    messages = [m.template_fields() for m in body.messages]
    # Off the event loop: a long conversation's template and encoding take a while, and every
    # stream's chunks go out through the loop.
    try:
        prompt_ids = await asyncio.to_thread(
            tokenizer.apply_chat_template, messages, **body.template_options()
        )
    except ValueError as exc:  # the template refused or failed on the messages
        raise FieldError("messages", str(exc)) from None
    max_model_len, budget = config.scheduler.max_model_len, body.token_budget()
    params = body.sampling_params(None)  # no budget: to the context's end
    try:
        # Checked here as the engine checks it (needing no engine), as complete's prompts: a
        # rebuilding engine's 503 hid the 400 of a conversation past the context.
        await asyncio.to_thread(RequestChecks(config, tokenizer).request, prompt_ids, params)
        generation = Generation(
            backend.engine, [prompt_ids], [params], metrics, received, body.stream
        )
        await generation.start()
    except ContextLengthError as exc:
        if budget is not None:  # the client's budget; else the prompt alone fills the context
            param = body.token_budget_field()
            again = ContextLengthError(exc.num_prompt_tokens, budget, max_model_len, param)
            raise ContextLengthExceeded(param, str(again)) from None
        raise ContextLengthExceeded(
            "messages",
            f"messages: This model's maximum context length is {max_model_len} tokens and the "
            f"prompt has {exc.num_prompt_tokens}, which leaves no room to generate. The context "
            "is scheduler.max_model_len.",
        ) from None
    except PromptTooLongError as exc:
        raise _prompt_too_long(exc, "messages") from None
    except ValueError as exc:  # the engine's prompt checks
        raise FieldError("messages", f"messages: {exc}") from None
    kind = "chat.completion.chunk" if body.stream else "chat.completion"
    head = _head("chatcmpl", kind, config, backend)
    key = "delta" if body.stream else "message"
    has_role: set[int] = set()  # streamed samples whose role chunk went out

    def choices(_prompt_idx: int, output: RequestOutput) -> list[dict]:
        result = []
        for out in output.outputs:
            message = {"content": out.text}
            if not body.stream:  # OpenAI's whole message always has it
                message = {"role": "assistant", **message, "refusal": None}
            elif out.index not in has_role:  # OpenAI opens a stream with the role alone
                role = {"role": "assistant", "content": "", "refusal": None}
                result.append(chat_choice(key, role, _nothing_yet(out), tokenizer, False))
                has_role.add(out.index)
            result.append(chat_choice(key, message, out, tokenizer, body.logprobs))
        return result

    return await generation.response(head, choices, body.include_usage)


def _nothing_yet(out: CompletionOutput) -> CompletionOutput:
    """A sample's delta before its first token (a stream's role chunk): no tokens, no text, not
    finished; its routed experts, where asked, the [0, MoE layers, K] rows of no token."""
    routed = None if out.routed_experts is None else out.routed_experts[:0]
    return replace(
        out,
        token_ids=[],
        logprobs=[],
        top_logprobs=[],
        text="",
        finish_reason=None,
        stop_reason=None,
        routed_experts=routed,
    )
