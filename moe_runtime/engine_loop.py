"""EngineLoop: one background thread that owns an LLMEngine and steps it while there is work.

The engine is not thread-safe, so the loop thread is the only caller of engine methods:
`submit` queues a request and returns a Future; between steps the loop thread validates and
adds queued requests, aborts those whose Future was cancelled, steps, and resolves each Future
with the request's finished sequences. Concurrent callers are therefore batched by the engine's
scheduler. A bad prompt resolves its Future with ValueError; a failing step fails every pending
Future with the step's error and leaves the loop dead (`is_healthy` False) but answering.
It sleeps on a condition when idle. No HTTP, flags or environment here.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from moe_runtime.engine import LLMEngine
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
    groups: list[list[Sequence]] = field(default_factory=list)
    num_unfinished: int = 0


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
        self._num_running = 0
        self._num_waiting = 0
        self._num_steps = 0
        self._by_seq_id: dict[int, _Request] = {}  # loop thread only
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- any thread ----

    def submit(self, prompt: str | list[int], params: SamplingParams) -> Future:
        """Queue one request; the Future resolves to its finished sequences (n of them)."""
        return self._put([prompt], [params], is_single=True)

    def submit_batch(self, prompts: list[str | list[int]], params: list[SamplingParams]) -> Future:
        """Queue several requests all or none: one bad prompt fails the Future, naming its index.

        The Future resolves to one list of finished sequences per prompt, in prompt order.
        """
        if len(prompts) != len(params) or not prompts:
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        return self._put(list(prompts), list(params), is_single=False)

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
            return self._num_running

    @property
    def num_waiting(self) -> int:
        """Sequences queued here or in the engine's waiting queues after the last step."""
        with self._cond:
            return self._num_waiting + sum(p.n for r in self._queue for p in r.params)

    @property
    def num_steps(self) -> int:
        with self._cond:
            return self._num_steps

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

    def _put(self, prompts: list, params: list[SamplingParams], is_single: bool) -> Future:
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params must be SamplingParams, got {type(p).__name__}")
        request = _Request(prompts, params, Future(), is_single)
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
                    has_cancelled, self._has_cancelled = self._has_cancelled, False
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
            for request in self._snapshot():
                self._settle(request, EngineUnavailableError("the engine loop stopped first"))
            self._engine.shutdown()

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
        for ids, params in zip(token_ids, request.params, strict=True):
            group = self._engine.add_request(ids, params)
            request.groups.append(group)
            request.num_unfinished += len(group)
            self._by_seq_id.update((seq.seq_id, request) for seq in group)

    def _step(self) -> None:
        try:
            finished = self._engine.step()
        except Exception as exc:  # a worker failure: every pending request ends with it
            with self._cond:
                self._error = exc
            for request in self._snapshot():
                self._settle(request, exc)
            self._by_seq_id.clear()
            return
        for seq in finished:
            request = self._by_seq_id.pop(seq.seq_id, None)
            if request is None:
                continue
            request.num_unfinished -= 1
            if request.num_unfinished == 0:
                self._settle(request, None)
        with self._cond:
            self._num_steps += 1

    def _count(self) -> None:
        schedulers = self._engine.schedulers
        with self._cond:
            self._num_running = sum(len(s.running) for s in schedulers)
            self._num_waiting = sum(len(s.waiting) for s in schedulers)

    def _abort_cancelled(self) -> None:
        for request in [r for r in self._snapshot() if r.future.cancelled()]:
            for group in request.groups:
                self._engine.abort(group[0].request_id)
                for seq in group:
                    self._by_seq_id.pop(seq.seq_id, None)
            self._forget(request)

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
