"""RankFaults: the engine's calls that ask its ranks how they are, and what a failed call
does to the engine (LLMEngine's base).

A rank that died, stalled or failed mid-collective leaves the ranks out of step: every request
in flight ends with the error, the queues start afresh, and the engine stays dead until
`LLMEngine.restart`. The liveness calls (dead_ranks, silent_ranks, kill_ranks) take no lock, so
the engine's watchdog can use them beside a step; the others run under the engine's lock.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
from collections.abc import Callable

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.balancer import RebalanceError
from moe_runtime.engine.request import SequenceStatus
from moe_runtime.engine.scheduler import Scheduler
from moe_runtime.executor import QUICK_CALL_TIMEOUT_S, WorkerError
from moe_runtime.heap import drop_frames


def under_lock(method: Callable) -> Callable:
    """The method run under its object's `_lock` (the engine's here, the LLM's in llm.py)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class RankFaults:
    """Set by LLMEngine: its config, lock, error, executor (a property there) and schedulers."""

    config: RuntimeConfig
    _lock: threading.RLock
    error: str | None
    _is_interrupted: bool
    _owner_pid: int
    schedulers: list[Scheduler]

    def _reset_queues(self) -> None:
        raise NotImplementedError

    @under_lock
    def worker_stats(self) -> list[dict]:
        """Each rank's counters (Worker.stats), in rank order. A rank that does not answer
        (dead, stalled) kills the engine, as a step would: it could not serve the next one."""
        self._check_alive()
        with self._fatal_on_error():
            return self.executor.call_all("stats", timeout_s=QUICK_CALL_TIMEOUT_S)

    @under_lock
    def device_identities(self) -> list[dict[str, str]]:
        """The ranks' distinct `device_identity`s (moe_runtime/worker/worker.py), each once,
        in a fixed order: what of the hardware the bits may depend on, however many ranks run.
        A rank that does not answer kills the engine, as in `worker_stats`."""
        self._check_alive()
        with self._fatal_on_error():
            identities = self.executor.call_all("device_identity", timeout_s=QUICK_CALL_TIMEOUT_S)
        unique = {json.dumps(identity, sort_keys=True): identity for identity in identities}
        return [unique[key] for key in sorted(unique)]

    @under_lock
    def check_workers(self) -> None:
        """Every rank answers a cheap call within QUICK_CALL_TIMEOUT_S, or the engine dies
        (WorkerError naming the rank) as if a step had found it: an idle server learns of a
        dead or stalled rank before a request does."""
        self._check_alive()
        with self._fatal_on_error():
            self.executor.call_all("ping", timeout_s=QUICK_CALL_TIMEOUT_S)

    @under_lock
    def check_dead_ranks(self) -> None:
        """The engine dies (WorkerError naming them) if any rank is known dead without asking
        it (RayExecutor.dead_ranks: a died actor's outstanding call failed), so the step about
        to run is not scheduled onto a rank that is gone. Costs no round trip."""
        self._check_alive()
        with self._fatal_on_error():
            dead = self.dead_ranks()
            if dead:
                raise WorkerError(f"ranks {dead} died while no step ran (found before a step)")

    def dead_ranks(self) -> list[int]:
        """The ranks known dead now, without asking them: safe from any thread; [] with one
        in-process rank."""
        return self.executor.dead_ranks()

    def kill_ranks(self, ranks: list[int], why: str) -> None:
        """Kill these ranks (stalled ones): the step or call waiting on them fails at once,
        naming `why`, and the engine dies as with any dead rank. Safe from any thread."""
        self.executor.kill_ranks(ranks, why)

    def silent_ranks(self, timeout_s: float = QUICK_CALL_TIMEOUT_S) -> list[int]:
        """The ranks that answer no ping within timeout_s, asked beside the step or call under
        way: safe from another thread (the engine's watchdog). [] with one in-process rank."""
        return self.executor.silent_ranks(timeout_s)

    def _check_alive(self) -> None:
        self._check_process()
        if self.error is not None:
            raise RuntimeError(f"the engine is dead: {self.error}")

    def _check_process(self) -> None:
        """RuntimeError in a process forked from the engine's (a data loader's worker, a
        multiprocessing pool with the fork start method) when its ranks are Ray actors: the
        child's copy of the driver cannot reach them (a call waited for the step's timeout,
        minutes, then blamed the ranks). One rank runs in the process: the child has a copy."""
        if self.config.parallel.world_size > 1 and os.getpid() != self._owner_pid:
            raise RuntimeError(
                f"this engine's Ray workers belong to process {self._owner_pid}; process "
                f"{os.getpid()} was forked from it and cannot drive them: make the LLM in the "
                "child, or start children with the 'spawn' or 'forkserver' method"
            )

    @contextlib.contextmanager
    def _fatal_on_error(self):
        """A worker that died, stalled or failed mid-collective leaves the ranks out of step:
        every request in flight ends with the error and the engine stays dead."""
        with self._dead_if_interrupted("a call to the ranks"):
            try:
                yield
            except RebalanceError:
                raise  # every rank agreed to keep the old placement: still in step
            except Exception as exc:
                drop_frames(exc)  # a rank in this process: its model must not outlive the rebuild
                error = str(exc) if isinstance(exc, WorkerError) else f"{type(exc).__name__}: {exc}"
                self._fail_all(error)
                if isinstance(exc, ValueError):  # a fault, never the request's: not a 400
                    raise WorkerError(error) from exc
                raise

    @contextlib.contextmanager
    def _dead_if_interrupted(self, what: str):
        """A KeyboardInterrupt or SystemExit inside `what`: the ranks may have run it while the
        driver recorded none of it (a Ctrl-C in a notebook's generate), so the next step would
        find them out of step. The engine dies saying so; restart() rebuilds it."""
        try:
            yield
        except Exception:
            raise
        except BaseException as exc:
            drop_frames(exc)  # a rank in this process: its model must not outlive the rebuild
            if self.error is None:
                self._fail_all(f"{what} was interrupted ({type(exc).__name__})", interrupted=True)
            raise

    def _fail_all(self, error: str, interrupted: bool = False) -> None:
        """Every request in flight ends with the error; nothing is left waiting forever. The
        queues and block tables start afresh (the ranks' caches are unknown now; a rebuild
        gives new ones), so stats() shows no KV in use by the failed requests. interrupted:
        the error is a Ctrl-C's (restart)."""
        self.error, self._is_interrupted = error, interrupted
        for scheduler in self.schedulers:
            for seq in (*scheduler.waiting, *scheduler.running):
                seq.status, seq.finish_reason, seq.error = SequenceStatus.FINISHED, "error", error
        self._reset_queues()
