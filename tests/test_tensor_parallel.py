"""Tensor parallelism inside a DP group (TP=2), on a local Ray cluster with gloo.

- Batch invariance at TP=2 (one DP group, and two DP groups of two): alone vs together vs
  shuffled, bitwise; the negative control (fast kernels) finds a difference.
- Engagement, read from the workers, not from the outputs: every rank reports TP size 2 and its
  TP rank, and ran TP all-reduces, as many as the other rank of its TP group.
- TP=2 logprobs are close to TP=1 (same weights, split heads and MLPs, a pinned all-reduce);
  TP=2 == TP=1 bit for bit is not claimed. The unpinned all-reduce's size dependence is shown in
  tests/test_comm_allreduce.py.
"""

from __future__ import annotations

import pytest

from moe_runtime import LLM
from moe_runtime.model.tensor_parallel import shard_dim
from tests.invariance import (
    TINY_CONFIG,
    mixed_params,
    mixed_prompts,
    random_sub_batches,
    run_in_batches,
)

ray = pytest.importorskip("ray")
NUM = 12


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_local):
    yield


def _tp_llm(world_size: int, **overrides) -> LLM:
    return LLM(
        TINY_CONFIG,
        **{"parallel.world_size": world_size, "parallel.tp_size": 2, "parallel.timeout_s": 60},
        **overrides,
    )


def _assert_tp_ran(llm: LLM) -> None:
    """Every rank held a TP=2 shard and ran the TP all-reduces in step with its TP partner."""
    stats = llm.engine.worker_stats()
    world_size = len(stats)
    assert [s["tp_size"] for s in stats] == [2] * world_size
    assert [s["tp_rank"] for s in stats] == [rank % 2 for rank in range(world_size)]
    counts = [s["num_tp_all_reduces"] for s in stats]
    assert all(n > 0 for n in counts), f"some rank never ran a TP all-reduce: {counts}"
    assert counts[0::2] == counts[1::2], f"TP partners ran different all-reduces: {counts}"


def _alone_together_shuffled(llm: LLM) -> tuple[dict, dict, dict]:
    prompts, params = mixed_prompts(NUM, 8, 150, seed=13), mixed_params(NUM, 12)
    alone = run_in_batches(llm, prompts, params, [[i] for i in range(NUM)])
    together = run_in_batches(llm, prompts, params, [list(range(NUM))])
    shuffled = run_in_batches(llm, prompts, params, random_sub_batches(NUM, seed=3, max_size=5))
    return alone, together, shuffled


@pytest.mark.parametrize("world_size", [2, 4], ids=["dp1-tp2", "dp2-tp2"])
def test_tp2_batch_invariance(world_size):
    llm = _tp_llm(world_size)
    try:
        alone, together, shuffled = _alone_together_shuffled(llm)
        _assert_tp_ran(llm)
    finally:
        llm.shutdown()
    for i in range(NUM):
        assert together[i] == alone[i], f"prompt {i}: together differs from alone at TP=2"
        assert shuffled[i] == alone[i], f"prompt {i}: shuffled differs from alone at TP=2"


def test_tp2_negative_control_fast_kernels():
    llm = _tp_llm(2, **{"kernels.mode": "fast"})
    try:
        alone, together, shuffled = _alone_together_shuffled(llm)
    finally:
        llm.shutdown()
    assert any(together[i] != alone[i] or shuffled[i] != alone[i] for i in range(NUM))


def test_tp2_close_to_tp1_and_really_split():
    sequences = mixed_prompts(4, 40, 80, seed=5)
    tp1 = LLM(TINY_CONFIG).score(sequences, [8] * 4)
    llm = _tp_llm(2)
    try:
        tp2 = llm.score(sequences, [8] * 4)
        _assert_tp_ran(llm)
    finally:
        llm.shutdown()
    flat1 = [x for row in tp1 for x in row]
    flat2 = [x for row in tp2 for x in row]
    assert max(abs(a - b) for a, b in zip(flat1, flat2, strict=True)) < 1e-5  # stated tolerance


def test_shard_rules():
    assert shard_dim("model.layers.0.self_attn.q_b_proj.weight") == 0
    assert shard_dim("model.layers.0.self_attn.o_proj.weight") == 1
    assert shard_dim("model.layers.1.mlp.shared_experts.down_proj.weight") == 1
    assert shard_dim("model.layers.1.mlp.shared_experts.gate_proj.weight") == 0
    assert shard_dim("model.layers.1.mlp.experts.down_proj") is None
    assert shard_dim("model.layers.1.mlp.experts.gate_up_proj") is None
    assert shard_dim("model.layers.0.self_attn.kv_a_proj_with_mqa.weight") is None
    assert shard_dim("model.layers.1.mlp.gate.weight") is None
    assert shard_dim("lm_head.weight") == 0
