"""Tensor parallelism on a local Ray cluster with gloo: every TP degree gives the TP=1 bits.

- TP 2 and 4 (one DP group), and TP 2 in two DP groups of two (EP over all four ranks): batched
  and shuffled generations and score() logprobs equal the world-size-1 run's bit for bit (token
  ids, chosen and top-k logprobs): batch, layout and TP-degree invariance together. The dense
  MLP's row-parallel down_proj cuts K into kernels.tp_max fixed chunks summed in one binary
  tree, finished from the ranks' fp32 subtree sums (moe_kernels/tp_linear.py); o_proj and the MoE
  layers run whole on each rank's token share.
- Engagement, read from the workers, not from the outputs: every rank reports its TP size and
  rank; the row-parallel reductions (each an all-gather of fp32 subtree sums) ran once per
  dense layer and forward, in step with the TP partners; every attention layer swapped its
  heads for token shares and gathered o_proj's rows, every MoE layer dispatched the rank's
  share and gathered the finished rows (the counts in the model's layer ratios); with EP the
  ranks sent rows to each other.
- Controls: fast kernels (the dense down_proj as one GEMM over the local K and the backend's
  all_reduce of the partials; o_proj and the experts as M-dependent GEMMs on the shares) give
  TP=2 bits that differ from TP=1, and are not batch-invariant at TP=2. The previous invariant
  TP sum (linear over the local K, partials summed in rank order) is shown to differ from TP=1
  in tests/test_tp_linear.py; o_proj's exchange alone in tests/test_tp_attention.py.

The model is the shipped tiny config: 4 attention heads, so a rank at TP 4 holds one (the CPU
reference attention computes each head alone, moe_kernels/attention.py, so its bits ignore the heads
per rank; tests/test_kernels_attention.py checks that at the V2-Lite latent width).
"""

from __future__ import annotations

import pytest

from moe_runtime import LLM
from moe_runtime.config import load_config
from moe_runtime.model.tensor_parallel import shard_dim
from tests.invariance import (
    TINY_CONFIG,
    mixed_params,
    mixed_prompts,
    random_sub_batches,
    run_in_batches,
)

ray = pytest.importorskip("ray")
NUM, MAX_TOKENS = 12, 12
# (world size, TP size): DP = world / TP groups; experts are parallel over the whole world.
LAYOUTS = [
    pytest.param(2, 2, id="dp1-tp2"),
    pytest.param(4, 4, id="dp1-tp4"),
    pytest.param(4, 2, id="dp2-tp2-ep4"),
]


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_local):
    yield


@pytest.fixture(scope="module")
def workload():
    return mixed_prompts(NUM, 8, 150, seed=13), mixed_params(NUM, MAX_TOKENS)


@pytest.fixture(scope="module")
def scored():
    return mixed_prompts(4, 40, 80, seed=5), [8] * 4


def _run(llm: LLM, workload, scored) -> tuple[dict, dict, list]:
    """(all prompts together, shuffled sub-batches, score() logprobs) of one engine."""
    prompts, params = workload
    together = run_in_batches(llm, prompts, params, [list(range(NUM))])
    shuffled = run_in_batches(llm, prompts, params, random_sub_batches(NUM, seed=3, max_size=5))
    return together, shuffled, llm.score(*scored)


@pytest.fixture(scope="module")
def tp1(workload, scored):
    """The world-size-1 run (TP=1, EP=1): each prompt alone, and score()."""
    prompts, params = workload
    llm = LLM(TINY_CONFIG)
    alone = run_in_batches(llm, prompts, params, [[i] for i in range(NUM)])
    return alone, llm.score(*scored)


def _tp_llm(world_size: int, tp_size: int, **overrides) -> LLM:
    return LLM(
        TINY_CONFIG,
        **{
            "parallel.world_size": world_size,
            "parallel.tp_size": tp_size,
            "parallel.timeout_s": 60,
            **overrides,
        },
    )


def _assert_tp_ran(stats: list[dict], tp_size: int, is_invariant: bool = True) -> None:
    """Every rank held a TP shard and ran each layer's TP collectives in step with its TP
    partners: per forward one row-parallel reduction a dense layer (in invariant mode each an
    all-gather of fp32 subtree sums, in fast mode none), one head exchange and one gather of
    o_proj's rows an attention layer, one gather of finished rows a MoE layer."""
    cfg = load_config(TINY_CONFIG).model
    num_dense, num_layers = cfg.first_k_dense_replace, cfg.num_hidden_layers
    assert 0 < num_dense < num_layers, "the tiny model needs dense and MoE layers for this check"
    world_size = len(stats)
    assert [s["tp_size"] for s in stats] == [tp_size] * world_size
    assert [s["tp_rank"] for s in stats] == [rank % tp_size for rank in range(world_size)]
    counts = [s["num_tp_all_reduces"] for s in stats]
    assert all(n > 0 for n in counts), f"some rank never ran a TP reduction: {counts}"
    for group in range(0, world_size, tp_size):
        assert len(set(counts[group : group + tp_size])) == 1, f"TP partners differ: {counts}"
    # The fp32 subtree sums come from the dense MLP alone: no more reductions than its forwards.
    assert all(n % num_dense == 0 for n in counts), counts
    forwards = [n // num_dense for n in counts]
    gathers = [s["num_tp_fp32_gathers"] for s in stats]
    assert gathers == (counts if is_invariant else [0] * world_size), (counts, gathers)
    exchanges = [s["num_tp_head_exchanges"] for s in stats]
    assert exchanges == [n * num_layers for n in forwards], (forwards, exchanges)
    assert [s["num_tp_attention_gathers"] for s in stats] == exchanges
    # Each rank dispatched only its share of the group's tokens and gathered the routed rows.
    shares = [s["num_tp_share_gathers"] for s in stats]
    assert shares == [n * (num_layers - num_dense) for n in forwards], (forwards, shares)


@pytest.mark.parametrize(("world_size", "tp_size"), LAYOUTS)
def test_tp_degree_gives_tp1_bits(world_size, tp_size, workload, scored, tp1):
    alone1, score1 = tp1
    llm = _tp_llm(world_size, tp_size)
    try:
        together, shuffled, score = _run(llm, workload, scored)
        stats = llm.engine.worker_stats()
    finally:
        llm.shutdown()
    _assert_tp_ran(stats, tp_size)
    if world_size > tp_size:
        assert all(s["num_rows_sent_remote"] > 0 for s in stats), "some rank never sent rows"
    for i in range(NUM):
        assert together[i] == alone1[i], f"prompt {i}: TP={tp_size} batched differs from TP=1"
        assert shuffled[i] == alone1[i], f"prompt {i}: TP={tp_size} shuffled differs from TP=1"
    assert score == score1, f"TP={tp_size} score() logprobs differ from TP=1"


def test_tp2_negative_control_fast_kernels(workload, scored):
    """Fast mode at TP=2 differs from fast mode at TP=1, and is not batch-invariant."""
    prompts, params = workload
    fast1 = LLM(TINY_CONFIG, **{"kernels.mode": "fast"})
    score1 = fast1.score(*scored)
    llm = _tp_llm(2, 2, **{"kernels.mode": "fast"})
    try:
        alone = run_in_batches(llm, prompts, params, [[i] for i in range(NUM)])
        together, shuffled, score = _run(llm, workload, scored)
        stats = llm.engine.worker_stats()
    finally:
        llm.shutdown()
    _assert_tp_ran(stats, 2, is_invariant=False)
    assert score != score1, "fast TP=2 scored exactly like fast TP=1: the test could not fail"
    assert any(together[i] != alone[i] or shuffled[i] != alone[i] for i in range(NUM))


def test_shard_rules():
    assert shard_dim("model.layers.0.self_attn.q_b_proj.weight") == 0
    # o_proj runs whole on each TP rank's share of the tokens (mla.py).
    assert shard_dim("model.layers.0.self_attn.o_proj.weight") is None
    assert shard_dim("model.layers.0.mlp.down_proj.weight") == 1  # the dense MLP
    assert shard_dim("model.layers.0.mlp.gate_proj.weight") == 0
    # The shared experts run whole on each TP rank's share of the tokens.
    assert shard_dim("model.layers.1.mlp.shared_experts.down_proj.weight") is None
    assert shard_dim("model.layers.1.mlp.shared_experts.gate_proj.weight") is None
    assert shard_dim("model.layers.1.mlp.experts.down_proj") is None
    assert shard_dim("model.layers.1.mlp.experts.gate_up_proj") is None
    assert shard_dim("model.layers.0.self_attn.kv_a_proj_with_mqa.weight") is None
    assert shard_dim("model.layers.1.mlp.gate.weight") is None
    assert shard_dim("lm_head.weight") == 0


def test_shared_experts_whole_on_every_tp_rank():
    """At TP 2 a rank holds the shared experts' whole weights with a plain down projection (no
    TP reduction: they run on the rank's token share), while the dense MLP keeps its split
    intermediate dim and row-parallel down."""
    import torch

    from moe_kernels import KernelConfig, build_op_table
    from moe_runtime.config import load_config
    from moe_runtime.model.layers import GatedMLP, Linear, RowParallelLinear
    from moe_runtime.model.moe import MoE
    from moe_runtime.model.tensor_parallel import TensorParallel

    cfg = load_config(TINY_CONFIG).model
    ops = build_op_table(KernelConfig(), "cpu")
    tp = TensorParallel(size=2, rank=1)
    moe = MoE(cfg, ops, torch.float32, cfg.n_routed_experts, tp)
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    down = moe.shared_experts.down_proj
    assert type(down) is Linear and tuple(down.weight.shape) == (cfg.hidden_size, shared)
    assert tuple(moe.shared_experts.gate_up_weight.shape) == (2 * shared, cfg.hidden_size)
    dense = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ops, torch.float32, tp)
    assert type(dense.down_proj) is RowParallelLinear
    assert tuple(dense.down_proj.weight.shape) == (cfg.hidden_size, cfg.intermediate_size // 2)
