"""Faults under the engine on CPU (world size 2 on Ray where ranks matter).

A stalled worker (SIGSTOP) fails nothing itself: its peer's collective times out first; the
error must still name it, within the README's bound. A corrupt checkpoint is refused on every
rank before anything changes. A failure that kills the engine ends every request in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

import moe_runtime.engine.recovery as recovery_module
import moe_runtime.engine.worker_group as worker_group_module
from moe_runtime import LLM, SamplingParams
from moe_runtime.engine.async_engine import AsyncEngine, EngineUnavailableError
from moe_runtime.engine.stall_watch import StallWatch
from moe_runtime.executor import WorkerError
from tests.checkpoints import TINY_HF
from tests.invariance import TINY_CONFIG, fingerprint
from tests.serving import merge_completion_chunks, write_checkpoint

TIMEOUT_S = 5
ROOT = Path(__file__).resolve().parent.parent


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


def test_a_rank_stalled_inside_a_step_is_named_long_before_the_step_times_out(ray_local):
    """A stopped rank answers nothing while its peer waits in a collective until
    parallel.timeout_s (then the step fails, + 30 s at most). The watchdog names it after
    server.health_check_interval_s, /health turns 503 "stalled", and rank 0, inside the same
    collective, still answers its ping (a thread of its own). Control: a loop busy as long in a
    call, every rank alive, is probed and reported as nothing. Resumed after the first finding
    (before the next check, which would kill it), the step and the request finish and the
    finding ends."""
    from launch.generation import Backend
    from launch.server_app import create_app

    overrides = {"parallel.timeout_s": 60, "server.health_check_interval_s": 1.0}
    llm = LLM(TINY_CONFIG, **{"parallel.world_size": 2, **overrides})
    probes, probe = [], llm.engine.silent_ranks

    def spy(timeout_s):
        probes.append(probe(timeout_s))
        return probes[-1]

    llm.engine.silent_ranks = spy
    loop = AsyncEngine(llm.engine)
    app = create_app(llm.engine.config, Backend(loop, llm.engine.tokenizer))
    pids = llm.engine.executor.call_all("pid")
    try:
        loop.call(lambda engine: time.sleep(3.5)).result(timeout=30)
        assert probes and all(silent == [] for silent in probes), probes  # probed: all answer
        assert loop.stalled is None and _health(app) == (200, "ok")
        future = _generating(loop, 600)
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        while loop.stalled is None and time.monotonic() - stopped < 45:
            time.sleep(0.1)
        found_s = time.monotonic() - stopped
        assert loop.stalled is not None and found_s < 30, found_s  # the step's bound: 60 + 30
        assert re.fullmatch(
            r"ranks \[1\] answered no ping in 10s while a step ran \d+s", loop.stalled
        )
        assert _health(app) == (503, "stalled") and loop.is_healthy  # not failed (yet)
    finally:
        os.kill(pids[1], signal.SIGCONT)
    assert len(future.result(timeout=120)[0].outputs[0].token_ids) == 600
    assert loop.stalled is None and _health(app) == (200, "ok")
    loop.shutdown()


def _generating(loop: AsyncEngine, max_tokens: int):
    """The Future of one request of max_tokens (no stop), once its first token has come."""
    first = threading.Event()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    future = loop.submit([[1, 2, 3, 4]], [params], lambda i, d: first.set())
    assert first.wait(30)
    return future


def _health(app) -> tuple[int, str]:
    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/health")

    response = asyncio.run(get())
    return response.status_code, response.json()["status"]


# config.json of TINY_CONFIG's model: a directory with it passes the config check, so its
# weights file is what gets read (and refused).
TINY_CONFIG_JSON = {
    **TINY_HF,
    "model_type": "deepseek_v3",
    "q_lora_rank": 32,
    "max_position_embeddings": 2048,
    "routed_scaling_factor": 2.5,
}
NOT_SAFETENSORS = bytes(range(256)) * 16  # its first 8 bytes declare an absurd header length
CORRUPT_CHECKPOINTS = {  # case -> (config.json text, the refusal it must give)
    "corrupt_safetensors": (
        json.dumps(TINY_CONFIG_JSON),
        r"model\.safetensors' is not valid safetensors",
    ),
    "bad_json": ("{not json", r"config\.json is not valid JSON"),
}


@pytest.mark.parametrize("case", CORRUPT_CHECKPOINTS)
def test_corrupt_checkpoint_is_refused_and_changes_nothing(ray_local, tmp_path, case):
    """A directory whose config.json describes the running model but whose safetensors file is
    no safetensors, or whose config.json is malformed: every rank refuses it, naming what is
    wrong, before any rank changes anything, and the next answer is bitwise the same."""
    config_text, refusal = CORRUPT_CHECKPOINTS[case]
    (tmp_path / "config.json").write_text(config_text)
    (tmp_path / "model.safetensors").write_bytes(NOT_SAFETENSORS)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    llm = LLM(TINY_CONFIG, **{"parallel.world_size": 2})
    try:
        before = [fingerprint(o) for o in llm.generate([[5, 6, 7], [8, 9]], params)]
        with pytest.raises(ValueError, match=refusal):
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


def test_a_rank_that_dies_while_idle_is_rebuilt_before_a_request_meets_it(ray_local):
    """kill -9 of a rank while nothing runs: the idle engine's check finds it and rebuilds the
    group by itself, so /health does not say 200 over a dead rank and the next request is
    answered, with the same bits, instead of failing."""
    overrides = {"parallel.world_size": 2, "parallel.timeout_s": 20}
    overrides["server.health_check_interval_s"] = 0.5
    llm = LLM(TINY_CONFIG, **overrides)
    pid = llm.engine.executor.call_all("pid")[1]  # before the loop thread calls the ranks
    loop = AsyncEngine(llm.engine)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    before = fingerprint(loop.submit([[5, 6, 7]], [params]).result(timeout=60)[0])
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while loop.stats().num_restarts == 0:  # engagement: no request was sent since the kill
        assert time.monotonic() < deadline, "the idle engine never noticed the dead rank"
        time.sleep(0.05)
    _wait_healthy(loop)
    after = fingerprint(loop.submit([[5, 6, 7]], [params]).result(timeout=60)[0])
    loop.shutdown()
    assert after == before and loop.stats().num_restarts == 1


def test_a_rank_dead_between_checks_is_on_health_at_once_and_never_scheduled(
    ray_local, monkeypatch
):
    """kill -9 of a rank while nothing runs, the idle check minutes away: /health said 200
    until that check, and the next request was scheduled onto the dead rank and failed with a
    500 (WorkerError, not retryable) though nothing of it ran. Now the death is known without
    asking (each rank's outstanding liveness call fails): /health is 503 at once, and the
    request gets the retryable 503 while the engine rebuilds; after it, the same bits. (The
    idle loop's own look for dead ranks is put off here: the request must be what finds it.)"""
    from launch.generation import Backend
    from launch.server_app import create_app

    monkeypatch.setattr(recovery_module, "DEAD_RANK_POLL_S", 600.0)
    overrides = {"parallel.world_size": 2, "server.health_check_interval_s": 600}
    llm = LLM(TINY_CONFIG, **overrides)
    pid = llm.engine.executor.call_all("pid")[1]  # before the loop thread calls the ranks
    loop = AsyncEngine(llm.engine)
    app = create_app(llm.engine.config, Backend(loop, llm.engine.tokenizer))
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    try:
        before = fingerprint(loop.submit([[5, 6, 7]], [params]).result(timeout=60)[0])
        assert _health(app) == (200, "ok") and loop.dead_ranks == []
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _health(app)[0] == 200:
            assert time.monotonic() < deadline, "/health said 200 over the dead rank"
            time.sleep(0.05)
        assert _health(app) == (503, "unavailable") and loop.dead_ranks == [1]
        assert loop.stats().num_restarts == 0  # found by /health, not by a check or a step
        with pytest.raises(EngineUnavailableError, match="failed before the request ran"):
            loop.submit([[5, 6, 7]], [params]).result(timeout=60)
        _wait_healthy(loop)
        after = fingerprint(loop.submit([[5, 6, 7]], [params]).result(timeout=60)[0])
        assert after == before and loop.stats().num_restarts == 1
    finally:
        loop.shutdown()


@pytest.mark.parametrize("interval", [600, None])
def test_an_idle_engine_rebuilds_a_dead_rank_with_no_request_to_find_it(ray_local, interval):
    """kill -9 of a rank while nothing runs, the ping check minutes away or off: /health said
    503 until a request came to find the dead rank and set off the rebuild, so a load balancer
    that sends nothing to a 503 server never got it back. Now the idle loop looks for ranks
    known dead every DEAD_RANK_POLL_S and rebuilds by itself; after it, the same bits."""
    overrides = {"parallel.world_size": 2, "server.health_check_interval_s": interval}
    llm = LLM(TINY_CONFIG, **overrides)
    pid = llm.engine.executor.call_all("pid")[1]  # before the loop thread calls the ranks
    loop = AsyncEngine(llm.engine)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    try:
        before = fingerprint(loop.submit([[5, 6, 7]], [params]).result(timeout=60)[0])
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while loop.stats().num_restarts == 0 or not loop.is_healthy:
            assert time.monotonic() < deadline, f"not rebuilt without a request: {loop.error}"
            time.sleep(0.05)
        assert loop.stats().num_restarts == 1 and loop.dead_ranks == []
        after = fingerprint(loop.submit([[5, 6, 7]], [params]).result(timeout=60)[0])
        assert after == before
    finally:
        loop.shutdown()


def test_a_rank_frozen_inside_a_step_is_killed_at_the_second_check(ray_local):
    """SIGSTOP of a rank mid-generation: the watchdog named it but nothing acted, so the
    stream and every request after it waited out parallel.timeout_s plus 30 s. Now new
    submissions are refused (retryable) while it is named, and the same ranks silent at the
    next check are killed: the step fails at once, naming why, and the engine rebuilds."""
    overrides = {"parallel.timeout_s": 300, "server.health_check_interval_s": 1.0}
    llm = LLM(TINY_CONFIG, **{"parallel.world_size": 2, **overrides})
    pids = llm.engine.executor.call_all("pid")
    loop = AsyncEngine(llm.engine)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    try:
        before = fingerprint(loop.submit([[5, 6, 7]], [params]).result(timeout=60)[0])
        in_flight = _generating(loop, 1000)
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        while loop.stalled is None:
            assert time.monotonic() - stopped < 45, "the stall was never named"
            time.sleep(0.1)
        with pytest.raises(EngineUnavailableError, match="the engine is stalled: ranks \\[1\\]"):
            loop.submit([[5, 6, 7]], [params])
        with pytest.raises(WorkerError, match="rank 1 died during step .*: killed, it answered"):
            in_flight.result(timeout=60)
        assert time.monotonic() - stopped < 60, "killed only at the step's own timeout"
        _wait_healthy(loop)
        after = fingerprint(loop.submit([[5, 6, 7]], [params]).result(timeout=60)[0])
        assert after == before and loop.stats().num_restarts == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGCONT)
        loop.shutdown()


def test_a_rank_that_dies_during_the_drain_rebuilds_nothing(ray_local):
    """SIGTERM's drain under way, then a rank killed: the engine started a whole rebuild (new
    actors), which the shutdown killed half done. The request in flight ends with the error,
    the drain ends, and no rank is started again."""
    llm = LLM(TINY_CONFIG, **{"parallel.world_size": 2, "parallel.timeout_s": 20})
    pid = llm.engine.executor.call_all("pid")[1]
    loop = AsyncEngine(llm.engine)
    in_flight = _generating(loop, 1000)
    restarts = []
    restart = llm.engine.restart
    llm.engine.restart = lambda: restarts.append(1) or restart()
    draining = threading.Thread(target=loop.shutdown, kwargs={"drain_timeout_s": 60})
    draining.start()
    time.sleep(0.5)  # into the drain: the stream is still running
    assert not in_flight.done()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match="rank 1"):
        in_flight.result(timeout=60)
    draining.join(30)
    assert not draining.is_alive() and restarts == [], restarts


def test_a_rank_whose_own_code_fails_is_named_not_its_waiting_peer(ray_local):
    """Rank 1 raising in a step (a KeyError from a step input only it gets; in production an
    OOM, a CUDA error) while rank 0 waits in the step's first collective: the error named
    rank 0 "stalled" (silent 3 s after the failure) and rank 1's fault only in brackets."""
    from moe_runtime.worker.step_input import StepInput

    llm = LLM(TINY_CONFIG, **{"parallel.world_size": 2, "parallel.timeout_s": 20})
    try:
        started = time.monotonic()
        with pytest.raises(WorkerError) as failed:
            llm.engine.executor.execute([StepInput(), StepInput(released_seq_ids=[12345])])
        assert str(failed.value).startswith("rank 1 failed during step 1: KeyError"), failed.value
        assert time.monotonic() - started < 3  # named at once, no grace waited for
    finally:
        llm.shutdown()


def _failing_call(engine, method: str):
    """engine.executor.call_all, but `method` raises as a dead rank's call does."""
    call_all = engine.executor.call_all

    def call(name: str, *args, **bounds):
        if name == method:
            raise WorkerError(f"rank 0 died during {name}: injected")
        return call_all(name, *args, **bounds)

    return call


@pytest.mark.parametrize("path", ["idle check", "worker stats"])
def test_a_rank_found_dead_outside_a_step_kills_the_engine_and_it_rebuilds(path):
    """A rank that does not answer the idle check, or /metrics' worker_stats call, is as dead
    as one that fails a step: the engine fails, rebuilds (new workers, so the injection is
    gone) and serves again; worker_stats' caller gets the error."""
    interval = 0.2 if path == "idle check" else None
    llm = LLM(TINY_CONFIG, **{"server.health_check_interval_s": interval})
    engine = llm.engine
    engine.executor.call_all = _failing_call(engine, "ping" if path == "idle check" else "stats")
    loop = AsyncEngine(engine)
    if path == "worker stats":
        with pytest.raises(WorkerError, match="injected"):
            loop.call(lambda e: e.worker_stats()).result(timeout=30)
    deadline = time.monotonic() + 30
    while loop.stats().num_restarts == 0:
        assert time.monotonic() < deadline, f"{path}: the failure was not taken as a death"
        time.sleep(0.02)
    _wait_healthy(loop)
    assert loop.call(lambda e: e.worker_stats()).result(timeout=30)[0]["rank"] == 0
    # Seeded, EOS ignored: an unseeded draw could sample EOS and end short of 3 tokens.
    params = SamplingParams(max_tokens=3, seed=1, ignore_eos=True)
    done = loop.submit([[1, 2, 3]], [params]).result(timeout=30)
    loop.shutdown()
    assert len(done[0].token_ids) == 3 and loop.stats().num_restarts == 1


def test_an_admin_call_after_a_rank_died_runs_on_the_rebuilt_group():
    """A rank known dead (its actor gone: RayExecutor.dead_ranks, no round trip) is found
    before new requests are scheduled onto it, and the group rebuilt first; an admin call
    (a rebalance, a weight update) was not so checked: it ran on the dead group, failed with a
    500 naming the dead rank, and only then did the engine rebuild. Now the loop looks before
    a call too, and the call runs on the rebuilt group."""
    engine = LLM(TINY_CONFIG, **{"server.health_check_interval_s": None}).engine
    loop = AsyncEngine(engine)
    gate, running = threading.Event(), threading.Event()
    try:
        loop.call(lambda e: running.set() or gate.wait(30))  # busy: no idle poll finds it
        assert running.wait(30)
        engine.executor.dead_ranks = lambda: [0]  # as Ray's sentinel reports a died actor
        engine.executor.call_all = _failing_call(engine, "window_load")
        rebalance = loop.call(lambda e: e.rebalance())
        gate.set()
        report = rebalance.result(timeout=60)
        assert report["skipped"], report  # the new group has served nothing yet
        assert loop.stats().num_restarts == 1
    finally:
        gate.set()
        loop.shutdown()


def test_requests_queued_behind_a_failing_step_fail_and_never_run():
    """Two requests queued while a step hangs and then fails: they fail at once (a 503's
    error: they never ran), and after the rebuild they must not run (their callers already
    have the error): they would take the rebuilt engine's capacity from the requests that
    follow. Meanwhile the engine's counts no longer show the failed request running."""
    llm = LLM(TINY_CONFIG)
    engine = llm.engine
    entered, release = threading.Event(), threading.Event()
    step, num_steps = engine.executor.execute, []

    def hanging_step(per_rank_inputs):
        num_steps.append(1)
        if len(num_steps) == 1:  # the first step runs: the counts show the request running
            return step(per_rank_inputs)
        entered.set()
        release.wait(30)
        raise WorkerError("ranks [1] stalled during step 2: injected")

    engine.executor.execute = hanging_step  # the rebuilt executor has its own
    rebuild, rebuilding = threading.Event(), engine.restart
    engine.restart = lambda: rebuild.wait(30) and rebuilding()
    loop = AsyncEngine(engine)
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    first = loop.submit([[1, 2, 3]], [long])
    assert entered.wait(30)
    assert loop.stats().num_running == 1
    queued = [loop.submit([[4, 5]], [long]), loop.submit([[6, 7, 8]], [long])]
    release.set()
    with pytest.raises(WorkerError, match="injected"):
        first.result(timeout=30)
    for future in queued:  # never ran: a 503 a client may retry, not the step's 500
        with pytest.raises(EngineUnavailableError, match=r"failed before the request ran .*inj"):
            future.result(timeout=30)
    # during the rebuild /metrics reads no request still running (it read the last step's 1)
    assert loop.stats().num_running == 0 and not loop.is_healthy
    rebuild.set()
    _wait_healthy(loop)
    loop.submit([[9, 10]], [SamplingParams(max_tokens=2)]).result(timeout=30)
    # Queued after the failed ones: they would have been admitted before it.
    assert not loop.call(lambda e: e.has_unfinished()).result(timeout=30)
    loop.shutdown()


def test_a_request_admitted_but_never_scheduled_gets_the_retryable_error():
    """Admitted behind a running request (scheduler.max_num_seqs 1) when a step fails: it
    never reached a rank, so its client gets the 503 it may retry, not the step's 500."""
    llm = LLM(TINY_CONFIG, **{"scheduler.max_num_seqs": 1})
    engine = llm.engine
    in_step, second_sent, waiting = threading.Event(), threading.Event(), []
    step, num_steps = engine.executor.execute, []

    def failing_step(per_rank_inputs):
        num_steps.append(1)
        if len(num_steps) == 1:
            in_step.set()
            assert second_sent.wait(30)
            return step(per_rank_inputs)
        waiting.append(len(engine.schedulers[0].waiting))
        raise WorkerError("rank 0 failed during step 2: injected")

    engine.executor.execute = failing_step
    engine.restart = lambda: None  # no rebuild needed here
    loop = AsyncEngine(engine)
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    first = loop.submit([[1, 2, 3]], [long])
    assert in_step.wait(30)
    second = loop.submit([[4, 5]], [long])
    second_sent.set()
    with pytest.raises(WorkerError, match="injected"):
        first.result(timeout=30)
    assert waiting == [1]  # engagement: admitted, waiting, when the step failed
    with pytest.raises(EngineUnavailableError, match=r"failed before the request ran .*inj"):
        second.result(timeout=30)
    loop.shutdown()


def test_a_value_error_inside_a_step_fails_the_requests_as_a_fault_not_as_bad_input():
    """A ValueError raised in a step (a bug, or a rank's check failing) is the engine's fault:
    the requests end with a WorkerError (HTTP 500), not a ValueError (a 400 blaming them)."""
    engine = LLM(TINY_CONFIG).engine

    def failing_step(per_rank_inputs):
        raise ValueError("injected: a check inside the step")

    engine.executor.execute = failing_step  # the rebuilt executor has its own
    loop = AsyncEngine(engine)
    future = loop.submit([[1, 2, 3]], [SamplingParams(max_tokens=4)])
    with pytest.raises(WorkerError, match="ValueError: injected") as failure:
        future.result(timeout=30)
    assert not isinstance(failure.value, ValueError)
    _wait_healthy(loop)
    loop.shutdown()


def _wait_healthy(loop: AsyncEngine, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not loop.is_healthy:
        assert time.monotonic() < deadline, f"no recovery: {loop.error}"
        time.sleep(0.05)


def test_sigterm_with_8_streams_in_flight_drains_them_all_and_exits_0(ray_head):
    """serve_ep at world size 2 on Ray: SIGTERM once 8 streams have started. Ray's own SIGTERM
    handler (a stack dump, then an abort 3 s later) must not be the one that answers."""
    # 256 tokens of 8 streams took 17 s to drain on a loaded 2-core machine: a 20 s drain
    # timeout could cut them. The streams still start (and are checked) as before.
    max_tokens, drain_timeout_s = 256, 60
    proc, lines, reader = _serve_ep_at_world_2(ray_head, "--drain-timeout-s", str(drain_timeout_s))
    try:
        url = _wait_ready(lines, timeout_s=60)
        first_chunks = threading.Semaphore(0)
        with ThreadPoolExecutor(8) as pool:
            streams = [
                pool.submit(_stream, url, [1 + i, 2, 3], max_tokens, first_chunks) for i in range(8)
            ]
            for _ in streams:
                assert first_chunks.acquire(timeout=30), "a stream never started"
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)  # a few of uvicorn's 0.1 s ticks: it has seen should_exit
            assert not all(s.done() for s in streams), "drained before the check could run"
            assert _new_connection(url) in ("refused", 503)
            events = [s.result(timeout=drain_timeout_s) for s in streams]
        assert proc.wait(timeout=drain_timeout_s) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=5)
    output = "".join(lines.queue)
    assert "SIGTERM received" not in output and "*** " not in output, output[-3000:]
    assert "draining" in output and "serve_ep: stopped" in output, output[-3000:]
    # a rank's INFO records reach serve_ep's output (Ray forwards the actor's stderr)
    assert re.search(r"INFO moe_runtime\.loader \(rank [01]\): weights ready", output), output
    for chunks in events:
        choice = merge_completion_chunks(chunks)[0]
        assert choice["finish_reason"] == "length"
        assert len(choice["token_ids"]) == max_tokens


def test_sigterm_while_the_engine_loads_exits_0_without_rays_handler(ray_head):
    """serve_ep at world size 2: SIGTERM after Ray has started, while the ranks load. Ray's C++
    handler (installed by ray.init) dumped the stack and aborted the process 3 s later."""
    proc, lines, reader = _serve_ep_at_world_2(ray_head)
    try:
        deadline = time.monotonic() + 60
        while "loading the engine" not in lines.get(timeout=max(0.1, deadline - time.monotonic())):
            pass
        time.sleep(1.0)  # into the ranks' start-up
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=5)
    output = "".join(lines.queue)
    assert code == 0, output[-3000:]
    assert "SIGTERM received" not in output and "*** " not in output, output[-3000:]
    assert "ready on" not in output and "serve_ep: stopped (SIGTERM)" in output, output[-3000:]


def _serve_ep_at_world_2(
    ray_head, *args: str
) -> tuple[subprocess.Popen, queue.Queue, threading.Thread]:
    """serve_ep on the tiny config at world size 2 on the private head (no other), a free
    port; its output's lines (stdout and stderr) queued by a reader thread."""
    command = [sys.executable, "launch/serve_ep.py", "--config", str(TINY_CONFIG), "--port", "0"]
    command += ["--set", "parallel.world_size=2", *args]
    env = {**ray_head.env, "RAY_ADDRESS": ray_head.gcs_address}
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    return proc, lines, reader


def _read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)


def _wait_ready(lines: queue.Queue, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        if "ready on " in line:
            return line.split("ready on ", 1)[1].strip()


def _stream(url: str, prompt: list[int], max_tokens: int, first_chunk: threading.Semaphore):
    """One streamed completion: its parsed chunks, asserted to end with data: [DONE]."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    chunks = []
    with httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    return chunks
                if line.startswith("data: "):
                    chunks.append(json.loads(line[len("data: ") :]))
                    if len(chunks) == 1:
                        first_chunk.release()
    raise AssertionError(f"the stream ended without data: [DONE] after {len(chunks)} chunks")


def _new_connection(url: str) -> str | int:
    """A new client's answer while the server drains: its status, or "refused"."""
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.ConnectError:
        return "refused"


def test_restarts_are_counted_within_the_restart_window(monkeypatch):
    """parallel.max_restarts rebuilds within parallel.restart_window_s, then the engine gives
    up; rebuilds older than the window no longer count, so rare faults over a long life are
    each rebuilt (the count never fell before: the fourth fault in days ended the server).
    The engine's clock is the test's: a slow rebuild cannot leave the window early."""
    window_s = 3600.0
    now = [1000.0]
    # worker_group.py reads only time.monotonic: its own `time`, not the process's clock
    monkeypatch.setattr(worker_group_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    llm = LLM(TINY_CONFIG, **{"parallel.max_restarts": 1, "parallel.restart_window_s": window_s})
    engine = llm.engine
    try:
        engine.restart()
        now[0] += window_s - 1
        assert engine.restart_refusal() is not None
        with pytest.raises(RuntimeError, match=r"gave up after parallel\.max_restarts=1 restarts "):
            engine.restart()
        now[0] += 2  # the first rebuild is now past the window
        assert engine.restart_refusal() is None
        engine.restart()  # the first rebuild left the window
        assert engine.num_restarts == 2  # the metric counts every rebuild since start
    finally:
        llm.shutdown()


def test_generate_cli_ends_a_rank_failure_with_one_line(monkeypatch, capsys):
    """launch/generate.py with a rank that dies in the step: the engine's traceback ended the
    command; now one line naming the rank, exit 1, as the rollout tool's give-up does."""
    from launch.generate import main
    from moe_runtime.executor.local import LocalExecutor

    def dead(self, per_rank_inputs):
        raise WorkerError("rank 0 died during step 1: injected")

    monkeypatch.setattr(LocalExecutor, "execute", dead)
    assert main(["--config", str(TINY_CONFIG), "--max-tokens", "4"]) == 1
    err = capsys.readouterr().err
    assert "error: rank 0 died during step 1: injected\n" in err and "Traceback" not in err, err


def test_an_llm_call_after_a_rank_died_while_idle_runs_on_the_rebuilt_group(ray_local):
    """kill -9 of a rank between two LLM calls: the death was known without asking (its
    outstanding liveness call failed), yet the next generate was scheduled onto the dead rank
    and raised WorkerError for requests that never ran; only the call after it rebuilt. The
    server looked first (a 503 to retry); now LLM does too: the call runs on the rebuilt group,
    with the same bits."""
    llm = LLM(TINY_CONFIG, **{"parallel.world_size": 2, "parallel.timeout_s": 20})
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    try:
        before = fingerprint(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0])
        os.kill(llm.engine.executor.call_all("pid")[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while llm.engine.dead_ranks() != [1]:
            assert time.monotonic() < deadline, "the death was never known"
            time.sleep(0.05)
        after = fingerprint(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0])
        assert after == before and llm.engine.num_restarts == 1
    finally:
        llm.shutdown()


def test_an_llm_call_with_a_rank_frozen_mid_step_fails_at_the_second_check(ray_local):
    """SIGSTOP of a rank while LLM.generate steps: the server's watchdog killed a frozen rank at
    its second check, but an LLM call (and a rollout's batch, the same stepping) had no
    watchdog and waited out parallel.timeout_s plus 30 s. Now the call raises WorkerError at
    the second check, naming the kill, and the next call runs on a rebuilt group with the
    same bits."""
    overrides = {"parallel.timeout_s": 300, "server.health_check_interval_s": 1.0}
    llm = LLM(TINY_CONFIG, **{"parallel.world_size": 2, **overrides})
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    long_params = SamplingParams(max_tokens=1000, ignore_eos=True)
    pids = llm.engine.executor.call_all("pid")
    try:
        before = fingerprint(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0])
        first_step = llm.engine.num_steps
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(llm.generate, [[5, 6, 7]], long_params, use_tqdm=False)
            while llm.engine.num_steps < first_step + 3:  # the call is stepping
                assert not call.done(), call.exception()
                time.sleep(0.01)
            os.kill(pids[1], signal.SIGSTOP)
            stopped = time.monotonic()
            with pytest.raises(WorkerError, match=r"rank 1 died during step .*: killed, it answe"):
                call.result(timeout=60)
        assert time.monotonic() - stopped < 60, "failed only at the step's own timeout"
        after = fingerprint(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0])
        assert after == before and llm.engine.num_restarts == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGCONT)
        llm.shutdown()


def test_a_stall_is_logged_once_when_first_found_not_only_at_the_kill(caplog):
    """The watchdog's finding reached /health but not the log: a server's log said nothing
    from a rank's stall until the kill (34 s into a step with the default interval)."""

    class Engine:
        def __init__(self) -> None:
            self.num_kills = 0

        def silent_ranks(self, timeout_s: float) -> list[int]:
            return [1]

        def kill_ranks(self, ranks: list[int], why: str) -> None:
            self.num_kills += 1

    engine = Engine()
    watch = StallWatch(engine, 0.05, is_rebuilding=lambda: False)
    try:
        with caplog.at_level(logging.WARNING, logger=StallWatch.__module__):
            with watch.running("step 7"):
                deadline = time.monotonic() + 30
                while engine.num_kills < 3:  # three more checks of the same finding
                    assert time.monotonic() < deadline, "the stalled rank was never killed"
                    time.sleep(0.01)
    finally:
        watch.stop()
    logged = [r.getMessage() for r in caplog.records if r.name == StallWatch.__module__]
    assert len(logged) == 1, logged
    assert logged[0].startswith("stalled: ranks [1] answered no ping in "), logged
    assert " while step 7 ran " in logged[0], logged


def test_a_stalled_rank_killed_while_its_peer_is_blamed_is_named_killed_not_answering(ray_local):
    """A stopped rank's peer times out in the collective, and the driver pings the silent rank
    to name the cause; the stall watch's kill of that frozen rank lands meanwhile (its second
    check), so the ping fails with the actor's death. The step's error then said "ranks [1]
    still in step N (they answer pings)": the one rank that answered nothing was reported alive
    and busy to every stream it ended. A ping that fails with a death is no answer: the rank
    died, and the error says why it was killed."""
    llm = LLM(TINY_CONFIG, **{"parallel.world_size": 2, "parallel.timeout_s": TIMEOUT_S})
    engine = llm.engine
    executor = engine.executor
    pids = executor.call_all("pid")
    beside_work = executor._beside_work

    def ping_then_watchdog_kill(method, ranks):
        refs = beside_work(method, ranks)
        if method == "ping" and list(ranks) == [1]:  # _blame's ping of the silent rank
            executor.kill_ranks([1], "it answered no ping at two checks in a row")
        return refs

    executor._beside_work = ping_then_watchdog_kill
    try:
        engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(pids[1], signal.SIGSTOP)
        with pytest.raises(WorkerError) as failure:
            while engine.has_unfinished():
                engine.step()
        message = str(failure.value)
        assert "answer pings" not in message, message
        assert re.match(r"rank 1 died during step \d+: killed, it answered no ping", message)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGCONT)
        llm.shutdown()
