"""Faults under the engine on CPU (world size 2 on Ray where ranks matter).

A stalled worker (SIGSTOP) fails nothing itself: its peer's collective times out first; the
error must still name it, within the README's bound. A corrupt checkpoint is refused on every
rank before anything changes. A failure that kills the engine ends every request in flight.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from moe_runtime import LLM, SamplingParams
from moe_runtime.engine.async_engine import AsyncEngine
from moe_runtime.executor import WorkerError
from tests.invariance import TINY_CONFIG, fingerprint
from tests.serving import write_checkpoint

TIMEOUT_S = 5


def test_stalled_worker_is_named(ray_local):
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


def test_corrupt_checkpoint_is_refused_and_changes_nothing(ray_local, tmp_path):
    """A directory with a malformed config.json and random bytes as its safetensors file: every
    rank refuses it before any rank changes anything, and the next answer is bitwise the same."""
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes(os.urandom(4096))
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    llm = LLM(TINY_CONFIG, **{"parallel.world_size": 2})
    try:
        before = [fingerprint(o) for o in llm.generate([[5, 6, 7], [8, 9]], params)]
        with pytest.raises(ValueError, match="model.safetensors|weights"):
            llm.update_weights(str(tmp_path))
        assert llm.engine.error is None and llm.engine.weight_version == 0
        after = [fingerprint(o) for o in llm.generate([[5, 6, 7], [8, 9]], params)]
    finally:
        llm.shutdown()
    assert after == before


def test_a_failure_that_kills_the_engine_ends_every_stream(tmp_path):
    """A weight update that fails after the check (mid-copy) kills the engine: the request in
    flight ends with the error at once, not at a timeout; then the engine rebuilds its worker
    with the weights it served and answers again."""
    checkpoint = write_checkpoint(tmp_path, seed=1)
    llm = LLM({"model": {"path": checkpoint}, "scheduler": {"max_model_len": 512}})
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    before = fingerprint(llm.generate([5, 6, 7], params)[0])

    def broken_commit():
        raise RuntimeError("injected: copy failed")

    llm.engine.executor.worker.commit_weights = broken_commit
    loop = AsyncEngine(llm.engine)
    deltas = []
    in_flight = loop.submit(
        [[1, 2, 3]],
        [SamplingParams(max_tokens=500, ignore_eos=True)],
        lambda i, d: deltas.append(d),
    )
    while not deltas:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="injected"):
        loop.call(lambda engine: engine.update_weights(checkpoint)).result(timeout=30)
    with pytest.raises(RuntimeError, match="injected"):
        in_flight.result(timeout=5)
    _wait_healthy(loop)
    assert loop.stats().num_restarts == 1
    after = loop.submit([[5, 6, 7]], [params]).result(timeout=30)
    loop.shutdown()
    assert fingerprint(after[0]) == before


def test_killed_worker_is_replaced_and_answers_stay_bitwise(ray_local):
    """kill -9 of a rank under load: requests in flight fail fast, the engine rebuilds the
    worker group by itself (no server restart) and the same requests give the same bits."""
    llm = LLM(TINY_CONFIG, **{"parallel.world_size": 2, "parallel.timeout_s": 20})
    loop = AsyncEngine(llm.engine)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    before = [fingerprint(o) for o in loop.submit(prompts, [params] * 2).result(timeout=60)]
    pid = llm.engine.executor.call_all("pid")[1]
    deltas = []
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    in_flight = loop.submit([[1, 2, 3], [4, 5]], [long] * 2, lambda i, d: deltas.append(d))
    while not deltas:
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1"):
        in_flight.result(timeout=60)
    assert time.monotonic() - started < 10, "the dead rank was not noticed at once"
    _wait_healthy(loop)
    assert loop.stats().num_restarts == 1
    after = [fingerprint(o) for o in loop.submit(prompts, [params] * 2).result(timeout=60)]
    loop.shutdown()
    assert after == before


def _wait_healthy(loop: AsyncEngine, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not loop.is_healthy:
        assert time.monotonic() < deadline, f"no recovery: {loop.error}"
        time.sleep(0.05)
