"""Recovery: AsyncEngine's health and what it does when its engine dies, apart from its loop.

A failure that kills the engine (a rank died or stalled) fails every pending Future at once, then
the engine rebuilds its workers (`is_healthy` False meanwhile); after parallel.max_restarts
rebuilds within parallel.restart_window_s it gives up (`has_given_up`), and at once where the
served weights' source changed since they were read (WeightsChangedError: a rebuild would serve
other weights under the same version). An engine idle for `server.health_check_interval_s` checks
that every rank still answers (`LLMEngine.check_workers`), so a rank that died between requests
is rebuilt before a request meets it; every DEAD_RANK_POLL_S an idle loop also looks for ranks
known dead without asking them (`dead_ranks`) and rebuilds at once, with no request or check
needed to set it off (a load balancer that sends nothing to a 503 would otherwise wait on it
forever). In a step or call that long, `stalled` names the ranks that answer no ping beside their
work (engine/stall_watch.py: a /health 503 long before the step's own timeout fails it; new
submissions are refused meanwhile, retryable; ranks silent at two checks in a row are killed,
which fails the step at once). A rank found dead without asking it (its outstanding liveness
call failed: `dead_ranks`) kills the engine before new submissions are admitted or a call runs
(it runs on the rebuilt group). A fault seen while draining or stopping rebuilds nothing.

Apart from engine/async_engine.py because none of it moves work between threads; a base class of
AsyncEngine, not an object of its own, because both halves share one lock and one set of flags.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.stall_watch import StallWatch
from moe_runtime.engine.submission import EngineUnavailableError
from moe_runtime.engine.weights_source import WeightsChangedError
from moe_runtime.executor import QUICK_CALL_TIMEOUT_S

# AsyncEngine's logger: the server's log names it for the engine's deaths and rebuilds (README).
log = logging.getLogger("moe_runtime.engine.async_engine")
DEAD_RANK_POLL_S = 1.0  # how often an idle loop looks for ranks known dead (no round trip)
# After the k-th failed rebuild attempt in a row the next waits REBUILD_BACKOFF_S * 2**(k-1),
# REBUILD_BACKOFF_MAX_S at most. Why: a cause that clears in seconds (a dead rank's GPU memory
# not yet freed, its Ray resources not yet returned) would otherwise spend every restart at once.
REBUILD_BACKOFF_S = 1.0
REBUILD_BACKOFF_MAX_S = 30.0


class Recovery:
    """AsyncEngine's health properties, its checks of idle workers, its death and its rebuilds.
    Sets none of the state below: AsyncEngine.__init__ does, and _cond guards the flags (what
    each holds is said there). Calls back AsyncEngine's _publish_stats, _snapshot and _settle."""

    _engine: LLMEngine
    _cond: threading.Condition
    _thread: threading.Thread
    _check_interval_s: float | None
    _quiet_since: float
    _is_accepting: bool
    _is_stopping: bool
    _error: BaseException | None
    _given_up: bool
    _rebuild_failure: str | None
    _rebuild_started: float
    _stall_watch: StallWatch | None

    @property
    def is_healthy(self) -> bool:
        with self._cond:
            return self._thread.is_alive() and self._error is None and self._is_accepting

    @property
    def has_given_up(self) -> bool:
        """True once the engine is dead for good (its restarts are spent)."""
        with self._cond:
            return self._given_up

    @property
    def stalled(self) -> str | None:
        """Why the step or call under way looks stuck: the ranks that answered no ping after it
        had run server.health_check_interval_s; None when it is not (cleared when it ends)."""
        return None if self._stall_watch is None else self._stall_watch.stalled

    @property
    def dead_ranks(self) -> list[int]:
        """The ranks known dead now, without asking them (LLMEngine.dead_ranks; a died rank is
        found here before the loop's next step or check); [] while rebuilding or stopping."""
        with self._cond:
            if self._error is not None or self._is_stopping:
                return []
        try:
            return self._engine.dead_ranks()
        except Exception:  # the executor is being replaced under this thread: not known
            return []

    @property
    def error(self) -> str | None:
        """Why the engine is down (None when it is not), and why the last rebuild attempt
        failed while the next one runs."""
        with self._cond:
            if self._error is None:
                return None
            error = f"{type(self._error).__name__}: {self._error}"
            if self._rebuild_failure is not None:
                error += f"; rebuilding the workers failed ({self._rebuild_failure}), trying again"
            return error

    def _check_alive(self) -> None:
        if self._error is None:
            return
        if self._given_up or not self._is_accepting:  # nothing rebuilds: no retry to wait for
            state = "dead" if self._given_up else "shutting down"
            raise EngineUnavailableError(f"the engine is {state}: {self.error}")
        raise EngineUnavailableError(
            f"the engine is recovering: {self.error}", self._retry_after_rebuild_s()
        )

    def _retry_after_rebuild_s(self) -> float:
        """When the rebuild under way may be done: the engine's last start or rebuild took
        `build_s`; less what this one has run, at least a second. Why: clients retry a 503 on
        their own schedule unless told (the openai client: twice, 0.5 s and 1 s apart, far
        inside a rebuild), and read Retry-After where it is sent. A rebuild past build_s is
        given as long again as it has overrun (at most build_s): told 1 s, every client
        retried each second for the rest of a rebuild that had outlasted its estimate."""
        build_s = self._engine.build_s
        left_s = build_s - (time.monotonic() - self._rebuild_started)
        return max(1.0, left_s if left_s >= 0 else min(-left_s, build_s))

    def _retry_after_stall_s(self) -> float:
        """A stalled rank is killed at the watchdog's next check (its interval, then a ping's
        timeout), and the group rebuilt."""
        return self._check_interval_s + QUICK_CALL_TIMEOUT_S + self._engine.build_s

    def _idle_wait_s(self) -> float:
        """How long an idle loop sleeps: until its workers are due a check, DEAD_RANK_POLL_S at
        most. Under _cond."""
        if not self._is_check_due(DEAD_RANK_POLL_S):
            return DEAD_RANK_POLL_S
        return max(0.0, self._quiet_since + self._check_interval_s - time.monotonic())

    def _is_check_due(self, within_s: float = 0.0) -> bool:
        """Whether the loop will have been idle for server.health_check_interval_s within_s
        from now (never without an interval)."""
        if self._check_interval_s is None:
            return False
        return time.monotonic() + within_s >= self._quiet_since + self._check_interval_s

    def _check_workers(self, check: Callable[[], None] | None = None) -> None:
        """check() (default: every rank answers a ping), the engine dying of what it finds."""
        if self._error is None:  # not once the engine has given up
            try:
                (check or self._engine.check_workers)()
            except Exception as exc:  # a rank died or stalled while nothing ran
                self._die(exc)

    def _die(self, error: BaseException) -> None:
        """The engine died: every pending request (streams included) ends with the error at
        once, then the worker group is rebuilt, unhealthy meanwhile, until restarts run out;
        never once draining or stopping (a rebuild would outlast the drain, and nothing would
        use it). Each step is logged; a rebuild attempt that fails is named by `error` (what
        /health and the 503s say) while the next one runs."""
        if self._fail(error):
            self._rebuild()

    def _fail(self, error: BaseException) -> bool:
        """`_die` up to the rebuild: the engine marked dead (or given up), every pending request
        ended with the error, logged. -> whether a rebuild follows."""
        # Restarts already spent: the engine is dead for good before any request hears of
        # it, so /health and a new submission say so as the failures arrive, and requests that
        # never ran are not told to retry a rebuild that will not come.
        refusal = self._engine.restart_refusal()
        with self._cond:
            self._error, self._rebuild_started = error, time.monotonic()
            will_rebuild = self._is_accepting and not self._is_stopping
            gives_up = will_rebuild and refusal is not None
            if gives_up:
                self._error, self._given_up, will_rebuild = refusal, True, False
        failed_first = f"the engine failed before the request ran ({type(error).__name__}: {error})"
        if will_rebuild:  # in no step yet, the failed one too: a retry may run it
            never_ran = EngineUnavailableError(
                f"{failed_first}; it is rebuilding its workers", self._retry_after_rebuild_s()
            )
        elif gives_up:
            never_ran = EngineUnavailableError(f"{failed_first}; the engine {refusal}")
        else:
            never_ran = EngineUnavailableError(f"{failed_first}; the engine is shutting down")
        self._publish_stats()  # what /metrics reads meanwhile: the failed requests gone
        live = self._snapshot()
        for submission in live:
            self._settle(submission, error if submission.has_run() else never_ran)
        # The log holds the cause's traceback (a client gets one line).
        log.error(
            "the engine died (%s: %s); %d request(s) in flight ended with it",
            type(error).__name__,
            error,
            len(live),
            exc_info=error,
        )
        if gives_up:
            log.error("the engine gave up: %s", refusal)
        return will_rebuild

    def _rebuild(self) -> None:
        """Rebuild the dead engine's worker group, attempt after attempt with a growing pause,
        until one works (healthy again), max_restarts attempts failed in a row or the engine's
        restarts are spent or its weights' source changed (given up), or a drain or stop comes
        (nothing rebuilt)."""
        num_failed = 0  # rebuild attempts failed in a row
        while True:
            with self._cond:
                if self._is_stopping or not self._is_accepting:
                    self._rebuild_failure = None  # no attempt follows it
                    return  # draining: nothing new will run, and a rebuild would outlast it
                started = self._rebuild_started = time.monotonic()  # this attempt's
            log.warning("rebuilding the worker group")
            try:
                self._engine.restart()
            except Exception as exc:
                failed = f"{type(exc).__name__}: {exc}"
                num_failed += 1
                # Why the count in a row too: paused attempts can fall out of the restart
                # window one by one, and the engine would then never give up.
                in_a_row = num_failed < self._engine.config.parallel.max_restarts
                if (
                    in_a_row
                    and self._engine.restart_refusal() is None
                    and not isinstance(exc, WeightsChangedError)
                ):
                    pause_s = min(REBUILD_BACKOFF_S * 2 ** (num_failed - 1), REBUILD_BACKOFF_MAX_S)
                    log.error(
                        "rebuilding the worker group failed (%s); trying again in %gs",
                        failed,
                        pause_s,
                    )
                    with self._cond:
                        self._rebuild_failure = failed
                        self._rebuild_started = time.monotonic() + pause_s  # for Retry-After
                        # A drain or stop ends the pause (and rebuilds nothing).
                        self._cond.wait_for(lambda: not self._is_accepting, pause_s)
                    continue  # this rebuild failed; the next one counts too
                log.error("the engine gave up: %s", failed)
                with self._cond:
                    self._error, self._given_up, self._rebuild_failure = exc, True, None
                return
            log.warning("rebuilt the worker group in %.1fs", time.monotonic() - started)
            self._publish_stats()
            with self._cond:
                self._error, self._rebuild_failure = None, None
            return
