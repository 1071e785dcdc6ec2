"""StallWatch: names the ranks a step or call waits on while it is still under way.

A rank that stalls inside a step (a stopped or wedged process) holds the step until the
collective timeout, minutes by default, while everything looks healthy. The engine loop marks
what it runs (`running`); a thread of the watch's own wakes every `interval_s` and, once the
same step or call has run that long, pings every rank beside its work (`LLMEngine.silent_ranks`:
a rank computing or waiting in a collective answers, a frozen one does not). `stalled` names
the silent ranks until that step or call ends. Ranks silent at two checks in a row of one step
or call are frozen, not slow (a rank computing or waiting answers within milliseconds): they
are killed (`LLMEngine.kill_ranks`), so the step fails at once and the engine rebuilds, instead
of holding every request until the collective timeout (parallel.timeout_s plus a margin:
minutes by default). The pings and that kill are the engine calls made off the loop thread
while it runs.

`watching(engine)` gives the same watch to a caller that steps the engine itself (LLM's calls,
the rollout's batches): a rank frozen inside one of its steps fails that step after two checks,
as in the server, instead of after the collective timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from moe_runtime.engine.engine import LLMEngine
from moe_runtime.executor import QUICK_CALL_TIMEOUT_S

log = logging.getLogger(__name__)


class StallWatch:
    def __init__(
        self, engine: LLMEngine, interval_s: float, is_rebuilding: Callable[[], bool]
    ) -> None:
        """is_rebuilding(): True while the engine rebuilds its workers (inside the failed step:
        unhealthy already, and its old ranks are gone), when nothing is pinged."""
        self._engine, self._interval_s, self._is_rebuilding = engine, interval_s, is_rebuilding
        self._lock = threading.Condition()
        self._busy: tuple[str, float] | None = None  # what the loop runs now, since (monotonic)
        self._stalled: str | None = None  # the finding on it
        self._silent_before: tuple | None = None  # (busy, silent ranks) of the last check
        self._logged: tuple | None = None  # (busy, finding) last logged: each once
        self._is_stopped = False
        threading.Thread(target=self._watch, name="engine-watchdog", daemon=True).start()

    @property
    def stalled(self) -> str | None:
        """The silent ranks of the step or call under way, once it had run interval_s; None
        when there are none (cleared when it ends)."""
        with self._lock:
            return self._stalled

    @contextmanager
    def running(self, what: str) -> Iterator[None]:
        """Mark the loop busy with `what`; the finding on it ends with it."""
        with self._lock:
            self._busy = (what, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._busy, self._stalled = None, None

    def stop(self) -> None:
        with self._lock:
            self._is_stopped = True
            self._lock.notify_all()

    def _kill(self, busy: tuple[str, float], silent: list[int], ran_s: float) -> None:
        """Kill the frozen ranks if `busy` is still what the loop runs (not a rebuild's step):
        a kill that fails is logged, and the watch goes on. The check and the kill are made
        under the watch's lock, so the loop cannot end `busy` and start the next step between
        them (the kill would fail that one, a spurious rebuild of ranks that had answered)."""
        if self._is_rebuilding():  # (the engine's state: read before our lock, not under it)
            return
        why = f"it answered no ping at two checks in a row while {busy[0]} ran {ran_s:.0f}s"
        with self._lock:
            if self._busy is not busy:
                return
            try:
                self._engine.kill_ranks(silent, why)  # a quick call: the actors' kill is queued
            except Exception:
                log.exception("could not kill the stalled ranks %s", silent)

    def _watch(self) -> None:
        while True:
            with self._lock:
                if self._lock.wait_for(lambda: self._is_stopped, self._interval_s):
                    return
                busy = self._busy
            if busy is None or time.monotonic() - busy[1] < self._interval_s:
                continue
            if self._is_rebuilding():
                continue
            silent: list[int] = []
            try:
                silent = self._engine.silent_ranks(QUICK_CALL_TIMEOUT_S)
                found = silent and f"ranks {silent} answered no ping in {QUICK_CALL_TIMEOUT_S:g}s"
            except Exception as exc:  # the executor itself failed: say so rather than nothing
                found = f"the ranks could not be pinged: {type(exc).__name__}: {exc}"
            with self._lock:
                if self._busy is not busy:  # it ended meanwhile: nothing to report
                    continue
                ran_s = time.monotonic() - busy[1]
                self._stalled = f"{found} while {busy[0]} ran {ran_s:.0f}s" if found else None
                # The same ranks silent at two checks in a row of one step: frozen, not slow.
                is_again = bool(silent) and self._silent_before == (busy, silent)
                self._silent_before = (busy, silent) if silent else None
                news = self._stalled if found and self._logged != (busy, found) else None
                self._logged = (busy, found) if news else self._logged
            if news:  # once a finding: else the log said nothing from the stall until the kill
                log.warning("stalled: %s", news)
            if is_again:
                self._kill(busy, silent, ran_s)


@contextmanager
def watching(engine: LLMEngine) -> Iterator[Callable[[str], AbstractContextManager]]:
    """A StallWatch over `engine` for the calling thread's steps and calls while the block
    runs: yields `running(what)` to mark each (the watch's, or one that marks nothing where
    there is nothing to ping: one in-process rank, or server.health_check_interval_s null).
    The watch's thread ends with the block. The engine rebuilds outside the block (the next
    call's), so nothing is pinged while it does; a failed step leaves it dead (engine.error)."""
    interval_s = engine.config.server.health_check_interval_s
    if interval_s is None or engine.config.parallel.world_size == 1:
        yield lambda what: nullcontext()
        return
    watch = StallWatch(engine, interval_s, lambda: engine.error is not None)
    try:
        yield watch.running
    finally:
        watch.stop()
