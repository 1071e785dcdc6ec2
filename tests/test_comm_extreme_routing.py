"""The MoE layer (moe.py) over gloo at EP=4 under extreme routing, bitwise against one process.

Routing is forced through the router itself: noaux_tc picks by score + e_score_correction_bias,
so a large bias on a few experts puts them in every token's top-k (the weights stay the
unbiased scores). Scenarios: every token to one rank's experts while another rank has no tokens
(that rank then receives 40 rows where the fixed-capacity blocks hold C = 24: one source block
overflows into the next); every token to one expert; one token in the whole step; two ranks at
scheduler.max_num_batched_tokens each, every token to one rank (4096 rows against C = 2048);
every token on experts with redundant replicas. The uneven exchange (AllToAllDispatcher) and the
fixed-capacity one (FixedCapacityDispatcher, eager as on CPU) must give world size 1's bits,
with no row dropped. Engagement: rows crossed ranks, the receiving rank got more rows than one
block holds, replicas served the rows the static table sends them. Controls: multiple reduction
and fast kernels (batch-dependent GEMMs, arrival-order combine) differ from world size 1.
"""

from __future__ import annotations

import pytest
import torch

from comm import AllToAllDispatcher, FixedCapacityDispatcher, init_process_groups
from comm.groups import destroy_process_groups
from eplb.placement import ExpertPlacement
from moe_kernels import KernelConfig, build_op_table
from moe_runtime.config import load_config
from moe_runtime.model.moe import MoE
from moe_runtime.model.tensor_parallel import TensorParallel
from tests.invariance import TINY_CONFIG
from tests.test_comm_groups import MASTER_ADDR, gloo_config, run_ranks

WORLD_SIZE = 4
FORCING_BIAS = 100.0  # sigmoid scores lie in (0, 1): a biased expert always wins its group
# Name -> (tokens per rank, logical experts forced into every top-k, redundant experts).
SCENARIOS = {
    "one_rank": ([6, 0, 3, 1], [12, 13, 14, 15], 0),  # rank 3's slots at EP=4
    "one_expert": ([6, 0, 3, 1], [9], 0),
    "one_token": ([0, 0, 0, 1], [0, 1, 2, 3], 0),
    "max_batched": ([512, 0, 0, 512], [12, 13, 14, 15], 0),
    "replicated": ([5, 3, 2, 4], [0, 1, 2, 3], WORLD_SIZE),  # replicas of 0..3 on rank 3
}
# Kind -> (kernels.mode, dispatcher class, allow_multiple_reduction).
KINDS = {
    "uneven": ("invariant", AllToAllDispatcher, False),
    "capacity": ("invariant", FixedCapacityDispatcher, False),
    "multiple_reduction": ("invariant", AllToAllDispatcher, True),
    "fast_uneven": ("fast", AllToAllDispatcher, False),
    "fast_capacity": ("fast", FixedCapacityDispatcher, False),
}


def reference_layer(mode: str, forced: list[int]) -> MoE:
    """World size 1: the tiny model's MoE layer, every expert local, seeded weights."""
    cfg = load_config(TINY_CONFIG).model
    ops = build_op_table(KernelConfig(mode=mode), "cpu")
    moe = MoE(cfg, ops, torch.float32, cfg.n_routed_experts, TensorParallel())
    gen = torch.Generator().manual_seed(0)
    for param in moe.parameters():
        param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    moe.gate.e_score_correction_bias[forced] += FORCING_BIAS
    return moe


def scenario_tokens(counts: list[int]) -> list[torch.Tensor]:
    """Each rank's normed hidden states [T_r, D], from one seed."""
    gen = torch.Generator().manual_seed(1)
    hidden = load_config(TINY_CONFIG).model.hidden_size
    return [torch.randn(num, hidden, generator=gen) for num in counts]


@torch.inference_mode()
def _extreme_worker(rank: int, world_size: int, port: int) -> dict:
    groups = init_process_groups(gloo_config(world_size), rank, MASTER_ADDR, port)
    result = {}
    # Collectives: every rank builds and runs the same layers in the same order, empty or not.
    for name, (counts, forced, num_redundant) in SCENARIOS.items():
        placement = ExpertPlacement.default(1, 16, num_redundant, world_size)
        num_local = placement.num_physical // world_size
        local_experts = placement.local_experts(rank, world_size)[0]
        replica_row = placement.replica_table(world_size)[0, rank]
        x = scenario_tokens(counts)[rank]
        for kind, (mode, dispatcher_cls, allow_multiple_reduction) in KINDS.items():
            full = reference_layer(mode, forced)
            layer = MoE(full.gate.cfg, full.ops, torch.float32, num_local, TensorParallel())
            state = full.state_dict()
            for key in ("experts.gate_up_proj", "experts.down_proj"):
                state[key] = state[key][local_experts]  # each slot holds its logical expert
            layer.load_state_dict(state)
            dispatcher = dispatcher_cls(
                groups.ep_group,
                rank,
                world_size,
                num_local,
                allow_multiple_reduction,
                "cpu",
                full.ops.moe_combine,
            )
            layer.bind_expert_parallel(dispatcher, replica_row)
            out = layer(x, torch.zeros_like(x))
            result[name, kind] = {
                "out": out,
                "rows_received": layer.last_slot_counts.clone(),
                "topk_ids": layer.last_topk_ids,
                "slot_ids": replica_row[layer.last_topk_ids],
                "sent_remote": dispatcher.num_rows_sent_remote,
            }
    destroy_process_groups()
    return result


@pytest.fixture(scope="module")
def extreme_results(tmp_path_factory) -> list[dict]:
    return run_ranks(
        _extreme_worker, WORLD_SIZE, tmp_path_factory.mktemp("extreme"), timeout_s=120.0
    )


def expected(name: str, mode: str) -> list[torch.Tensor]:
    """World size 1 on every rank's tokens at once, split back by rank."""
    counts, forced, _ = SCENARIOS[name]
    with torch.inference_mode():
        x = torch.cat(scenario_tokens(counts))
        out = reference_layer(mode, forced)(x, torch.zeros_like(x))
    return list(out.split(counts))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_extreme_routing_bitwise_equal_to_one_process(extreme_results, name):
    counts, forced, _ = SCENARIOS[name]
    reference = expected(name, "invariant")
    capacity_rows = max(counts) * load_config(TINY_CONFIG).model.num_experts_per_tok
    for rank, res in enumerate(extreme_results):
        for kind in ("uneven", "capacity"):
            assert torch.equal(res[name, kind]["out"], reference[rank]), (name, rank, kind)
        uneven, capacity = res[name, "uneven"], res[name, "capacity"]
        assert torch.equal(capacity["rows_received"], uneven["rows_received"]), (name, rank)
        assert capacity["sent_remote"] == uneven["sent_remote"], (name, rank)
        # Engagement: the bias forced its experts into every token's top-k.
        topk_ids = uneven["topk_ids"]
        assert topk_ids.shape[0] == counts[rank]
        assert all(set(forced) <= set(row) for row in topk_ids.tolist()), (name, rank)
    rows = [res[name, "uneven"]["rows_received"] for res in extreme_results]
    # No row dropped or duplicated: every (token, slot) pair was served exactly once.
    top_k = load_config(TINY_CONFIG).model.num_experts_per_tok
    assert sum(int(r.sum()) for r in rows) == sum(counts) * top_k
    if name in ("one_rank", "max_batched"):
        # Every row went to rank 3, more than one fixed-capacity block of C rows holds.
        assert [int(r.sum()) for r in rows] == [0, 0, 0, sum(counts) * top_k]
        assert int(rows[3].sum()) > capacity_rows, (rows[3], capacity_rows)
    assert sum(res[name, "uneven"]["sent_remote"] for res in extreme_results) > 0


def test_one_expert_gets_every_token(extreme_results):
    counts, (expert,), _ = SCENARIOS["one_expert"]
    holder, slot = divmod(expert, 16 // WORLD_SIZE)
    assert int(extreme_results[holder]["one_expert", "uneven"]["rows_received"][slot]) == sum(
        counts
    )


def test_replicas_serve_the_static_tables_choice(extreme_results):
    """Replicas of experts 0..3 sit on rank 3 (slots 16..19, local 1..4); the static table
    sends ranks 0 and 1 to the originals on rank 0 and ranks 2 and 3 to the replicas."""
    counts, forced, num_redundant = SCENARIOS["replicated"]
    replicas = list(range(16, 16 + num_redundant))
    for rank, res in enumerate(extreme_results):
        slot_ids = res["replicated", "uneven"]["slot_ids"].tolist()
        chosen = set(forced if rank < 2 else replicas)
        assert all(chosen <= set(row) for row in slot_ids), (rank, slot_ids)
    rows = [res["replicated", "uneven"]["rows_received"] for res in extreme_results]
    top_k = load_config(TINY_CONFIG).model.num_experts_per_tok
    assert rows[0][:4].tolist() == [counts[0] + counts[1]] * 4
    assert rows[3][1:].tolist() == [counts[2] + counts[3]] * 4
    assert sum(int(r.sum()) for r in rows) == sum(counts) * top_k


def test_extreme_routing_controls_differ(extreme_results):
    """Multiple reduction (placement-dependent partial sums) and fast kernels (GEMMs whose bits
    follow the batch, arrival-order combine) must find a difference from world size 1, so the
    bitwise comparisons above could fail. The two fast dispatchers still agree: the same rows
    arrive in the same order."""
    num_differ = {"multiple_reduction": 0, "fast_uneven": 0}
    for name in SCENARIOS:
        references = {"invariant": expected(name, "invariant"), "fast": expected(name, "fast")}
        for rank, res in enumerate(extreme_results):
            for kind in num_differ:
                ref = references["fast" if kind.startswith("fast") else "invariant"][rank]
                num_differ[kind] += int((res[name, kind]["out"] != ref).any(dim=1).sum())
            fast, fast_capacity = res[name, "fast_uneven"], res[name, "fast_capacity"]
            assert torch.equal(fast["out"], fast_capacity["out"]), (name, rank)
    assert all(num_differ.values()), num_differ
