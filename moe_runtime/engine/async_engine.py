"""AsyncEngine: one background thread that owns an LLMEngine and steps it while there is work.

The loop thread is the engine's only caller. Between steps it runs queued `call`s (a
rebalance, a weight update), adds queued submissions (all prompts or none), aborts cancelled
ones, steps, hands the deltas to `on_output` and resolves each Future with whole outputs. A
bad prompt fails its Future with ValueError. Its health (`is_healthy`, `error`, `stalled`,
`dead_ranks`), the idle loop's checks of its workers, and what a failure that kills the engine
does (every pending Future fails, the workers are rebuilt) are its base class's, Recovery
(engine/recovery.py). `shutdown` is bounded whatever the ranks do: requests still running at
the drain timeout end with EngineUnavailableError, a fault seen while draining or stopping
rebuilds nothing, and a loop stuck in a call to a rank that does not answer has the workers
killed under it, which ends the call. Request semantics are the engine's; this module only
moves work between threads.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.outputs import EngineStats
from moe_runtime.engine.recovery import Recovery
from moe_runtime.engine.stall_watch import StallWatch
from moe_runtime.engine.submission import (
    EngineUnavailableError,
    OutputCallback,
    Submission,
    resolve,
)
from moe_runtime.sampling_params import SamplingParams

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 2.0  # a healthy loop ends its step well inside this; a stuck one never does


class AsyncEngine(Recovery):
    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._check_interval_s = engine.config.server.health_check_interval_s  # None: never
        self._quiet_since = time.monotonic()  # since when the loop has had no work
        self._cond = threading.Condition()  # guards the queue, _live, flags and the snapshot
        self._queue: deque[Submission | tuple[Callable, Future]] = deque()
        self._live: set[Submission] = set()
        self._is_accepting = True
        self._is_stopping = False
        self._is_closing_engine = False  # the loop has ended and shuts the engine down itself
        self._is_drain_cut = False  # cut_drain(): the drain ends now, not at its timeout
        self._has_cancelled = False
        self._error: BaseException | None = None
        self._given_up = False
        self._rebuild_failure: str | None = None  # the last failed rebuild attempt's error
        self._rebuild_started = 0.0  # monotonic, of the rebuild under way (while _error is set)
        self._call: Future | None = None  # the call (`call`) running now
        # Every call accepted and not answered yet, queued, taken by the loop or running: what
        # a drain waits for besides _live.
        self._calls: set[Future] = set()
        self._stats = engine.stats()
        # Sequences of submissions taken from the queue that the published stats do not count
        # yet: not admitted, or admitted since (`stats` adds them). Loop thread: the part of them
        # not admitted yet.
        self._num_unpublished = 0
        self._num_unadmitted = 0
        # Loop thread only: the submission and prompt index of each unfinished request, and
        # the scorings admitted (no deltas: each is settled when its requests are done).
        self._owner: dict[str, tuple[Submission, int]] = {}
        self._scorings: set[Submission] = set()
        self._stall_watch = None  # what the loop waits on in a long step (server's interval)
        if self._check_interval_s is not None:
            is_rebuilding = lambda: self.error is not None  # noqa: E731 (the loop's error)
            self._stall_watch = StallWatch(engine, self._check_interval_s, is_rebuilding)
        # Last: the loop thread may read any attribute above from its first instruction on.
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(
        self,
        prompts: list[str | list[int]],
        params: list[SamplingParams],
        on_output: OutputCallback | None = None,
    ) -> Future:
        """Queue one request per prompt, all or none; the Future resolves to their whole
        RequestOutputs. `on_output(prompt_idx, delta)` runs on the loop thread after each step
        that changed a request; it must be quick and must not block."""
        if len(prompts) != len(params) or not prompts:
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        prompts, params = list(prompts), list(params)
        admit = partial(LLMEngine.add_requests, prompts=prompts, params=params)
        # A value that is no SamplingParams is refused at admission, naming it; 1 until then.
        num_sequences = sum(p.n if isinstance(p, SamplingParams) else 1 for p in params)
        return self._queue_submission(Submission(admit, num_sequences, on_output))

    def submit_scores(
        self,
        sequences: list[list[int]],
        prompt_lens: list[int],
        logprobs: int | None = None,
        return_routed_experts: bool = False,
    ) -> Future:
        """Queue teacher-forced scorings (LLMEngine.add_score_requests), all or none; the Future
        resolves to their whole RequestOutputs."""
        if len(sequences) != len(prompt_lens) or not sequences:
            raise ValueError(f"got {len(prompt_lens)} prompt_lens for {len(sequences)} sequences")
        sequences, prompt_lens = list(sequences), list(prompt_lens)
        admit = partial(
            LLMEngine.add_score_requests,
            sequences=sequences,
            prompt_lens=prompt_lens,
            logprobs=logprobs,
            return_routed_experts=return_routed_experts,
        )
        submission = Submission(admit, len(sequences), None, is_scoring=True)
        return self._queue_submission(submission)

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run fn(engine) on the loop thread between two steps; the Future gets its result."""
        future: Future = Future()
        self._put((fn, future))
        return future

    def stats(self) -> EngineStats:
        """The engine's counts after the last step; num_waiting includes the sequences (each
        prompt's n samples) of submissions not admitted yet, or admitted since (in the step
        under way)."""
        with self._cond:
            queued = sum(item.num_sequences for item in self._queue if isinstance(item, Submission))
            queued += self._num_unpublished  # taken by the loop: admitted or stepped, unpublished
            return dataclasses.replace(self._stats, num_waiting=self._stats.num_waiting + queued)

    def shutdown(
        self, drain_timeout_s: float = 30.0, stop_timeout_s: float = STOP_TIMEOUT_S
    ) -> None:
        """Stop accepting, wait up to drain_timeout_s for requests in flight (the rest fail
        with EngineUnavailableError), then stop the loop and shut the engine down. Returns
        within about drain_timeout_s + 2 * stop_timeout_s: a loop still inside a call after
        stop_timeout_s (a stalled rank) has its workers killed, which fails the call. Safe to
        call more than once."""
        with self._cond:
            self._is_accepting = False
            self._cond.notify_all()  # a rebuild's pause between attempts ends now
            self._cond.wait_for(lambda: self._drained() or self._is_drain_cut, drain_timeout_s)
            self._is_stopping = True
            unfinished, self._live = list(self._live), set()
            if self._stall_watch is not None:
                self._stall_watch.stop()
            call, waiting = self._call, [c for c in self._calls if c is not self._call]
            self._calls = set()
            self._cond.notify_all()
        late = f"when the drain timeout ({drain_timeout_s:g}s) passed"
        if self._is_drain_cut:
            late = "when the drain was cut short (a second stop signal)"
        for future in waiting:  # never run now: _run_call skips them once stopping
            late_call = f"the engine is shutting down: the call was still waiting to run {late}"
            resolve(future, EngineUnavailableError(f"{late_call}; it did not run"), None)
        for submission in unfinished:  # resolved here: the loop may be stuck in a step
            # (read beside the loop: a request in the step under way may read as waiting)
            state = "still running" if submission.has_run() else "still waiting to run"
            late_request = f"the engine is shutting down: the request was {state} {late}"
            resolve(submission.future, EngineUnavailableError(late_request), None)
        if call is not None:  # answered now, not when the workers' kill below fails it
            late_call = (
                f"the engine is shutting down: the call was still running {late}; it may not "
                "have run"
            )
            resolve(call, EngineUnavailableError(late_call), None)
        self._thread.join(stop_timeout_s)
        with self._cond:
            # Why not when the loop is shutting the engine down itself (its last act): a
            # shutdown slower than stop_timeout_s (a busy host) then ran twice, from two threads.
            is_stuck = self._thread.is_alive() and not self._is_closing_engine
        if is_stuck:  # in a call or step that only a rank's timeout would end
            self._engine.shutdown()
        self._thread.join(stop_timeout_s)

    def cut_drain(self) -> None:
        """End a shutdown's drain now (the operator's second stop signal): what is still in flight
        fails as at the drain timeout, saying the drain was cut short. Safe from any thread."""
        with self._cond:
            self._is_drain_cut = True
            self._cond.notify_all()

    def _drained(self) -> bool:
        """Nothing accepted is left to answer: no live submission (_die empties them too), no
        call unanswered (a weight update asked before the drain began: queued, taken by the
        loop or running). Under _cond."""
        return not self._live and not self._calls

    def _queue_submission(self, submission: Submission) -> Future:
        self._put(submission)
        submission.future.add_done_callback(self._on_done)
        return submission.future

    def _put(self, item) -> None:
        with self._cond:
            if not self._is_accepting:  # first: a death while draining rebuilds nothing
                raise EngineUnavailableError("the engine is shutting down")
            self._check_alive()
            stalled = self.stalled
            if stalled is not None and isinstance(item, Submission):
                # It would wait behind the stuck step (then fail with it): retryable now.
                raise EngineUnavailableError(
                    f"the engine is stalled: {stalled}", self._retry_after_stall_s()
                )
            self._queue.append(item)
            if isinstance(item, Submission):
                self._live.add(item)
            else:
                self._calls.add(item[1])
            self._cond.notify_all()

    def _on_done(self, future: Future) -> None:
        if future.cancelled():
            with self._cond:
                self._has_cancelled = True
                self._cond.notify_all()

    def _has_work(self) -> bool:
        return (
            bool(self._queue)
            or self._is_stopping
            or self._has_cancelled
            or (self._error is None and self._engine.has_unfinished())
        )

    def _run(self) -> None:
        try:
            while self._turn():
                pass
        except BaseException as exc:  # a bug here must not leave callers waiting forever
            with self._cond:  # nothing will rebuild: "dead", no Retry-After
                self._error, self._given_up = exc, True
            raise
        finally:
            stopped = EngineUnavailableError("the engine loop stopped first")
            for submission in self._snapshot():
                self._settle(submission, stopped)
            with self._cond:
                leftover, self._queue = list(self._queue), deque()
                self._num_unpublished = 0  # every submission taken is answered above
                calls, self._calls = list(self._calls), set()  # taken from the queue, not run
                self._is_closing_engine = True
                self._cond.notify_all()
            for item in leftover:
                future = item.future if isinstance(item, Submission) else item[1]
                resolve(future, stopped, None)
            for future in calls:
                resolve(future, stopped, None)
            self._engine.shutdown()

    def _turn(self) -> bool:
        """One pass of the loop: wait for work, then admit, call, abort and step; -> False once
        stopping. Why a method of its own: the loop's locals (the last submission admitted or
        cancelled, with its requests, outputs and response) die with each pass; held by a
        loop that then sat idle, they kept a finished request's whole result alive."""
        with self._cond:
            # Idle: sleep until submit/cancel/stop, or until the workers are due a look.
            is_idle = not self._cond.wait_for(self._has_work, self._idle_wait_s())
            if self._is_stopping:
                return False
            incoming, has_cancelled = list(self._queue), self._has_cancelled
            self._queue.clear()
            self._has_cancelled = False
            # Counted by `stats` until published after their admission (at the step's end).
            self._num_unadmitted = self._num_unpublished = sum(
                item.num_sequences for item in incoming if isinstance(item, Submission)
            )
        if is_idle and self._is_check_due():
            self._check_workers()
            self._quiet_since = time.monotonic()
            return True
        if is_idle:  # a died rank's group is rebuilt now, not when a request finds it
            self._check_workers(self._engine.check_dead_ranks)
            return True
        if self._error is None and incoming:
            # A rank that died since the last step, before new requests are scheduled onto it
            # (they fail retryable then; running ones fail in the step anyway) or a call runs
            # on it (it runs on the rebuilt group instead).
            self._check_workers(self._engine.check_dead_ranks)
        for item in incoming:
            if isinstance(item, Submission):
                self._admit(item)
                self._num_unadmitted -= item.num_sequences
                continue
            with self._running("a call between steps (a rebalance or weight update)"):
                self._run_call(*item)
        if has_cancelled:
            for submission in [s for s in self._snapshot() if s.future.cancelled()]:
                self._abort(submission)
                self._settle(submission, None)
        if self._error is None and self._engine.has_unfinished():
            with self._running("a step"):
                self._step()  # publishes the stats (or its death does)
        else:  # admissions, aborts and calls without a step: nobody awaits an abort
            self._publish_stats()
        self._quiet_since = time.monotonic()
        return True

    def _running(self, what: str) -> AbstractContextManager:
        """Mark the loop busy with `what` for the stall watch."""
        return nullcontext() if self._stall_watch is None else self._stall_watch.running(what)

    def _run_call(self, fn: Callable, future: Future) -> None:
        with self._cond:
            # Not once stopping: the drain timed out before it started, and answered it so.
            is_started = not self._is_stopping and future.set_running_or_notify_cancel()
            if is_started:
                self._call = future  # running: what a drain's timeout answers as such
            else:
                self._calls.discard(future)
                self._cond.notify_all()
        if not is_started:
            return
        failure, result, has_killed = None, None, False
        try:
            self._check_alive()  # down before the call (queued behind the one that killed it)
        except EngineUnavailableError as exc:  # refused: the engine stays as it is
            failure = exc
        else:
            try:
                result = fn(self._engine)
            except Exception as exc:  # the caller gets it; a refusal changes nothing else
                failure, has_killed = exc, self._engine.error is not None
        will_rebuild = False
        try:
            if has_killed:  # dead before the answer: its caller then finds the engine down
                will_rebuild = self._fail(failure)  # (the stats published too)
            else:
                self._publish_stats()  # before the answer: a scrape after it sees its effect
        finally:
            resolve(future, failure, result)  # (unless a shutdown answered it first)
            with self._cond:  # answered: a drain no longer waits for it (nor for a rebuild)
                self._call = None
                self._calls.discard(future)
                self._cond.notify_all()
        if will_rebuild:  # after the answer: its caller need not wait for the new workers
            self._rebuild()

    def _admit(self, submission: Submission) -> None:
        try:
            # Done already: cancelled, or failed with an engine that died while it was queued.
            if submission.future.done():
                return self._settle(submission, None)
            self._check_alive()
            submission.requests = submission.admit(self._engine)
        except Exception as exc:  # ValueError: a bad prompt; nothing of it was queued
            return self._settle(submission, exc)
        for prompt_idx, request in enumerate(submission.requests):
            self._owner[request.request_id] = (submission, prompt_idx)
        if submission.is_scoring:
            self._scorings.add(submission)

    def _step(self) -> None:
        try:
            deltas = self._engine.step()
        except Exception as exc:  # a worker failure: every pending request ends with it
            self._die(exc)
            return
        self._publish_stats()  # before the deltas and results: a scrape after them counts it
        failed: dict[int, tuple[Submission, Exception]] = {}
        for delta in deltas:
            submission, prompt_idx = self._owner[delta.request_id]
            if submission.on_output is not None and id(submission) not in failed:
                try:
                    submission.on_output(prompt_idx, delta)
                except Exception as exc:  # a failing callback ends only its own submission
                    failed[id(submission)] = (submission, exc)
        for submission, exc in failed.values():
            self._abort(submission)
            self._settle(submission, exc)
        if failed:  # their aborts freed sequences after the stats above
            self._publish_stats()
        for delta in deltas:
            owner = self._owner.get(delta.request_id)
            if owner is not None and delta.is_finished and owner[0].is_finished():
                self._settle(owner[0], None)
        for submission in list(self._scorings):  # no deltas: read whole once done
            if submission.is_finished():
                self._settle(submission, None)

    def _publish_stats(self) -> None:
        """What `stats` reads, as of now. Why before a step's deltas and results, and a call's
        answer: a scrape that follows a response must count what produced it (it showed the
        finished request still running and its step uncounted)."""
        stats = self._engine.stats()
        with self._cond:
            self._stats, self._num_unpublished = stats, self._num_unadmitted

    def _abort(self, submission: Submission) -> None:
        self._engine.abort(*(r.request_id for r in submission.requests if not r.is_finished))

    def _settle(self, submission: Submission, error: BaseException | None) -> None:
        for request in submission.requests:
            self._owner.pop(request.request_id, None)
        self._scorings.discard(submission)
        outputs = [self._engine.output(r) for r in submission.requests] if error is None else None
        resolve(submission.future, error, outputs)
        with self._cond:
            self._live.discard(submission)
            self._cond.notify_all()

    def _snapshot(self) -> list[Submission]:
        with self._cond:
            return list(self._live)
