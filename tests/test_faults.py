"""Faults under the engine on CPU with Ray (world size 2): what the caller is told.

A stalled worker (SIGSTOP) fails nothing itself: its peer's collective times out first. The
error must still name the stalled rank, within the bound the README states (timeout_s + 30 s).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from moe_runtime import LLM, SamplingParams
from moe_runtime.executor import WorkerError
from tests.invariance import TINY_CONFIG

TIMEOUT_S = 5


def test_stalled_worker_is_named():
    llm = LLM(TINY_CONFIG, **{"parallel.world_size": 2, "parallel.timeout_s": TIMEOUT_S})
    engine = llm.engine
    pids = engine.executor.call_all("pid")
    try:
        engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(pids[1], signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(WorkerError, match=r"ranks \[1\] stalled during step"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - started < TIMEOUT_S + 30
        with pytest.raises(RuntimeError, match="engine is dead"):
            engine.add_request([1, 2, 3], SamplingParams())
    finally:
        os.kill(pids[1], signal.SIGCONT)
        llm.shutdown()
