"""EngineLoop: one background thread that owns an LLMEngine and steps it while there is work.

The engine is not thread-safe, so the loop thread is the only caller of engine methods:
`submit` queues a request and returns a Future; between steps the loop thread runs queued
`call`s (admin work such as a rebalance or a weight update), validates and adds queued requests,
aborts those whose Future was cancelled, steps, ends samples whose text reached a stop string,
reports new tokens to each request's `on_token` callback, and resolves each Future with the
request's finished sequences. Concurrent callers are therefore batched by the engine's
scheduler. A bad prompt resolves its Future with ValueError; a failing step fails every pending
Future with the step's error and leaves the loop dead (`is_healthy` False) but answering.
It sleeps on a condition when idle. No HTTP, flags or environment here.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from moe_runtime.engine import LLMEngine
from moe_runtime.loop_events import LoopStats, TokenCallback, TokenEvent
from moe_runtime.model_runner import sample_seed
from moe_runtime.sampler import resolve_seed
from moe_runtime.sampling_params import SamplingParams
from moe_runtime.sequence import Sequence


class EngineUnavailableError(RuntimeError):
    """The loop is draining, stopped or dead; the request was not run."""


@dataclass(eq=False)
class _Request:
    prompts: list[str | list[int]]
    params: list[SamplingParams]
    future: Future
    is_single: bool  # submit() resolves to one group, submit_batch() to a list of groups
    stop: tuple[str, ...] = ()
    on_token: TokenCallback | None = None
    groups: list[list[Sequence]] = field(default_factory=list)
    num_unfinished: int = 0


@dataclass(eq=False)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: Future


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._cond = threading.Condition()
        # Guarded by _cond: the queue, every request not yet settled, flags and counters.
        self._queue: deque[_Request] = deque()
        self._live: set[_Request] = set()
        self._is_accepting = True
        self._is_stopping = False
        self._has_cancelled = False
        self._error: BaseException | None = None
        self._calls: deque[_Call] = deque()
        self._stats = LoopStats()
        self._num_steps = 0
        # Loop thread only: the request of each unfinished sequence, and where each sequence sits
        # as (prompt index, sample index, tokens already reported).
        self._by_seq_id: dict[int, _Request] = {}
        self._where: dict[int, list[int]] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- any thread ----

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        stop: Seq[str] = (),
        on_token: TokenCallback | None = None,
    ) -> Future:
        """Queue one request; the Future resolves to its finished sequences (n of them).

        `stop`: strings that end a sample as soon as its decoded text contains one (the token
        completing it is kept; finish_reason "stop"). `on_token` is called on the loop thread
        after every step that gave a sample new tokens; it must be quick and must not block.
        """
        return self._put([prompt], [params], True, tuple(stop), on_token)

    def submit_batch(
        self,
        prompts: list[str | list[int]],
        params: list[SamplingParams],
        *,
        stop: Seq[str] = (),
        on_token: TokenCallback | None = None,
    ) -> Future:
        """Queue several requests all or none: one bad prompt fails the Future, naming its index.

        The Future resolves to one list of finished sequences per prompt, in prompt order.
        """
        if len(prompts) != len(params) or not prompts:
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        return self._put(list(prompts), list(params), False, tuple(stop), on_token)

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run fn(engine) on the loop thread between two steps; the Future gets its result.

        For work that must not overlap a step (a rebalance, a weight update). Requests in
        flight continue after it.
        """
        item = _Call(fn, Future())
        with self._cond:
            if self._error is not None:
                raise EngineUnavailableError(f"the engine is dead: {self._error}")
            if not self._is_accepting:
                raise EngineUnavailableError("the engine loop is shutting down")
            self._calls.append(item)
            self._cond.notify_all()
        return item.future

    @property
    def is_healthy(self) -> bool:
        with self._cond:
            return self._thread.is_alive() and self._error is None and self._is_accepting

    @property
    def error(self) -> str | None:
        with self._cond:
            return None if self._error is None else f"{type(self._error).__name__}: {self._error}"

    @property
    def num_running(self) -> int:
        """Sequences in the engine's running batches after the last step."""
        with self._cond:
            return self._stats.num_running

    @property
    def num_waiting(self) -> int:
        """Sequences queued here or in the engine's waiting queues after the last step."""
        with self._cond:
            return self._stats.num_waiting + sum(p.n for r in self._queue for p in r.params)

    @property
    def num_steps(self) -> int:
        with self._cond:
            return self._num_steps

    def stats(self) -> LoopStats:
        """Counts and engine state after the last step (num_waiting includes queued requests)."""
        with self._cond:
            queued = sum(p.n for r in self._queue for p in r.params)
            stats = self._stats
        return dataclasses.replace(
            stats, num_waiting=stats.num_waiting + queued, num_steps=self.num_steps
        )

    def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop accepting, wait up to drain_timeout_s for requests in flight, then stop.

        Requests still unfinished after the timeout fail with EngineUnavailableError. The engine
        is shut down on the loop thread, its only user. Safe to call more than once.
        """
        with self._cond:
            self._is_accepting = False
            self._cond.wait_for(lambda: not self._live or self._error is not None, drain_timeout_s)
            self._is_stopping = True
            self._cond.notify_all()
        self._thread.join()

    def _put(
        self,
        prompts: list,
        params: list[SamplingParams],
        is_single: bool,
        stop: tuple[str, ...],
        on_token: TokenCallback | None,
    ) -> Future:
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params must be SamplingParams, got {type(p).__name__}")
        if not all(isinstance(s, str) for s in stop):
            raise TypeError("stop must be a sequence of strings")
        request = _Request(prompts, params, Future(), is_single, tuple(s for s in stop if s))
        request.on_token = on_token
        with self._cond:
            if self._error is not None:
                raise EngineUnavailableError(f"the engine is dead: {self._error}")
            if not self._is_accepting:
                raise EngineUnavailableError("the engine loop is shutting down")
            self._queue.append(request)
            self._live.add(request)
            self._cond.notify_all()
        request.future.add_done_callback(self._on_done)
        return request.future

    def _on_done(self, future: Future) -> None:
        if future.cancelled():
            with self._cond:
                self._has_cancelled = True
                self._cond.notify_all()

    # ---- loop thread ----

    def _has_work(self) -> bool:
        return (
            bool(self._queue)
            or bool(self._calls)
            or self._is_stopping
            or self._has_cancelled
            or (self._error is None and self._engine.has_unfinished())
        )

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(self._has_work)  # idle: sleep until submit/cancel/stop
                    if self._is_stopping:
                        break
                    incoming = list(self._queue)
                    self._queue.clear()
                    calls = list(self._calls)
                    self._calls.clear()
                    has_cancelled, self._has_cancelled = self._has_cancelled, False
                for item in calls:
                    self._run_call(item)
                for request in incoming:
                    self._admit(request)
                if has_cancelled:
                    self._abort_cancelled()
                if self._error is None and self._engine.has_unfinished():
                    self._step()
                self._count()
        except BaseException as exc:  # a bug here must not leave callers waiting forever
            with self._cond:
                self._error = exc
            raise
        finally:
            stopped = EngineUnavailableError("the engine loop stopped first")
            for request in self._snapshot():
                self._settle(request, stopped)
            with self._cond:
                calls = list(self._calls)
                self._calls.clear()
            for item in calls:
                item.future.set_exception(stopped)
            self._engine.shutdown()

    def _run_call(self, item: _Call) -> None:
        if not item.future.set_running_or_notify_cancel():
            return
        if self._error is not None:
            item.future.set_exception(EngineUnavailableError(f"the engine is dead: {self._error}"))
            return
        try:
            item.future.set_result(item.fn(self._engine))
        except Exception as exc:  # the caller gets it; the loop and its requests go on
            item.future.set_exception(exc)

    def _admit(self, request: _Request) -> None:
        if request.future.cancelled():
            self._forget(request)
            return
        if self._error is not None:
            self._settle(request, EngineUnavailableError(f"the engine is dead: {self._error}"))
            return
        tokenizer = self._engine.tokenizer
        token_ids = []
        for i, prompt in enumerate(request.prompts):
            try:
                ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                self._engine.validate_prompt(ids)
            except ValueError as exc:
                where = f"prompt {i}: " if len(request.prompts) > 1 else ""
                self._settle(request, ValueError(f"{where}{exc}"))
                return
            token_ids.append(ids)
        for prompt_idx, (ids, params) in enumerate(zip(token_ids, request.params, strict=True)):
            group = self._add_samples(ids, params)
            request.groups.append(group)
            request.num_unfinished += len(group)
            for sample_idx, seq in enumerate(group):
                self._by_seq_id[seq.seq_id] = request
                self._where[seq.seq_id] = [prompt_idx, sample_idx, 0]

    def _add_samples(self, token_ids: list[int], params: SamplingParams) -> list[Sequence]:
        """One engine request per sample, so a stop string can end one sample alone.

        Each sample gets the seed the engine would give it inside one n-sample request, so its
        tokens are the same bits either way (noise depends only on seed and position).
        """
        if params.n == 1:
            return self._engine.add_request(token_ids, params)
        seed = resolve_seed(params.seed)
        return [
            self._engine.add_request(
                token_ids,
                dataclasses.replace(params, n=1, seed=sample_seed(seed, i, params.n)),
            )[0]
            for i in range(params.n)
        ]

    def _step(self) -> None:
        try:
            finished = self._engine.step()
        except Exception as exc:  # a worker failure: every pending request ends with it
            with self._cond:
                self._error = exc
            for request in self._snapshot():
                self._settle(request, exc)
            self._by_seq_id.clear()
            self._where.clear()
            return
        finished.extend(self._stop_at_strings())
        self._report_tokens()
        for seq in finished:
            request = self._by_seq_id.pop(seq.seq_id, None)
            self._where.pop(seq.seq_id, None)
            if request is None:
                continue
            request.num_unfinished -= 1
            if request.num_unfinished == 0:
                self._settle(request, None)
        with self._cond:
            self._num_steps += 1

    def _stop_at_strings(self) -> list[Sequence]:
        """End each unfinished sample whose decoded output now contains one of its stop strings.

        Checked after every token, so a sample ends at the first token completing a match.
        """
        stopped = []
        for seq_id, request in self._by_seq_id.items():
            prompt_idx, sample_idx, num_reported = self._where[seq_id]
            seq = request.groups[prompt_idx][sample_idx]
            if not request.stop or seq.is_finished or seq.num_output_tokens == num_reported:
                continue
            text = self._engine.tokenizer.decode(seq.output_token_ids)
            if any(s in text for s in request.stop):
                self._engine.abort(seq.request_id)  # one sample per engine request
                seq.finish_reason = "stop"
                stopped.append(seq)
        return stopped

    def _report_tokens(self) -> None:
        """Send each sample's new tokens to its request's callback; a failing callback ends
        only its own request."""
        version = getattr(self._engine, "weight_version", 0)
        failed: dict[int, tuple[_Request, Exception]] = {}
        for seq_id, request in self._by_seq_id.items():
            if request.on_token is None or id(request) in failed:
                continue
            where = self._where[seq_id]
            seq = request.groups[where[0]][where[1]]
            start = where[2]
            if seq.num_output_tokens == start and not seq.is_finished:
                continue
            where[2] = seq.num_output_tokens
            event = TokenEvent.of(seq, where[0], where[1], start, version)
            try:
                request.on_token(event)
            except Exception as exc:
                failed[id(request)] = (request, exc)
        for request, exc in failed.values():
            self._abort(request)
            self._settle(request, exc)

    def _count(self) -> None:
        schedulers, engine = self._engine.schedulers, self._engine
        stats = LoopStats(
            num_running=sum(len(s.running) for s in schedulers),
            num_waiting=sum(len(s.waiting) for s in schedulers),
            kv_cache_usage=tuple(b.usage for b in engine.block_managers),
            weight_version=getattr(engine, "weight_version", 0),
            num_rebalances=getattr(engine, "num_rebalances", 0),
            last_balancedness=getattr(engine, "last_balancedness", None),
        )
        with self._cond:
            self._stats = stats

    def _abort_cancelled(self) -> None:
        for request in [r for r in self._snapshot() if r.future.cancelled()]:
            self._abort(request)
            self._forget(request)

    def _abort(self, request: _Request) -> None:
        for group in request.groups:
            for seq in group:
                if not seq.is_finished:
                    self._engine.abort(seq.request_id)
                self._by_seq_id.pop(seq.seq_id, None)
                self._where.pop(seq.seq_id, None)

    def _settle(self, request: _Request, error: BaseException | None) -> None:
        try:
            if error is not None:
                request.future.set_exception(error)
            else:
                request.future.set_result(
                    request.groups[0] if request.is_single else request.groups
                )
        except InvalidStateError:
            pass  # cancelled by its caller meanwhile
        self._forget(request)

    def _snapshot(self) -> list[_Request]:
        with self._cond:
            return list(self._live)

    def _forget(self, request: _Request) -> None:
        with self._cond:
            self._live.discard(request)
            self._cond.notify_all()
