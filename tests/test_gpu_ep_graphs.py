"""EP=2 over NCCL with CUDA graphs: the MoE layers captured with FixedCapacityDispatcher.

With `kernels.cuda_graphs: true` over NCCL the ranks exchange rows in fixed-capacity blocks
(parallel.ep_capacity_dispatch 'auto'), so a decode step is one graph with every MoE layer and
its all-to-alls inside, every rank replaying the same agreed bucket (a rank with no sequences
replays padding rows). Checks: prompts alone, together and in shuffled sub-batches are bitwise
world size 1's alone run; engagement: both ranks replayed graphs of one segment (no cut at the
MoE layers) and rows crossed the GPUs; control: fast kernels find a difference. Needs 2 GPUs;
not run on CPU machines.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_runtime import LLM
from tests.invariance import mixed_params, mixed_prompts, random_sub_batches, run_in_batches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multi_gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

TINY_GPU = Path(__file__).resolve().parent.parent / "launch" / "configs" / "tiny_gpu.yaml"
NUM_PROMPTS, MAX_TOKENS = 32, 24
BASE = {"cache.enable_prefix_caching": False}
EP2_GRAPHS = {
    "parallel.world_size": 2,
    "parallel.backend": "nccl",
    "parallel.timeout_s": 120,
    "kernels.cuda_graphs": True,
}


@pytest.fixture(scope="module")
def workload():
    return mixed_prompts(NUM_PROMPTS, 8, 200, seed=17), mixed_params(NUM_PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def ray_on_gpu():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=8, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def alone_world1(workload) -> dict:
    prompts, params = workload
    llm = LLM(TINY_GPU, **BASE)
    try:
        return run_in_batches(llm, prompts, params, [[i] for i in range(NUM_PROMPTS)])
    finally:
        llm.shutdown()


def _ep2_graphs(workload, mode: str) -> tuple[dict, dict, dict, list[dict]]:
    """(8 prompts alone, all together, shuffled sub-batches, worker stats) at EP=2."""
    prompts, params = workload
    llm = LLM(TINY_GPU, **{**BASE, **EP2_GRAPHS, "kernels.mode": mode})
    try:
        alone = run_in_batches(llm, prompts, params, [[i] for i in range(8)])
        together = run_in_batches(llm, prompts, params, [list(range(NUM_PROMPTS))])
        shuffled = run_in_batches(llm, prompts, params, random_sub_batches(NUM_PROMPTS, seed=6))
        stats = llm.engine.worker_stats()
    finally:
        llm.shutdown()
    return alone, together, shuffled, stats


def test_gpu_ep2_nccl_graphs_golden(ray_on_gpu, workload, alone_world1):
    alone, together, shuffled, stats = _ep2_graphs(workload, "invariant")
    assert [s["ep_dispatcher"] for s in stats] == ["FixedCapacityDispatcher"] * 2
    # Engagement: whole decode steps were replayed, MoE layers inside (one segment).
    assert all(s["num_graph_segments"] == 1 for s in stats), stats
    assert all(s["num_graph_replays"] >= MAX_TOKENS for s in stats), stats
    assert all(s["num_rows_sent_remote"] > 0 for s in stats), "no rows crossed the GPUs"
    # Prefills (no graph) took the uneven exchange; the replays the fixed blocks.
    eager = [s["num_eager_rows_sent_remote"] for s in stats]
    assert all(0 < e < s["num_rows_sent_remote"] for e, s in zip(eager, stats, strict=True)), eager
    for i in range(8):
        assert alone[i] == alone_world1[i], f"prompt {i}: EP=2 alone differs from world size 1"
    for i in range(NUM_PROMPTS):
        assert together[i] == alone_world1[i], f"prompt {i}: EP=2 batched differs"
        assert shuffled[i] == alone_world1[i], f"prompt {i}: EP=2 shuffled differs"


def test_gpu_ep2_nccl_graphs_negative_control_fast(ray_on_gpu, workload):
    alone, together, shuffled, stats = _ep2_graphs(workload, "fast")
    assert all(s["num_graph_segments"] == 1 for s in stats), stats
    assert any(together[i] != alone[i] or shuffled[i] != alone[i] for i in range(8)), (
        "fast kernels gave identical bits at EP=2 with graphs: the golden test could not fail"
    )
