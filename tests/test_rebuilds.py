"""What a serving engine says about its rebuilds (one in-process rank, faults injected).

An operator reads the server's log and /health: a rank's death, each rebuild of the worker group
and each rebuild attempt that fails must show there while it happens, not only once the engine
has given up. A client reads the 503s meanwhile: they must say when a retry may be answered.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

import moe_runtime.engine.recovery as recovery_module
from launch.generation import Backend
from launch.server_app import create_app
from moe_runtime import LLM, SamplingParams
from moe_runtime.engine.async_engine import AsyncEngine, EngineUnavailableError
from moe_runtime.engine.weights_source import WeightsChangedError
from moe_runtime.executor import WorkerError
from tests.invariance import TINY_CONFIG


def _dead_at_the_idle_check(engine) -> None:
    """engine.executor.call_all, but the idle check's ping raises as a dead rank's does (the
    rebuilt executor has its own)."""
    call_all = engine.executor.call_all

    def call(name: str, *args, **bounds):
        if name == "ping":
            raise WorkerError("rank 0 died during ping: injected")
        return call_all(name, *args, **bounds)

    engine.executor.call_all = call


def test_a_failed_rebuild_attempt_is_logged_and_named_while_the_next_one_runs(caplog):
    """A rebuild attempt that failed (the cluster could not place the new group, a new rank
    failed its start) was retried without a word: for as long as the retries took, /health and
    every 503 named only the first fault, and the server's log held neither the failed attempt
    nor that the engine died and rebuilt at all (the rank's own death at most). Now each step is
    logged and the error names the failed attempt while the next one runs."""
    llm = LLM(TINY_CONFIG, **{"server.health_check_interval_s": 0.2})
    engine = llm.engine
    _dead_at_the_idle_check(engine)
    attempts, retried, release = [], threading.Event(), threading.Event()
    rebuild = engine.restart

    def restart():
        attempts.append(1)
        if len(attempts) == 1:
            raise WorkerError("injected: the cluster could not place the ranks")
        retried.set()
        release.wait(30)
        rebuild()

    engine.restart = restart
    caplog.set_level(logging.INFO, logger="moe_runtime")
    loop = AsyncEngine(engine)
    try:
        assert retried.wait(30), "the rebuild was not tried again"
        assert loop.error == (
            "WorkerError: rank 0 died during ping: injected; rebuilding the workers failed "
            "(WorkerError: injected: the cluster could not place the ranks), trying again"
        )
        with pytest.raises(EngineUnavailableError, match=r"recovering: .*could not place"):
            loop.submit([[1, 2, 3]], [SamplingParams(max_tokens=3)])
        release.set()
        deadline = time.monotonic() + 60
        while not loop.is_healthy:
            assert time.monotonic() < deadline, f"no recovery: {loop.error}"
            time.sleep(0.05)
        assert loop.error is None
        params = SamplingParams(max_tokens=3, seed=1, ignore_eos=True)  # unseeded: EOS could end it
        done = loop.submit([[1, 2, 3]], [params]).result(timeout=30)
        assert len(done[0].token_ids) == 3
    finally:
        release.set()
        loop.shutdown()
    logged = [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if r.name == "moe_runtime.engine.async_engine"
    ]
    assert logged[:4] == [
        (
            "ERROR",
            "the engine died (WorkerError: rank 0 died during ping: injected); 0 request(s) in "
            "flight ended with it",
        ),
        ("WARNING", "rebuilding the worker group"),
        (
            "ERROR",
            "rebuilding the worker group failed (WorkerError: injected: the cluster could not "
            "place the ranks); trying again in 1s",
        ),
        ("WARNING", "rebuilding the worker group"),
    ]
    assert logged[4][0] == "WARNING" and logged[4][1].startswith("rebuilt the worker group in ")


def _post(app, path: str, body: dict) -> httpx.Response:
    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body)

    return asyncio.run(post())


def _held_rebuilds(engine) -> tuple[threading.Event, threading.Event, list[float]]:
    """The engine's idle check finds rank 0 dead, and each rebuild waits for `release` before
    it runs. -> (rebuilding: set once one began, release, the monotonic times they began)."""
    _dead_at_the_idle_check(engine)
    rebuilding, release, began = threading.Event(), threading.Event(), []
    rebuild = engine.restart

    def restart():
        began.append(time.monotonic())  # at or after the loop's own start of the attempt
        rebuilding.set()
        release.wait(30)
        rebuild()

    engine.restart = restart
    return rebuilding, release, began


@pytest.mark.parametrize("ran_s, expected", [(10, 20), (29.5, 1), (40, 10), (100, 30)])
def test_a_rebuild_past_its_estimate_asks_for_a_retry_as_late_as_it_overran(ran_s, expected):
    """Retry-After is the last build's time less what this rebuild has run (at least 1 s). Past
    it, it said 1 s however long the rebuild went on, and every client retried each second;
    now it is as long as the rebuild has overrun, at most the last build's time."""
    recovery = SimpleNamespace(
        _engine=SimpleNamespace(build_s=30.0), _rebuild_started=time.monotonic() - ran_s
    )
    assert AsyncEngine._retry_after_rebuild_s(recovery) == pytest.approx(expected, abs=0.5)


def test_a_503_while_the_engine_rebuilds_says_when_to_retry():
    """The openai client retries a 503 twice, 0.5 s and 1 s apart, unless the response says
    how long to wait (Retry-After, up to 60 s): its user got the 503 1.5 s into a rebuild that
    takes about as long as the start (8 s at world size 2 on CPU; minutes for a large model).
    Now a 503 of a rebuilding engine carries Retry-After: the last build's time less what this
    rebuild has run, at least 1 s. A 503 no estimate fits carries none: an engine still loading
    (nothing measured yet), or one shutting down (a retry should go elsewhere)."""
    llm = LLM(TINY_CONFIG, **{"server.health_check_interval_s": 0.2})
    engine = llm.engine
    engine.group.build_s = 30.0  # as a large model's start would have measured
    rebuilding, release, began = _held_rebuilds(engine)
    loop = AsyncEngine(engine)
    app = create_app(engine.config, Backend(loop, engine.tokenizer))
    body = {"model": engine.config.server.model_name, "prompt": [1, 2, 3], "max_tokens": 3}
    try:
        assert rebuilding.wait(30)
        refused = _post(app, "/v1/completions", body)
        assert refused.status_code == 503, refused.text
        assert "recovering" in refused.json()["error"]["message"]
        # From the attempt's start (not this thread's waking: a loaded machine may be late).
        waited_s = time.monotonic() - began[0]
        assert 30 - waited_s - 1.5 <= int(refused.headers["retry-after"]) <= 30
        release.set()
        deadline = time.monotonic() + 60
        while not loop.is_healthy:
            assert time.monotonic() < deadline, f"no recovery: {loop.error}"
            time.sleep(0.05)
        assert 0 < engine.build_s < 30  # the rebuild's own time now
        assert _post(app, "/v1/completions", body).status_code == 200
    finally:
        release.set()
        loop.shutdown()
    for stopped in (app, create_app(engine.config)):  # shut down; loading
        refused = _post(stopped, "/v1/completions", body)
        assert refused.status_code == 503 and "retry-after" not in refused.headers


def test_a_prompt_outside_the_vocabulary_is_a_400_while_the_engine_rebuilds():
    """A completion whose token ids lie outside the vocabulary got the engine's 400 while it
    served, but 503 "recovering" while it rebuilt (the engine checked the ids; the route only
    what needs no engine), so a client retried a request no engine would ever run. The route
    now checks each prompt as the engine does (RequestChecks: the config and the tokenizer):
    the same 400 with the engine's message, rebuilding or not; and so does the chat route for
    a conversation past the context."""
    llm = LLM(TINY_CONFIG, **{"server.health_check_interval_s": 0.2})
    engine = llm.engine
    vocab, name = engine.config.model.vocab_size, engine.config.server.model_name
    bad_prompts = [[1, 2, vocab], [[1, 2], [3, 10**6]]]
    expected = []  # the engine's own refusals, as the route words them
    for prompt in bad_prompts:
        with pytest.raises(ValueError) as refused:
            engine.checks.requests(prompt if isinstance(prompt[0], list) else [prompt])
        error = {"message": str(refused.value), "type": "invalid_request_error"}
        expected.append({"error": {**error, "param": "prompt", "code": None}})
    assert expected[1]["error"]["message"].startswith("prompt 1: token id 1000000 is outside")
    bodies = [{"model": name, "prompt": prompt, "max_tokens": 3} for prompt in bad_prompts]
    bodies[1]["stream"] = True
    # A conversation past the context: the chat route's 400 (its prompt is the template's).
    too_long = [{"role": "user", "content": "a b c " * engine.config.scheduler.max_model_len}]
    chat = {"model": name, "messages": too_long, "max_tokens": 3}
    good = {"model": name, "prompt": [1, 2, vocab - 1], "max_tokens": 3}
    rebuilding, release, _ = _held_rebuilds(engine)
    loop = AsyncEngine(engine)
    app = create_app(engine.config, Backend(loop, engine.tokenizer))
    try:
        assert rebuilding.wait(30)
        during = [_post(app, "/v1/completions", body) for body in bodies]
        chat_during = _post(app, "/v1/chat/completions", chat)
        assert _post(app, "/v1/completions", good).status_code == 503  # still rebuilding
        release.set()
        deadline = time.monotonic() + 60
        while not loop.is_healthy:
            assert time.monotonic() < deadline, f"no recovery: {loop.error}"
            time.sleep(0.05)
        served = [_post(app, "/v1/completions", body) for body in bodies]
        chat_served = _post(app, "/v1/chat/completions", chat)
        assert _post(app, "/v1/completions", good).status_code == 200
    finally:
        release.set()
        loop.shutdown()
    for responses in (during, served):
        assert [(r.status_code, r.json()) for r in responses] == [(400, e) for e in expected]
    assert chat_served.status_code == 400, chat_served.text
    assert chat_served.json()["error"]["code"] == "context_length_exceeded"
    assert (chat_during.status_code, chat_during.json()) == (400, chat_served.json())


def test_failed_rebuild_attempts_back_off_and_a_shutdown_ends_the_pause(monkeypatch):
    """Failed rebuild attempts were retried at once, so a cause that clears in seconds (a dead
    rank's GPU memory not yet freed) could spend every restart within a second. Now the k-th
    failure in a row pauses REBUILD_BACKOFF_S * 2**(k-1) before the next attempt, and a
    shutdown during a pause ends it (rebuilding nothing)."""
    monkeypatch.setattr(recovery_module, "REBUILD_BACKOFF_S", 0.3)
    overrides = {"server.health_check_interval_s": 0.2, "parallel.max_restarts": 10}
    llm = LLM(TINY_CONFIG, **overrides)
    engine = llm.engine
    _dead_at_the_idle_check(engine)
    attempts, rebuild = [], engine.restart

    def restart():
        attempts.append(time.monotonic())
        if len(attempts) <= 3:
            raise WorkerError(f"injected: attempt {len(attempts)} could not place the ranks")
        rebuild()

    engine.restart = restart
    loop = AsyncEngine(engine)
    try:
        deadline = time.monotonic() + 60
        while loop.stats().num_restarts == 0 or not loop.is_healthy:
            assert time.monotonic() < deadline, f"not rebuilt: {loop.error}"
            time.sleep(0.05)
    finally:
        loop.shutdown()
    gaps = [later - earlier for earlier, later in zip(attempts, attempts[1:], strict=False)]
    assert len(gaps) == 3 and all(gap >= 0.3 * 2**k for k, gap in enumerate(gaps)), gaps

    monkeypatch.setattr(recovery_module, "REBUILD_BACKOFF_S", 600.0)
    engine = LLM(TINY_CONFIG, **overrides).engine
    _dead_at_the_idle_check(engine)
    tried = threading.Event()

    def never(*_):
        tried.set()
        raise WorkerError("injected: the cluster could not place the ranks")

    engine.restart = never
    loop = AsyncEngine(engine)
    assert tried.wait(30)
    started = time.monotonic()
    loop.shutdown(drain_timeout_s=5)
    assert time.monotonic() - started < 10 and not loop.is_healthy
    # The pause ended by the shutdown promises nothing: no "trying again", no retry time.
    assert "trying again" not in loop.error
    with pytest.raises(EngineUnavailableError, match="shutting down") as refused:
        loop.submit([[1, 2, 3]], [SamplingParams(max_tokens=3)])
    assert refused.value.retry_after_s is None


def test_failed_rebuild_attempts_in_a_row_give_up(monkeypatch):
    """Paused attempts fell out of a short parallel.restart_window_s one by one, so an engine
    whose rebuilds always failed retried for ever (/health 503, the server never exiting).
    Now max_restarts failed attempts in a row give up too."""
    monkeypatch.setattr(recovery_module, "REBUILD_BACKOFF_S", 0.2)
    overrides = {
        "server.health_check_interval_s": 0.2,
        "parallel.max_restarts": 3,
        "parallel.restart_window_s": 0.1,
    }
    engine = LLM(TINY_CONFIG, **overrides).engine
    _dead_at_the_idle_check(engine)
    attempts = []

    def never():
        attempts.append(1)
        raise WorkerError("injected: the cluster could not place the ranks")

    engine.restart = never
    loop = AsyncEngine(engine)
    try:
        deadline = time.monotonic() + 30
        while not loop.has_given_up:
            assert time.monotonic() < deadline, f"never gave up: {len(attempts)} attempts"
            time.sleep(0.05)
        assert len(attempts) == 3 and "could not place" in loop.error
    finally:
        loop.shutdown()


def test_a_call_queued_behind_one_that_killed_the_engine_is_refused_and_rebuilds_nothing():
    """Admin calls queued together, the first killing the engine (a weight update failing
    mid-copy) and its rebuild giving up (the served weights' source changed). Those behind it
    were refused, as they should be, but the loop took each refusal for a call killing the
    engine: it logged another death, overwrote the reason with "the engine is dead: ...", and
    rebuilt the given-up engine again, once a queued call. Now a call refused because the
    engine was already down leaves it as it was; only the first call's failure rebuilds."""
    engine = LLM(TINY_CONFIG).engine
    attempts, gate = [], threading.Event()

    def restart():
        attempts.append(1)
        raise WeightsChangedError("injected: model.path was overwritten")

    def failing_call(engine):  # as a weight update failing mid-copy leaves the engine
        engine.error = "injected: copy failed"
        raise RuntimeError(engine.error)

    engine.restart = restart
    loop = AsyncEngine(engine)
    try:
        loop.call(lambda engine: gate.wait(30))  # holds the loop: the rest queue together
        killer = loop.call(failing_call)
        # Answered in turn: the last is answered once the loop has dealt with the one before.
        refused = [loop.call(lambda engine: engine.rebalance()) for _ in range(2)]
        gate.set()
        with pytest.raises(RuntimeError, match="injected: copy failed"):
            killer.result(timeout=30)
        for call in refused:
            with pytest.raises(EngineUnavailableError, match="the engine is dead") as caught:
                call.result(timeout=30)
            assert caught.value.retry_after_s is None  # given up: no rebuild to wait for
        assert loop.has_given_up
        assert loop.error.startswith("WeightsChangedError: injected"), loop.error
        assert len(attempts) == 1, f"{len(attempts)} rebuilds of an engine that had given up"
    finally:
        gate.set()
        loop.shutdown()
