"""Lifecycle of the Python API inside a bigger program, found by an outside audit: an LLM beside
the caller's own torch.distributed group, one dropped without shutdown, shutdown from another
thread, Ctrl-C, a forked child, and llm.engine stepped from a second thread."""

from __future__ import annotations

import gc
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_runtime import LLM, SamplingParams
from tests.invariance import TINY_CONFIG, fingerprint, interrupt_at_call

# Two Ray ranks; a short collective timeout, so a step that waits on a rank fails in seconds.
WORLD_2 = {"parallel.world_size": 2, "parallel.timeout_s": 10}


def test_shutdown_at_world_size_1_leaves_the_callers_process_group(tmp_path):
    """An RL trainer's own default group: shutting down (or rebuilding) an in-process rank
    destroyed it, though the rank never joined it."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", world_size=1, rank=0
    )
    try:
        llm = LLM(TINY_CONFIG)
        params = SamplingParams(max_tokens=3, seed=1)
        expected = fingerprint(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0])
        llm.shutdown()
        assert dist.is_initialized()
        assert fingerprint(LLM(TINY_CONFIG).generate([[5, 6, 7]], params)[0]) == expected
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _wait_until(predicate, timeout_s: float = 60.0) -> bool:
    """Poll predicate until it holds or timeout_s passes (a hang guard, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def _generate_at_world_size_2(params: SamplingParams) -> tuple[tuple, object]:
    """Run one prompt on a world-size-2 LLM dropped without shutdown, in a scope that ends;
    -> (its fingerprint, its placement group)."""
    llm = LLM(TINY_CONFIG, **WORLD_2)
    group = llm.engine.executor.placement_group
    return fingerprint(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]), group


def test_an_llm_dropped_without_shutdown_frees_its_ray_workers_and_bundles(ray_local):
    """A world-size-2 LLM gone out of scope kept its placement group until the process ended:
    on a cluster sized to the world (the local Ray a 2-core machine starts), the next LLM
    waited parallel.timeout_s for room and failed. Now the group is removed as the LLM goes."""
    import ray

    params = SamplingParams(max_tokens=3, seed=1)
    expected, group = _generate_at_world_size_2(params)
    gc.collect()
    assert _wait_until(lambda: ray.util.placement_group_table(group)["state"] == "REMOVED")
    again, _ = _generate_at_world_size_2(params)
    assert again == expected


def _generate_in_forked_child(llm: LLM, params: SamplingParams, answers) -> None:
    try:
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
        answers.put("no error")
    except Exception as exc:
        answers.put(f"{type(exc).__name__}: {exc}")
    del llm
    gc.collect()  # the child's copy of the LLM goes: the parent's workers must not


def test_a_forked_child_is_told_it_cannot_drive_the_parents_ray_workers(ray_local):
    """A child forked from a process with a world-size-2 LLM (a fork-method data loader) that
    called generate waited the step's timeout (minutes by default) and then blamed the ranks.
    Now it raises at once, saying why; its copy going away leaves the parent's LLM working."""
    params = SamplingParams(max_tokens=3, seed=1)
    llm = LLM(TINY_CONFIG, **WORLD_2)
    try:
        expected = fingerprint(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0])
        context = multiprocessing.get_context("fork")
        answers = context.Queue()
        child = context.Process(target=_generate_in_forked_child, args=(llm, params, answers))
        child.start()
        answer = answers.get(timeout=120)  # hang guard: before the fix it came after 40 s
        child.join(120)
        assert answer.startswith("RuntimeError: this engine's Ray workers belong to process")
        assert "forked" in answer, answer
        assert fingerprint(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]) == expected
    finally:
        llm.shutdown()


def test_a_ctrl_c_mid_step_does_not_spend_the_restart_budget():
    """Each Ctrl-C inside a step kills the engine and the next call rebuilds it; those rebuilds
    counted against parallel.max_restarts (3 an hour by default), so a notebook's fourth Ctrl-C
    left the LLM refusing every call ('gave up after ... restarts'). An interrupt is the user's,
    not a crash loop: with max_restarts 0 the LLM still comes back, with the same bits."""
    params = SamplingParams(max_tokens=8, seed=1, logprobs=2)
    expected = fingerprint(LLM(TINY_CONFIG).generate([[5, 6, 7]], params)[0])
    llm = LLM(TINY_CONFIG, **{"parallel.max_restarts": 0})
    engine = llm.engine
    for _ in range(2):
        interrupt_at_call(engine, 2)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[9, 10, 11]], SamplingParams(max_tokens=8, seed=2), use_tqdm=False)
        assert engine.error == "a call to the ranks was interrupted (KeyboardInterrupt)"
        assert fingerprint(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]) == expected
    assert engine.num_restarts == 2  # engagement: rebuilt twice, each a new executor
    with pytest.raises(RuntimeError, match="max_restarts=0"):  # a fault still counts
        engine._fail_all("a rank died")
        llm.generate([[5, 6, 7]], params, use_tqdm=False)


def test_shutdown_from_another_thread_ends_the_running_generate_with_an_error():
    """shutdown() from a second thread (a watchdog, a signal handler's) waited for the running
    generate to finish, however long, and the generate returned as if nothing happened. Now
    the generate raises before its next step, and shutdown returns once it has."""
    llm = LLM(TINY_CONFIG)
    real_step, num_steps = llm.engine.step, [0]

    def step_then_wait_for_shutdown():
        outputs = real_step()
        num_steps[0] += 1
        assert llm._is_closing.wait(60)  # hang guard: shutdown() is called meanwhile
        return outputs

    llm.engine.step = step_then_wait_for_shutdown
    failures: list[BaseException] = []

    def generate():
        params = SamplingParams(max_tokens=50, seed=1, ignore_eos=True)
        try:
            llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
        except BaseException as exc:
            failures.append(exc)

    caller = threading.Thread(target=generate)
    caller.start()
    llm.shutdown()
    caller.join(60)
    assert not caller.is_alive()
    assert len(failures) == 1 and isinstance(failures[0], RuntimeError), failures
    assert "shut down" in str(failures[0])
    assert num_steps[0] <= 1  # engagement: it stopped at once, not after its 50 tokens
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.shutdown()  # twice: nothing left to do


def test_llm_engine_after_shutdown_raises_the_shut_down_error():
    """llm.engine was None after shutdown(), so step-by-step use (llm.engine.add_request)
    raised AttributeError on NoneType, where the LLM's own calls say it was shut down."""
    llm = LLM(TINY_CONFIG)
    request = llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, seed=1))
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert request.is_finished  # engagement: step-by-step use worked before the shutdown
    llm.shutdown()
    with pytest.raises(RuntimeError, match="this LLM was shut down: make a new LLM"):
        llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.tokenizer is not None  # still there, to decode what was generated
    llm.shutdown()  # twice: nothing left to do


def test_llm_engine_stepped_from_another_thread_during_generate_waits_for_the_step():
    """A thread stepping llm.engine while another's llm.generate stepped it ran two steps at
    once: the engine died ('scheduled from position 3, but 4 are computed here') and generate
    returned its requests cut short with finish_reason 'error', raising nothing. Now a step is
    whole before another begins, and both get the bits each would alone."""
    params = SamplingParams(max_tokens=12, seed=3, temperature=0.8, ignore_eos=True)
    reference = LLM(TINY_CONFIG)
    expected = [fingerprint(o) for o in reference.generate([[5, 6, 7], [8, 9]], params)]
    llm = LLM(TINY_CONFIG)
    engine = llm.engine
    # The other thread's request, queued first: generate runs it too (it steps until the
    # engine has nothing left), the other thread steps beside it.
    side_request = engine.add_request([8, 9], params)
    side_stepping = threading.Event()
    generate_thread: list[threading.Thread] = []
    real_execute = engine.executor.execute

    def execute_once_the_side_steps(inputs):
        if threading.current_thread() in generate_thread:
            assert side_stepping.wait(60)  # hang guard: the side thread is in step() now
        return real_execute(inputs)

    engine.executor.execute = execute_once_the_side_steps
    failures: list[BaseException] = []
    results = {}

    def generate():
        try:
            results["generate"] = llm.generate([[5, 6, 7]], params, use_tqdm=False)
        except BaseException as exc:
            failures.append(exc)

    def step_beside():
        try:
            while not side_request.is_finished:
                side_stepping.set()
                engine.step()
        except BaseException as exc:
            failures.append(exc)

    generate_thread.append(threading.Thread(target=generate))
    side = threading.Thread(target=step_beside)
    generate_thread[0].start()
    side.start()
    generate_thread[0].join(120)
    side.join(120)
    assert not failures, failures
    assert engine.error is None
    assert fingerprint(results["generate"][0]) == expected[0]
    assert fingerprint(engine.output(side_request)) == expected[1]


def test_an_in_process_rank_runs_at_its_thread_count_and_leaves_the_callers(restore_num_threads):
    """torch's thread count is the process's: an LLM at world size 1 pinned it to
    kernels.num_threads once, at init, cutting the caller's own count (a trainer's) for good,
    and a second LLM of another count changed the first one's steps. Now each rank call runs
    at its own count and the caller's comes back after it."""
    torch.set_num_threads(2)
    params = SamplingParams(max_tokens=4, seed=1)
    first = LLM(TINY_CONFIG)  # kernels.num_threads: 1
    assert torch.get_num_threads() == 2
    second = LLM(TINY_CONFIG, **{"kernels.num_threads": 2})
    seen: list[int] = []
    worker = first.engine.executor.worker
    real_execute = worker.execute

    def execute_seeing_threads(step):
        seen.append(torch.get_num_threads())
        return real_execute(step)

    worker.execute = execute_seeing_threads
    outputs = [fingerprint(llm.generate([[5, 6, 7]], params)[0]) for llm in (first, second)]
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == 2
    assert outputs[0] == outputs[1]  # the tiny model's bits hold at either count


SHUTDOWN_IN_HANDLER = """
import os, signal, sys, threading
from moe_runtime import LLM, SamplingParams
from tests.invariance import TINY_CONFIG
llm = LLM(TINY_CONFIG)
def on_term(signum, frame):
    llm.shutdown()
    sys.exit(3)
signal.signal(signal.SIGTERM, on_term)
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
params = SamplingParams(max_tokens=400, ignore_eos=True)
while True:
    llm.generate([[5, 6, 7]] * 8, params, use_tqdm=False)
"""


def test_shutdown_in_a_signal_handler_of_the_calls_thread_ends_the_process():
    """A SIGTERM handler calling llm.shutdown() runs in the main thread, inside the generate it
    interrupted, which holds the LLM's lock: with a plain lock the handler waited for itself
    forever, and every later SIGTERM found it still waiting."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", SHUTDOWN_IN_HANDLER],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr[-2000:]
