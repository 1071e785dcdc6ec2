"""EPLB while serving: load statistics, live expert moves, and invariance across rebalances.

- Requests generating across several rebalances (EP=8, redundant experts) give bitwise the
  results of EPLB off; engagement: rebalances ran and many experts really moved.
- Negative control: with multiple reduction on, the same rebalances change bits.
- A failure injected while moving a plan that moves experts leaves the old placement serving
  and every request intact; so does a real local error (out of memory while staging), at world
  size 1 and 2, and a plan that is no placement is refused before anything changes.
- Load statistics count every (token, slot) row exactly.
"""

from __future__ import annotations

import time
import types

import pytest
import torch

from eplb import ExpertPlacement
from moe_runtime import LLM, SamplingParams
from moe_runtime.config import load_config
from moe_runtime.engine.balancer import ExpertBalancer, RebalanceError
from moe_runtime.executor import WorkerError
from tests.invariance import (
    TINY_CONFIG,
    fingerprint,
    mixed_params,
    mixed_prompts,
    run_in_batches,
)

ray = pytest.importorskip("ray")
NUM = 16
TENSOR_ALLOCATORS = ("new_empty", "new_zeros")  # the Tensor methods _arm_full_gpu guards
EPLB_ON = {
    "eplb.enabled": True,
    "eplb.interval_steps": 4,
    "eplb.window_steps": 4,
    "eplb.balancedness_threshold": 1.0,  # never skip: rebalance every interval
}


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_local):
    yield


@pytest.fixture(scope="module")
def workload():
    return mixed_prompts(NUM, 8, 120, seed=31), mixed_params(NUM, 24)


def _ep8(**overrides) -> LLM:
    base = {"parallel.world_size": 8, "eplb.num_redundant_experts": 8, "parallel.timeout_s": 60}
    return LLM(TINY_CONFIG, **base, **overrides)


def _run(llm: LLM, workload) -> tuple[dict, list[dict]]:
    prompts, params = workload
    try:
        got = run_in_batches(llm, prompts, params, [list(range(len(prompts)))])
        return got, list(llm.engine.balancer.history)
    finally:
        llm.shutdown()


def test_generation_across_rebalances_is_bitwise_unchanged(workload):
    reference, _ = _run(_ep8(), workload)
    got, history = _run(_ep8(**EPLB_ON), workload)
    moves = [r for r in history if not r["skipped"]]
    assert len(moves) >= 3, f"only {len(moves)} rebalances ran"
    assert sum(r["experts_moved"] for r in moves) >= 40, "few experts really moved"
    assert sum(r["bytes_moved"] for r in moves) > 0, "no expert weights crossed ranks"
    assert got == reference


def test_multiple_reduction_with_rebalance_changes_bits(workload):
    reduce = {"parallel.allow_multiple_reduction": True}
    reference, _ = _run(_ep8(**reduce), workload)
    got, history = _run(_ep8(**reduce, **EPLB_ON), workload)
    assert any(not r["skipped"] for r in history)
    assert got != reference, "multiple reduction + rebalance matched: the control cannot fail"


def test_failed_move_keeps_old_placement_and_requests(workload):
    prompts, params = workload
    reference, _ = _run(_ep8(), workload)
    llm = _ep8()
    engine = llm.engine
    try:
        seqs = [engine.add_request(p, sp).samples[0] for p, sp in zip(prompts, params, strict=True)]
        for _ in range(5):
            engine.step()
        before = [s["physical_to_logical"] for s in engine.worker_stats()]
        cause = r"rank 3: layer 1: RuntimeError: injected failure at layer 1"
        with pytest.raises(RebalanceError, match=rf"\({cause}\); the old placement is in use"):
            engine.rebalance(inject_failure=(3, 1))  # the error names the rank and its cause
        assert [s["physical_to_logical"] for s in engine.worker_stats()] == before
        failed = engine.balancer.history[-1]
        assert failed.get("failed")
        assert engine.stats().num_failed_rebalances == 1  # /metrics' moe_rebalances_failed_total
        # Engagement: the refused plan would have moved experts, so the unchanged placement
        # above was kept, not merely left with nothing to move.
        assert failed["experts_moved"] > 0 and failed["bytes_moved"] > 0, failed
        while engine.has_unfinished():
            engine.step()
    finally:
        llm.shutdown()
    for i, seq in enumerate(seqs):
        assert _fingerprint(seq) == reference[i], f"request {i} altered by the failed rebalance"


def _fingerprint(seq) -> tuple:
    return (
        tuple(seq.output_token_ids),
        tuple(map(float.hex, seq.output_logprobs)),
        tuple(tuple((t, float.hex(v)) for t, v in d.items()) for d in seq.output_top_logprobs),
    )


def _on_rank(engine, rank: int, fn, *args):
    """fn(worker, *args) in the process of `rank`'s worker (a Ray actor above world size 1)."""
    if engine.config.parallel.world_size == 1:
        return fn(engine.executor.worker, *args)
    return ray.get(engine.executor.workers[rank].__ray_call__.remote(fn, *args))


def _arm_staging_oom(worker, layer: int) -> None:
    """In the worker's process: eplb.rearrange's `torch.empty_like` of MoE layer `layer`'s
    gate_up weights (the staging copy of this rank's experts, the one allocation a move adds)
    raises torch.OutOfMemoryError; every other call is torch's. Each raise is counted on
    `worker.staging_ooms` (the engagement check reads it)."""
    import eplb.rearrange as rearrange

    target = worker.runner.model.moe_layers[layer].experts.gate_up_proj.data
    worker.staging_ooms = 0

    class StagingOomTorch(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

        def empty_like(self, tensor, *args, **kwargs):
            if tensor.data_ptr() == target.data_ptr() and tensor.shape == target.shape:
                worker.staging_ooms += 1
                raise torch.OutOfMemoryError("injected: staging allocation failed")
            return torch.empty_like(tensor, *args, **kwargs)

    rearrange.torch = StagingOomTorch("torch")


def _disarm_staging_oom(worker) -> int:
    """Undo _arm_staging_oom in the worker's process; -> the OOMs it raised."""
    import eplb.rearrange as rearrange

    rearrange.torch = torch
    return worker.staging_ooms


def _arm_full_gpu(worker, layer: int) -> None:
    """In the worker's process: the GPU is full from MoE layer `layer`'s transfer buffers on.
    The first allocation from that layer's gate_up weights (the buffers') raises
    torch.OutOfMemoryError, and so does every later one eplb.rearrange makes (torch.empty_like,
    torch.cat, and new_empty / new_zeros of any expert weights); each raise is counted on
    `worker.staging_ooms`. Other tensors' allocations are torch's."""
    import eplb.rearrange as rearrange

    experts = [moe.experts for moe in worker.runner.model.moe_layers]
    weights = {w.data_ptr() for e in experts for w in (e.gate_up_proj.data, e.down_proj.data)}
    target = experts[layer].gate_up_proj.data.data_ptr()
    worker.staging_ooms, worker.is_gpu_full = 0, False
    worker.tensor_allocators = {name: getattr(torch.Tensor, name) for name in TENSOR_ALLOCATORS}

    def out_of_memory(what: str):
        worker.staging_ooms += 1
        worker.is_gpu_full = True
        raise torch.OutOfMemoryError(f"injected: {what} (the GPU is full)")

    def guarded(name: str):
        allocate = worker.tensor_allocators[name]

        def allocate_unless_full(tensor, *args, **kwargs):
            if tensor.data_ptr() in weights and (worker.is_gpu_full or tensor.data_ptr() == target):
                out_of_memory(f"Tensor.{name}")
            return allocate(tensor, *args, **kwargs)

        return allocate_unless_full

    class FullGpuTorch(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

        def empty_like(self, tensor, *args, **kwargs):
            if worker.is_gpu_full:
                out_of_memory("torch.empty_like")
            return torch.empty_like(tensor, *args, **kwargs)

        def cat(self, tensors, *args, **kwargs):
            if worker.is_gpu_full:
                out_of_memory("torch.cat")
            return torch.cat(tensors, *args, **kwargs)

    for name in TENSOR_ALLOCATORS:
        setattr(torch.Tensor, name, guarded(name))
    rearrange.torch = FullGpuTorch("torch")


def _disarm_full_gpu(worker) -> int:
    """Undo _arm_full_gpu in the worker's process; -> the OOMs it raised."""
    import eplb.rearrange as rearrange

    rearrange.torch = torch
    for name, allocate in worker.tensor_allocators.items():
        setattr(torch.Tensor, name, allocate)
    return worker.staging_ooms


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(
    ("arm", "disarm"),
    [(_arm_staging_oom, _disarm_staging_oom), (_arm_full_gpu, _disarm_full_gpu)],
    ids=["staging", "full_gpu"],
)
def test_a_local_error_while_staging_keeps_old_placement_and_requests(world_size, arm, disarm):
    """The last rank runs out of memory while staging MoE layer 1's experts: allocating their
    staging copy, or (full_gpu) their transfer buffers and everything after. The error escaped
    the worker: the engine died and every request in flight ended with it, though nothing had
    changed (at world size 2 rank 0 first waited out the collective timeout in the layer's
    exchange). With a full GPU it still did: the failed rank's placeholders of the agreed sizes,
    allocated outside the try, ran out of memory too. A rank with a local error now votes no
    before the next exchange and every rank stops there: RebalanceError at once, the failure
    counted, the old placement serving, the requests bitwise as in a run without the move."""
    prompts, params = mixed_prompts(4, 10, 40, seed=3), mixed_params(4, 12)
    overrides = {
        "parallel.world_size": world_size,
        "eplb.num_redundant_experts": 2 * world_size,
        "parallel.timeout_s": 30,
    }
    reference, _ = _run(LLM(TINY_CONFIG, **overrides), (prompts, params))
    llm = LLM(TINY_CONFIG, **overrides)
    engine, rank = llm.engine, world_size - 1
    try:
        seqs = [engine.add_request(p, sp).samples[0] for p, sp in zip(prompts, params, strict=True)]
        for _ in range(4):
            engine.step()
        before = [s["physical_to_logical"] for s in engine.worker_stats()]
        _on_rank(engine, rank, arm, 1)
        started = time.monotonic()
        try:
            with pytest.raises(RebalanceError, match=rf"rank {rank}: layer 1: OutOfMemoryError"):
                engine.rebalance()
        finally:
            num_ooms = _on_rank(engine, rank, disarm)
        assert time.monotonic() - started < 10, "a rank waited out a collective"
        assert num_ooms == 1  # engagement: the OOM was raised, and nothing allocated after it
        assert engine.error is None
        assert engine.stats().num_failed_rebalances == 1
        assert [s["physical_to_logical"] for s in engine.worker_stats()] == before
        failed = engine.balancer.history[-1]
        assert failed.get("failed") and failed["experts_moved"] > 0, failed  # a real move
        while engine.has_unfinished():
            engine.step()
        assert [s.finish_reason for s in seqs] == ["length"] * 4
        assert {i: _fingerprint(s) for i, s in enumerate(seqs)} == reference
        # Control: the same rebalance, nothing injected, moves the experts.
        llm.generate(prompts, params)
        assert not engine.rebalance()["skipped"]
        assert [s["physical_to_logical"] for s in engine.worker_stats()] != before
    finally:
        llm.shutdown()


def test_a_plan_that_is_no_placement_is_refused_before_anything_changes():
    """A plan that leaves logical expert 15 without a replica: Worker.rearrange installed the
    moved weights, then failed building the placement, so the old placement routed tokens to
    new weights (other bits, silently). Now the plan is checked first: ValueError naming the
    expert (or the shape, for a plan of another size), weights, placement and bits unchanged."""
    prompts, params = mixed_prompts(4, 10, 40, seed=3), mixed_params(4, 8)
    overrides = {"eplb.num_redundant_experts": 4, "cache.enable_prefix_caching": False}
    llm = LLM(TINY_CONFIG, **overrides)
    try:
        reference = run_in_batches(llm, prompts, params, [[0, 1, 2, 3]])
        worker = llm.engine.executor.worker
        layers = worker.runner.model.moe_layers
        old = worker.placement.physical_to_logical.clone()
        weights = [
            (moe.experts.gate_up_proj.clone(), moe.experts.down_proj.clone()) for moe in layers
        ]
        bad = (torch.arange(20) % 15).expand_as(old)  # experts 0..14 only
        assert not bad.equal(old)  # engagement: the plan would move experts
        with pytest.raises(ValueError, match="logical expert 15 of layer 0 has no replica"):
            llm.engine.executor.call("rearrange", [(bad.tolist(), None)])
        with pytest.raises(ValueError, match=r"shape \(2, 19\), the placement in use \(2, 20\)"):
            llm.engine.executor.call("rearrange", [(old[:, 1:].tolist(), None)])
        assert worker.placement.physical_to_logical.equal(old)
        for (gate_up, down), moe in zip(weights, layers, strict=True):
            assert gate_up.equal(moe.experts.gate_up_proj) and down.equal(moe.experts.down_proj)
        assert run_in_batches(llm, prompts, params, [[0, 1, 2, 3]]) == reference
    finally:
        llm.shutdown()


@pytest.mark.parametrize("world_size", [1, 2])
def test_load_statistics_count_every_row(world_size):
    prompts = mixed_prompts(5, 10, 40, seed=2)
    params = mixed_params(5, 6)
    llm = LLM(TINY_CONFIG, **{"parallel.world_size": world_size, "eplb.window_steps": 10_000})
    try:
        outputs = llm.generate(prompts, params)
        loads = llm.engine.executor.call_all("window_load")
    finally:
        llm.shutdown()
    # Every processed token (prompt, then each output but the last) sends K rows per MoE layer.
    tokens = sum(len(p) + len(o.token_ids) - 1 for p, o in zip(prompts, outputs, strict=True))
    k = llm.config.model.num_experts_per_tok
    per_layer = [sum(sum(rank[layer]) for rank in loads) for layer in range(len(loads[0]))]
    assert per_layer == [tokens * k] * len(per_layer)


def test_a_forced_rebalance_with_no_load_since_the_last_keeps_the_placement():
    """Each move starts the load window afresh, so a second forced rebalance with no request
    in between planned from zero load: the start-up placement, undoing the first move, and
    reported balancedness 1.0 -> 1.0. It is now skipped, naming why."""
    llm = LLM(TINY_CONFIG, **{"parallel.world_size": 2, "eplb.num_redundant_experts": 2})
    try:
        llm.generate(mixed_prompts(6, 10, 40, seed=5), mixed_params(6, 8))
        first = llm.rebalance()
        assert not first["skipped"] and first["experts_moved"] > 0  # engagement: it moved
        placement = llm.engine.balancer.placement.physical_to_logical.clone()
        balancedness = llm.engine.balancer.last_balancedness
        second = llm.rebalance()
        assert second["skipped"] and second["experts_moved"] == 0, second
        no_load = "no expert load recorded since the last rebalance or worker start"
        assert second["reason"] == no_load
        assert llm.engine.balancer.placement.physical_to_logical.equal(placement)
        assert llm.engine.balancer.last_balancedness == balancedness
        llm.generate(mixed_prompts(6, 10, 40, seed=6), mixed_params(6, 8))
        third = llm.rebalance()  # load again: a plan from it
        assert not third["skipped"], third
    finally:
        llm.shutdown()


def test_a_rebalance_of_a_model_without_moe_layers_is_skipped_naming_why():
    """Every layer dense: the load's reshape failed inside the call, a worker fault that killed
    the engine (each /admin/rebalance rebuilt the workers; the fourth gave up the server)."""
    llm = LLM(TINY_CONFIG, **{"model.first_k_dense_replace": 3})
    try:
        params = SamplingParams(max_tokens=4, seed=1)
        before = llm.generate([[5, 6, 7]], params)[0].token_ids
        report = llm.rebalance()
        assert report["skipped"] and report["reason"] == "the model has no MoE layers", report
        assert llm.engine.error is None and llm.engine.num_restarts == 0
        assert llm.generate([[5, 6, 7]], params)[0].token_ids == before
    finally:
        llm.shutdown()


def test_balancedness_before_is_measured_from_the_rows_each_rank_served():
    """Every expert with a copy on both ranks and one request (one DP rank's tokens): each rank
    sends an expert's rows to its own copy, so rank 0 served every row. The report said 1.0,
    an estimate splitting each expert's load over its replicas, and a periodic check skipped
    as balanced; now it is the measured 0.5, and the plan (a copy of each expert on each rank,
    as now: only its slot order differed, which keep_held_slots undoes) is skipped."""
    llm = LLM(TINY_CONFIG, **{"parallel.world_size": 2, "eplb.num_redundant_experts": 16})
    try:
        llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=8, seed=1))
        per_rank = [sum(map(sum, load)) for load in llm.engine.executor.call_all("window_load")]
        assert per_rank[0] > 0 and per_rank[1] == 0, per_rank  # engagement: all on rank 0
        report = llm.engine.rebalance(force=False)
        assert report["balancedness_before"] == 0.5, report
        assert report["skipped"] and report["reason"] == "the plan is the current placement"
        assert llm.engine.balancer.last_balancedness == 0.5
    finally:
        llm.shutdown()


def test_a_plan_no_better_in_the_planners_model_is_skipped_unless_forced():
    """Two ranks, four experts, no copies: a plan giving each rank other experts (so not the
    current placement) that the planner's model rates no better is skipped, naming why; a
    forced rebalance takes it."""
    config = load_config(TINY_CONFIG, {"parallel.world_size": 2})
    balancer = ExpertBalancer(config, None, ExpertPlacement.default(1, 4, 0, 2))
    load = torch.tensor([[10, 10, 10, 10]])
    now, plan = torch.tensor([[0, 1, 2, 3]]), torch.tensor([[0, 2, 1, 3]])
    planned, reason = balancer._judge(load, now, plan, force=False)
    assert planned == 1.0 and reason.startswith("as the planner models it"), reason
    assert balancer._judge(load, now, plan, force=True) == (1.0, None)
    assert balancer._judge(load, now, now, force=True)[1] == "the plan is the current placement"


def _arm_death_while_staging(worker, layer: int) -> None:
    """In the worker's process: its process exits (a crash) at eplb.rearrange's staging
    allocation of MoE layer `layer`'s experts, the next time a move stages it."""
    import os

    import eplb.rearrange as rearrange

    target = worker.runner.model.moe_layers[layer].experts.gate_up_proj.data

    class CrashingTorch(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

        def empty_like(self, tensor, *args, **kwargs):
            if tensor.data_ptr() == target.data_ptr():
                os._exit(1)
            return torch.empty_like(tensor, *args, **kwargs)

    rearrange.torch = CrashingTorch("torch")


def test_a_rank_dying_in_a_periodic_move_fails_no_request_that_had_finished():
    """A periodic rebalance ran right after the step that counted to eplb.interval_steps,
    inside that step's call: a rank dying in its move raised out of the step, so the
    requests that step had just finished (every token computed) failed with the rank's
    death, and their outputs were never returned (a whole generate raised, a server's
    completion got a 500). The move now runs before the next step: the finished requests
    come back, and the death fails the next call, whose requests never ran."""
    overrides = {
        "parallel.world_size": 2,
        "eplb.num_redundant_experts": 2,
        "parallel.timeout_s": 30,
        **EPLB_ON,  # a move every 4 steps; one prompt of max_tokens 4 is 4 steps
    }
    params = SamplingParams(max_tokens=4, seed=1, ignore_eos=True, logprobs=2)
    llm = LLM(TINY_CONFIG, **overrides)
    engine = llm.engine
    try:
        _on_rank(engine, 1, _arm_death_while_staging, 1)
        finished = llm.generate([[5, 6, 7, 8, 9, 10]], params, use_tqdm=False)[0]
        assert engine.num_steps == 4 and finished.outputs[0].finish_reason == "length"
        with pytest.raises(WorkerError, match="rank 1 died during rearrange"):
            llm.generate([[50, 61, 7, 200]], params, use_tqdm=False)  # the move, first
        again = llm.generate([[5, 6, 7, 8, 9, 10]], params, use_tqdm=False)[0]
        assert engine.num_restarts == 1  # engagement: the move really killed the rank
        assert fingerprint(again) == fingerprint(finished)
    finally:
        llm.shutdown()
