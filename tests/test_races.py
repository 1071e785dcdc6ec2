"""Races between the threads of one process: the engine loop, the HTTP event loop and callers.

Each test forces one interleaving (a step held on an event while another thread acts), so it
fails or passes the same way every run; the stress runs that found them are in the commit
messages.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from launch.generation import Generation
from launch.metrics import FINISH_REASONS, ServerMetrics
from moe_runtime import LLM, SamplingParams
from moe_runtime.config import load_config
from moe_runtime.engine import LLMEngine
from moe_runtime.engine.async_engine import AsyncEngine, EngineUnavailableError
from moe_runtime.executor import WorkerError
from tests.invariance import TINY_CONFIG


def held_steps(engine: LLMEngine) -> tuple[threading.Event, threading.Event]:
    """(entered, release): each step runs, then waits for `release` before it returns."""
    entered, release = threading.Event(), threading.Event()
    step = engine.step

    def held_step():
        deltas = step()
        entered.set()
        assert release.wait(30)
        return deltas

    engine.step = held_step
    return entered, release


def test_a_sample_cancelled_during_its_last_step_ends_once_in_the_metrics():
    """The client leaves (its Future cancelled: "abort" counted for its unfinished samples)
    while the step that finishes its sample runs; that step's delta then reached the tracker
    on the engine thread and counted the same sample as "length" too: 2 samples ended of 1
    (HTTP stress with random disconnects: 183 ended of 181 submitted)."""
    engine = LLMEngine(load_config(TINY_CONFIG, {}))
    entered, release = held_steps(engine)
    loop = AsyncEngine(engine)
    metrics = ServerMetrics(lambda: None)
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    async def client_leaves_mid_step() -> None:
        generation = Generation(loop, [[1, 2, 3]], [params], metrics, time.monotonic(), False)
        assert await asyncio.to_thread(entered.wait, 30)  # its one token is being sampled
        generation.future.cancel()  # the client left
        release.set()
        await asyncio.wrap_future(loop.call(lambda _engine: None))  # the step's deltas are out

    try:
        asyncio.run(client_leaves_mid_step())
    finally:
        release.set()
        loop.shutdown(drain_timeout_s=5)
    value = metrics.registry.get_sample_value
    ended = {r: value("moe_samples_finished_total", {"finish_reason": r}) for r in FINISH_REASONS}
    assert sum(ended.values()) == 1, ended


def test_a_request_in_its_first_step_is_counted_in_the_stats():
    """stats() is the last step's counts plus the submissions still queued; the loop takes the
    queue before it admits and steps, and publishes only after the step: a request in its first
    step (a prefill: seconds on a long prompt) was counted nowhere, so /health and /metrics
    showed an idle engine (0 running, 0 waiting) while it ran."""
    engine = LLMEngine(load_config(TINY_CONFIG, {}))
    entered, release = held_steps(engine)
    loop = AsyncEngine(engine)
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True, n=2)
        future = loop.submit([[1, 2, 3]], [params])
        assert entered.wait(30)  # its first step ran; its stats are not published yet
        stats = loop.stats()
        assert stats.num_running + stats.num_waiting == 2, stats
        release.set()
        assert future.result(timeout=30)[0].outputs[1].finish_reason == "length"
    finally:
        release.set()
        loop.shutdown(drain_timeout_s=5)
    stats = loop.stats()
    assert stats.num_running + stats.num_waiting == 0, stats


def test_a_call_that_kills_the_engine_answers_with_the_engine_down():
    """A call that met a dead rank (an /admin/update_weights or /admin/rebalance) was answered
    first and the engine marked dead after: at the moment its caller had the failure, /health
    still said healthy and a new request was queued, to fail later as 'failed before it ran'.
    A step's failure marks the engine dead before any request hears of it; a call's now does
    too. The call's done callback sees the state its caller can find first."""
    engine = LLMEngine(load_config(TINY_CONFIG, {}))

    def dead_rank(**_kwargs):
        raise WorkerError("rank 0 died during rebalance: injected")

    engine.balancer.rebalance = dead_rank
    loop = AsyncEngine(engine)
    seen = {}

    def on_answer(_future) -> None:  # on the loop thread, as the answer is set
        seen["is_healthy"] = loop.is_healthy
        try:
            loop.submit([[1, 2, 3]], [SamplingParams(max_tokens=2)])
        except EngineUnavailableError as exc:
            seen["refused"] = exc

    try:
        future = loop.call(lambda e: e.rebalance(force=True))
        future.add_done_callback(on_answer)
        with pytest.raises(WorkerError, match="injected"):
            future.result(timeout=30)
    finally:
        loop.shutdown(drain_timeout_s=5)
    assert seen["is_healthy"] is False
    assert seen["refused"].retry_after_s is not None  # recovering: a retry may run it


class _PausingList(list):
    """A list whose next append waits, once `armed`, until `resume` is set: a sample's logprobs
    (a step held between a token and its logprob) or a scheduler's running list (a step held
    between taking a sequence off the waiting queue and running it)."""

    def __init__(self, armed: threading.Event, paused: threading.Event, resume: threading.Event):
        super().__init__()
        self._armed, self._paused, self._resume = armed, paused, resume

    def append(self, value) -> None:
        if self._armed.is_set():
            self._armed.clear()
            self._paused.set()
            assert self._resume.wait(30)
        super().append(value)


def test_output_read_beside_a_step_is_a_whole_state():
    """LLMEngine.output is read from any thread (README: a request added through llm.engine
    runs in another thread's generate; read it whole with engine.output), while that step
    appends a sample's token, then its logprob, then its top logprobs: a read in between gave
    2 token ids with 1 logprob (a trainer zipping them misaligns every later pair)."""
    engine = LLMEngine(load_config(TINY_CONFIG, {}))
    request = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    armed, paused, resume = threading.Event(), threading.Event(), threading.Event()
    (seq,) = request.samples
    seq.output_logprobs = _PausingList(armed, paused, resume)
    engine.step()  # one token, recorded whole
    armed.set()
    stepping = threading.Thread(target=engine.step, daemon=True)
    stepping.start()
    assert paused.wait(30)  # the second token appended, its logprob not yet
    read: list = []
    reader = threading.Thread(target=lambda: read.append(engine.output(request)), daemon=True)
    reader.start()
    reader.join(1.0)  # a reader that waits for the step is let go below
    resume.set()
    stepping.join(30)
    reader.join(30)
    (out,) = read[0].outputs
    assert len(out.token_ids) == len(out.logprobs) == len(out.top_logprobs), out
    engine.shutdown()


def test_generate_does_not_stop_while_another_thread_s_step_admits_its_prompt():
    """llm.generate steps while the engine has unfinished sequences, read without the engine
    lock. Another thread's llm.engine.step (README: they run one at a time, each request's bits
    its own) admits a sequence by taking it off the waiting queue, then onto the running list:
    read in between, the engine looked empty, and generate returned its prompt unfinished
    (1 token of 2, finish_reason None) raising nothing."""
    llm = LLM(TINY_CONFIG, **{"scheduler.max_num_seqs": 1})
    engine = llm.engine
    armed, paused, resume = threading.Event(), threading.Event(), threading.Event()
    (scheduler,) = engine.schedulers
    scheduler.running = _PausingList(armed, paused, resume)
    other = engine.add_request([9, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()  # the other thread's request holds the one sequence slot
    a_stepped, b_paused = threading.Event(), threading.Event()
    step = engine.step

    def first_step_then_wait():  # generate's first step: `other` ends, its prompt still waits
        engine.step = step
        deltas = step()
        a_stepped.set()
        assert b_paused.wait(30)
        return deltas

    engine.step = first_step_then_wait
    result: list = []
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    generating = threading.Thread(
        target=lambda: result.append(llm.generate([[1, 2, 3]], params, use_tqdm=False)),
        daemon=True,
    )
    generating.start()
    assert a_stepped.wait(30) and other.is_finished
    armed.set()
    stepping = threading.Thread(target=step, daemon=True)  # the other thread's step
    stepping.start()
    assert paused.wait(30)  # generate's prompt is off the waiting queue, not running yet
    b_paused.set()
    generating.join(1.0)  # generate reads the engine meanwhile
    resume.set()
    stepping.join(30)
    generating.join(30)
    llm.shutdown()
    (output,) = result[0]
    assert output.outputs[0].finish_reason == "length", output
    assert len(output.outputs[0].token_ids) == 2
