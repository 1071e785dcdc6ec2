"""engine/stall_watch.py's StallWatch on a fake engine: ranks silent at two checks in a row of
one step are killed, and only while that step still runs."""

from __future__ import annotations

import threading
import time

from moe_runtime.engine.stall_watch import StallWatch

INTERVAL_S = 0.02


class SilentEngine:
    """Rank 1 answers no ping; the kills are recorded with whether the step still ran."""

    def __init__(self) -> None:
        self.watch: StallWatch | None = None
        self.kills: list[tuple[list[int], bool]] = []
        self.num_pings = 0

    def silent_ranks(self, timeout_s: float) -> list[int]:
        self.num_pings += 1
        return [1]

    def kill_ranks(self, ranks: list[int], why: str) -> None:
        self.kills.append((ranks, self.watch._busy is not None))


def _step(watch: StallWatch, done: threading.Event) -> threading.Thread:
    def run() -> None:
        with watch.running("a decode step"):
            done.wait(10)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_ranks_silent_at_two_checks_of_one_step_are_killed():
    engine = SilentEngine()
    engine.watch = watch = StallWatch(engine, INTERVAL_S, lambda: False)
    done = threading.Event()
    step = _step(watch, done)
    try:
        _wait_for(lambda: engine.kills)
        assert engine.kills[0] == ([1], True)
        assert "ranks [1] answered no ping" in watch.stalled
    finally:
        done.set()
        step.join(10)
        watch.stop()
    assert watch.stalled is None  # the finding ends with the step


def test_a_step_that_ends_before_the_kill_is_not_failed_by_it():
    """The step ends in the gap between the watch's second finding and its kill (here: while
    it asks whether the engine rebuilds). The kill checked that the step still ran, released
    its lock, then killed: the ranks had answered that step and the kill failed the next one.
    Now a step that ended is never killed for."""
    done = threading.Event()
    engine = SilentEngine()
    steps: list[threading.Thread] = []

    def is_rebuilding() -> bool:
        if engine.num_pings >= 2 and not done.is_set():  # _kill's question, after two pings
            done.set()
            steps[0].join(10)  # the step ends (the loop leaves `running`) right here
        return False

    engine.watch = watch = StallWatch(engine, INTERVAL_S, is_rebuilding)
    killed = threading.Event()  # the watch's _kill returned (it killed or found the step over)
    kill = watch._kill
    watch._kill = lambda *args: kill(*args) or killed.set()
    steps.append(_step(watch, done))
    try:
        _wait_for(killed.is_set)
        assert engine.num_pings >= 2  # engagement: the watch found the rank silent twice
        assert engine.kills == []
    finally:
        done.set()
        watch.stop()
