"""moe_runtime/heap.py: start-up's objects kept out of the cyclic collector, and a rebuild in
the same process (world size 1) that still frees the model it drops."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from moe_runtime import LLM, SamplingParams, heap

CONFIGS = Path(__file__).resolve().parents[1] / "launch" / "configs"
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def unfrozen():
    """Each test starts and ends with nothing frozen (the freeze is process-wide)."""
    heap.unfreeze()
    yield
    heap.unfreeze()


def test_freeze_moves_tracked_objects_out_of_the_collectors_view(unfrozen):
    held = [[i] for i in range(1000)]  # tracked containers made before the freeze
    num_frozen = heap.freeze()
    # Not equal to a later count: another thread of the process (one an earlier test left)
    # may free frozen objects in between, which leave the frozen generation (CI: 2 fewer).
    assert num_frozen >= gc.get_freeze_count() >= len(held)
    in_view = {id(obj) for obj in gc.get_objects()}  # every generation the collector walks
    assert not any(id(obj) in in_view for obj in held)
    gc.unfreeze()
    in_view = {id(obj) for obj in gc.get_objects()}
    assert all(id(obj) in in_view for obj in held)  # control: back in view


def test_thawed_restores_the_freeze_it_found(unfrozen, monkeypatch):
    """Frozen before: thawed inside, frozen again after. Not frozen before: no freeze after.
    (The calls are counted: on the H200's Python 3.12 a few hundred objects sat in the frozen
    generation after an unfreeze and a collection, so the count itself is no witness.)"""
    freezes = []
    freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(1) or freeze())
    heap.freeze()
    with heap.thawed():
        assert gc.get_freeze_count() == 0
    assert gc.get_freeze_count() > 0 and len(freezes) == 2
    heap.unfreeze()
    with heap.thawed():
        pass
    assert len(freezes) == 2  # not frozen before: not frozen after
    freeze()  # frozen, not counted, by someone else (CPython 3.12.1 reports some unasked)
    with heap.thawed():
        pass
    assert len(freezes) == 2, "a rebuild froze a heap the runtime had not frozen"


class _Node:
    pass


def _cycle() -> tuple[_Node, weakref.ref]:
    """An object in a cycle (only the collector frees it), and a weak reference to it."""
    node = _Node()
    node.self_ref = node
    return node, weakref.ref(node)


def test_thawed_collects_a_cycle_dropped_inside_it(unfrozen):
    node, alive = _cycle()
    heap.freeze()
    with heap.thawed():
        del node
    assert alive() is None
    assert gc.get_freeze_count() > 0


def test_overlapping_thawed_blocks_collect_what_the_later_one_drops(unfrozen):
    """A shutdown in one thread beside a rebuild in another: two thawed blocks that overlap.
    The first to end froze the process again while the other was still to drop its model,
    whose cycles then stayed frozen for good. Now the last block to end freezes, after a
    collection that frees them."""
    node, alive = _cycle()
    heap.freeze()
    first, second = heap.thawed(), heap.thawed()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the first block ends: the second is still open
    assert gc.get_freeze_count() == 0  # nothing frozen again yet
    del node  # the second block drops its model
    second.__exit__(None, None, None)
    assert alive() is None
    assert gc.get_freeze_count() > 0  # frozen again after the last block


def test_rebuild_frees_the_old_model_with_the_heap_frozen(unfrozen):
    """serve_ep freezes after start-up; a rebuild at world size 1 builds the new model in the
    same process. The model sits in reference cycles, so with its objects frozen it was never
    collected: every rebuild kept another model (and on a GPU its weights and KV cache)."""
    llm = LLM(CONFIGS / "tiny_cpu.yaml")
    try:
        engine = llm.engine
        params = SamplingParams(max_tokens=4, seed=3)
        before = llm.generate(["a frozen heap"], params)[0]
        old_model = weakref.ref(engine.executor.worker.runner.model)
        heap.freeze()
        engine.restart()
        assert engine.num_restarts == 1  # engagement: a new worker group was built
        assert old_model() is None, "the dropped model is still alive after the rebuild"
        assert engine.executor.worker.runner.model is not None
        assert gc.get_freeze_count() > 0  # frozen again after the rebuild
        after = llm.generate(["a frozen heap"], params)[0]
        assert (after.token_ids, after.logprobs) == (before.token_ids, before.logprobs)
    finally:
        llm.shutdown()


def test_a_shut_down_local_rank_is_dropped_and_refuses_calls(unfrozen):
    from moe_runtime.executor import WorkerError

    llm = LLM(CONFIGS / "tiny_cpu.yaml")
    model = weakref.ref(llm.engine.executor.worker.runner.model)
    executor = llm.engine.executor
    llm.shutdown()
    assert model() is None  # freed at shutdown, not when the engine object goes
    with pytest.raises(WorkerError, match="rank 0 is shut down"):
        executor.call_all("ping")
    executor.shutdown()  # twice is harmless


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_rebuild_sizes_its_cache_from_the_memory_the_old_group_held(unfrozen):
    """cache.num_blocks 0: the cache takes a share of the GPU memory free after the weights.
    A rebuild at world size 1 built the new model while the old one (weights, KV cache) was
    still held, so the new cache found less free memory, while the schedulers kept the old
    count: block ids past the new cache. Now the old group is freed first and the schedulers
    follow the new group's count."""
    overrides = {"cache.num_blocks": 0, "cache.gpu_memory_utilization": 0.3}
    llm = LLM(CONFIGS / "tiny_gpu.yaml", **overrides)
    try:
        engine = llm.engine
        params = SamplingParams(max_tokens=4, seed=5)
        before = llm.generate(["a cache sized from memory"], params)[0]
        num_blocks = engine.num_kv_blocks
        heap.freeze()
        engine.restart()
        runner = engine.executor.worker.runner
        assert runner.num_blocks == engine.num_kv_blocks
        assert engine.num_kv_blocks >= num_blocks * 0.95, (num_blocks, engine.num_kv_blocks)
        after = llm.generate(["a cache sized from memory"], params)[0]
        assert (after.token_ids, after.logprobs) == (before.token_ids, before.logprobs)
    finally:
        llm.shutdown()


def test_a_rebuild_after_a_failing_step_frees_the_old_model(unfrozen):
    """A step that raised inside the rank's model: the error (held by the requests it ended)
    kept the model in its traceback's frames, so the rebuild built the new model beside the
    old one and then froze the old one for good."""
    llm = LLM(CONFIGS / "tiny_cpu.yaml")
    try:
        engine = llm.engine
        old_model = weakref.ref(engine.executor.worker.runner.model)
        heap.freeze()

        def failing_step(*args, **kwargs):
            raise RuntimeError("injected: a failure in the step")

        engine.executor.worker.runner.step = failing_step
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
        with pytest.raises(RuntimeError, match="injected") as failure:
            engine.step()
        engine.restart()
        assert failure.value is not None  # the error is still held, as a request's would be
        assert old_model() is None, "the failed rank's model outlived the rebuild"
    finally:
        llm.shutdown()


def test_shutdown_frees_the_model_from_a_frozen_heap(unfrozen):
    llm = LLM(CONFIGS / "tiny_cpu.yaml")
    model = weakref.ref(llm.engine.executor.worker.runner.model)
    heap.freeze()
    llm.shutdown()
    assert model() is None
