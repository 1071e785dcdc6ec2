"""LLM: the public Python facade over the engine.

`LLM(config, **overrides)` -> `generate(prompts, params)`, `score(sequences, prompt_lens)`,
`shutdown()`. Overrides are "section.key" (or "section__key") keyword arguments, or a section
name with a dict of keys, and win over the config file.

Calls from several threads run one at a time (in no guaranteed order). Why: a call
steps the engine until nothing is left, so two at once stepped each other's requests from two
threads, which killed the engine ("scheduled from position 0, but 4 are computed here") and
gave some of the calls other bits. Concurrent serving is AsyncEngine's (launch/serve_ep.py).
`shutdown` from another thread ends the running call before its next step.

A rank frozen inside a call's step or collective (a stopped or wedged process) is found by the
server's watchdog (engine/stall_watch.py, every server.health_check_interval_s): silent at two
checks in a row, it is killed and the call raises WorkerError within seconds, not after the
collective timeout (parallel.timeout_s plus a margin: minutes); the next call rebuilds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

from moe_runtime.config import SECTIONS, RuntimeConfig, load_config
from moe_runtime.engine import CompletionOutput, LLMEngine, RequestOutput
from moe_runtime.engine.rank_faults import under_lock
from moe_runtime.engine.request import Request
from moe_runtime.engine.stall_watch import watching
from moe_runtime.executor import WorkerError
from moe_runtime.sampling_params import SamplingParams

log = logging.getLogger("moe_runtime.llm")


class LLM:
    def __init__(self, config: str | Path | dict | RuntimeConfig, **overrides: Any) -> None:
        self.config = load_config(config, _flatten_overrides(overrides))
        self._engine: LLMEngine | None = LLMEngine(self.config)  # None once shut down
        self._tokenizer = self._engine.tokenizer
        # Held by the call running (under_lock; module docstring). Reentrant: a signal handler
        # calling shutdown() runs in the thread of the call it interrupted, which holds the
        # lock (a plain lock deadlocked there, and the process ignored every later SIGTERM).
        self._lock = threading.RLock()
        self._is_closing = threading.Event()  # set by shutdown before it waits for the lock

    @property
    def engine(self) -> LLMEngine:
        """The engine, for step-by-step use (add_request, step, output); RuntimeError once
        shutdown() was called, as this LLM's own calls raise (it was None after shutdown, and
        llm.engine.add_request raised AttributeError on NoneType)."""
        self._check_open()
        return self._engine

    @property
    def tokenizer(self):
        """The model's tokenizer; still there after shutdown(), to decode what was generated
        (it was read through the engine, and raised AttributeError once that was gone)."""
        return self._tokenizer

    @under_lock
    def generate(
        self,
        prompts: list[str | list[int] | dict] | str | dict,
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order. A prompt is text, token ids, or
        vLLM's {"prompt": text} / {"prompt_token_ids": ids}; prompts a list, tuple or generator
        of them (or one); params one SamplingParams or a list or tuple of one a prompt;
        `sampling_params` is vLLM's name for `params`. Bad prompts raise before any work.
        use_tqdm: a progress bar of finished prompts on stderr (as vLLM's)."""
        if sampling_params is not None:
            if params is not None:
                raise ValueError("give params or sampling_params (vLLM's name for it), not both")
            params = sampling_params
        if isinstance(prompts, Iterator):  # a generator: read once, before it is inspected
            prompts = list(prompts)
        if _is_one_prompt(prompts):
            prompts = [prompts]
        if isinstance(params, (list, tuple)):
            params_list = list(params)
        else:
            params_list = [params or SamplingParams()] * len(prompts)
        engine = self._live_engine()
        requests = engine.add_requests(list(prompts), params_list)
        self._run_until_done(requests, "generate", use_tqdm)
        return [engine.output(request) for request in requests]

    @under_lock
    def score(
        self, sequences: list[list[int]], prompt_lens: list[int], *, use_tqdm: bool = True
    ) -> list[list[float]]:
        """Teacher-forced logprob of every token after the prompt, one list per sequence. A
        position whose logits were not finite has a NaN logprob (score_outputs reports such a
        sequence with finish_reason "error", naming the first)."""
        requests = self._live_engine().add_score_requests(sequences, prompt_lens)  # all or none
        self._run_until_done(requests, "score", use_tqdm)
        return [list(r.samples[0].output_logprobs) for r in requests]

    @under_lock
    def score_outputs(
        self,
        sequences: list[list[int]],
        prompt_lens: list[int],
        logprobs: int | None = None,
        *,
        return_routed_experts: bool = False,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """`score` with each position's top `logprobs` too: one CompletionOutput a sequence
        (token_ids: the scored tokens; logprobs, top_logprobs and, with return_routed_experts,
        routed_experts: as decoding them reports; finish_reason "scored", or "error" where
        some position's logits were not finite, `error` naming the first). With prompt_lens
        of 1, routed_experts holds every position but the last: a whole sequence's routing
        for a trainer to replay."""
        engine = self._live_engine()
        requests = engine.add_score_requests(
            sequences, prompt_lens, logprobs, return_routed_experts
        )
        self._run_until_done(requests, "score", use_tqdm)
        return [engine.output(r).outputs[0] for r in requests]

    @under_lock
    def rebalance(self) -> dict:
        """Re-place the experts now from the recent load (EPLB); changes no output bit."""
        engine = self._live_engine()
        with watching(engine) as running, running("a rebalance"):
            return engine.rebalance(force=True)

    @under_lock
    def update_weights(self, source: str | Path | dict) -> int:
        """New weights (HF checkpoint dir or HF-named state dict) on every rank; -> version."""
        engine = self._live_engine()
        with watching(engine) as running, running("an update of the weights"):
            return engine.update_weights(source)

    def shutdown(self) -> None:
        """Release the engine; nothing is left running in this process. Safe from any thread
        and more than once: a call running in another thread ends before its next step with
        RuntimeError (its requests aborted), as do calls waiting for it; then the engine goes.
        Why not wait for the call: shutdown from a watchdog or a signal handler's thread waited
        for the whole generate, however long."""
        self._is_closing.set()
        with self._lock:
            if self._engine is not None:
                self._engine.shutdown()
                self._engine = None

    def _live_engine(self) -> LLMEngine:
        """The engine, rebuilt first if a fault (or a Ctrl-C mid-step) left it dead: the call
        that met the fault raised it; this one runs on new workers (parallel.max_restarts
        bounds how often, then RuntimeError). A rank known dead without asking it (one that
        died between two calls) kills the engine first: the call would be scheduled onto it
        and fail with requests that never ran."""
        self._check_open()
        if self._engine.error is None:
            with contextlib.suppress(WorkerError):  # the engine is dead now, saying why
                self._engine.check_dead_ranks()
        if self._engine.error is not None:
            log.warning("the engine is dead (%s): rebuilding its workers", self._engine.error)
            self._engine.restart()
        return self._engine

    def _check_open(self) -> None:
        """RuntimeError once shutdown() was called (it may still wait for the running call)."""
        if self._is_closing.is_set() or self._engine is None:
            raise RuntimeError("this LLM was shut down: make a new LLM")

    def _run_until_done(self, requests: list[Request], what: str, use_tqdm: bool) -> None:
        """Step until nothing is left, on a progress bar when use_tqdm; on any exception (a
        Ctrl-C between steps too, shutdown() from another thread) this call's requests are
        aborted, so a later call neither runs them nor waits for them."""
        engine = self._engine  # (a shutdown in a signal handler of this thread drops it)
        try:
            with tqdm(total=len(requests), desc=what, unit="prompt", disable=not use_tqdm) as bar:
                step_until_done(engine, requests, bar, self._check_open)
        except BaseException:
            engine.abort(*(request.request_id for request in requests))
            raise
        # A fault in a step run by another thread's llm.engine call ended these requests with
        # it: raised here too, never returned as if they had finished.
        failure = next((s.error for r in requests for s in r.samples if s.error), None)
        if failure is not None:
            raise RuntimeError(f"the engine died while this call ran: {failure}")


def step_until_done(
    engine: LLMEngine,
    requests: list[Request],
    progress: tqdm,
    before_step: Callable[[], None] = lambda: None,
) -> None:
    """Step until the engine has nothing left, before_step() before each step (it may raise to
    stop). The progress bar counts the requests that finished (in order) and, between them,
    the tokens generated so far (a scoring has no deltas: its requests count as they finish).
    A rank frozen in a step is killed at the watchdog's second check (`watching`): the step
    raises WorkerError then, not after the collective timeout."""
    num_tokens = num_done = 0
    with watching(engine) as running:
        while engine.has_unfinished():
            before_step()
            with running("a step"):
                deltas = engine.step()
            if progress.disable:
                continue
            num_tokens, num_done = _advance(progress, deltas, requests, num_tokens, num_done)
    progress.update(len(requests) - num_done)  # nothing is left: every request finished


def _advance(
    progress: tqdm, deltas: list, requests: list[Request], num_tokens: int, num_done: int
) -> tuple[int, int]:
    """Move the bar past a step's deltas: -> (tokens generated, requests finished) so far."""
    num_tokens += sum(len(out.token_ids) for delta in deltas for out in delta.outputs)
    if num_tokens:
        progress.set_postfix(tokens=num_tokens, refresh=False)
    # Why the finished prefix, not every request: a pass over all of them each step cost
    # 0.16 s a step at 50k prompts. The bar may lag a request finished out of order.
    done = num_done
    while done < len(requests) and requests[done].is_finished:
        done += 1
    progress.update(done - num_done)  # redrawn at most 10/s
    return num_tokens, done


def _flatten_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    flat = {}
    for key, value in overrides.items():
        if key in SECTIONS and isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key.replace("__", ".")] = value
    return flat


def _is_one_prompt(prompts) -> bool:
    """Whether `prompts` is one prompt, not a list of them: text, one of vLLM's prompt dicts,
    or token ids given as a list of ints (numpy's and torch's integer scalars too) or a 1-d
    array or tensor (bytes count as one prompt, so they are refused as one, not iterated)."""
    if isinstance(prompts, (str, bytes, bytearray, Mapping)):
        return True
    if hasattr(prompts, "ndim"):  # a numpy array or a torch tensor
        return prompts.ndim == 1
    first = next(iter(prompts), None)
    if hasattr(first, "ndim"):  # numpy's scalars and 0-d tensors are ids; arrays are prompts
        return first.ndim == 0
    return hasattr(first, "__index__") and not isinstance(first, (str, list, tuple))
