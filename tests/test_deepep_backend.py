"""The DeepEP backend (parallel.ep_backend: deepep): config checks, virtual-token bookkeeping,
and the dispatcher against AllToAllDispatcher, bitwise.

CPU: every refusal names its condition; the virtual tokens and the rows' way home; and
DeepEPDispatcher over gloo with a stand-in for deep_ep that follows what DeepEP's source says
(deterministic expand order by (local expert, source rank * max tokens + token), combine adding
each row's single valid slot to +0 in bf16): this checks the dispatcher's own index logic, not
DeepEP. GPU (marked multi_gpu, skipped without 2 GPUs or without deep_ep): the real ElasticBuffer
against AllToAllDispatcher over NCCL at V2-Lite and V3 shapes, the engine at EP=2 with
ep_backend deepep against world size 1, and the engine generating across EPLB rebalances over
DeepEP against EPLB off. The GPU tests have not run yet.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from comm import AllToAllDispatcher, ParallelConfig
from comm.deepep_dispatch import (
    DeepEPDispatcher,
    check_deepep_shapes,
    rows_in_slot_order,
    virtual_tokens,
)
from comm.groups import destroy_process_groups, init_process_groups
from moe_kernels.combine import moe_combine_ref
from moe_runtime import LLM
from moe_runtime.config import load_config
from tests.invariance import mixed_params, mixed_prompts, random_sub_batches, run_in_batches
from tests.test_comm_dispatch import to_device
from tests.test_comm_groups import MASTER_ADDR, backend_config, run_ranks
from tests.test_gpu_golden import ray_on_gpu  # noqa: F401  (a fixture, used by name)

TINY_GPU = Path(__file__).resolve().parent.parent / "launch" / "configs" / "tiny_gpu.yaml"
# tiny_gpu.yaml at EP=2 over NCCL with DeepEP; hidden 256 because DeepEP's combine needs it.
DEEPEP = {
    "parallel.world_size": 2,
    "parallel.backend": "nccl",
    "parallel.ep_backend": "deepep",
    "model.hidden_size": 256,
}


@pytest.fixture
def deepep_installed(monkeypatch):
    monkeypatch.setattr("moe_runtime.config_checks.is_deepep_installed", lambda: True)


def test_ep_backend_value_is_checked():
    with pytest.raises(ValueError, match=r"parallel.ep_backend .*'nvshmem'"):
        ParallelConfig(ep_backend="nvshmem")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"parallel.device": "cpu", "parallel.backend": "auto"}, r"parallel.device 'cuda'"),
        ({"parallel.backend": "gloo"}, r"nccl backend, got parallel.backend 'gloo'"),
        ({"parallel.world_size": 1}, r"parallel.world_size >= 2, got 1"),
        ({"parallel.allow_multiple_reduction": True}, r"allow_multiple_reduction: false"),
        ({"parallel.ep_capacity_dispatch": "on"}, r"ep_capacity_dispatch 'auto' or 'off'"),
        ({"model.dtype": "float32"}, r"model.dtype 'bfloat16'"),
        ({"model.hidden_size": 64}, r"model.hidden_size .* multiple of 256 .*got 64"),
    ],
)
def test_deepep_refusals_name_the_condition(deepep_installed, overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(TINY_GPU, {**DEEPEP, **overrides})


def test_deepep_refused_when_not_installed(monkeypatch):
    monkeypatch.setattr("moe_runtime.config_checks.is_deepep_installed", lambda: False)
    with pytest.raises(ValueError, match="deep_ep package, which is not installed"):
        load_config(TINY_GPU, DEEPEP)


def test_deepep_resolution(deepep_installed):
    config = load_config(TINY_GPU, DEEPEP)
    assert config.uses_deepep and not config.uses_capacity_dispatch
    graphs = load_config(TINY_GPU, {**DEEPEP, "kernels.cuda_graphs": True})
    assert graphs.uses_deepep and not graphs.uses_capacity_dispatch  # MoE layers stay eager
    for backend in ("auto", "all_to_all"):
        config = load_config(TINY_GPU, {**DEEPEP, "parallel.ep_backend": backend})
        assert not config.uses_deepep  # 'auto' keeps all_to_all until the GPU tests pass
    # The rebalance test's layout: redundant slots and EPLB on are accepted with deepep.
    eplb = load_config(TINY_GPU, {**DEEPEP, "eplb.num_redundant_experts": 2, **EPLB_ON})
    assert eplb.uses_deepep and eplb.eplb.enabled


def test_check_deepep_shapes():
    assert check_deepep_shapes(2048, 4096, 6, 8) == 4096 * 6
    with pytest.raises(ValueError, match=r"multiple of 256 .*got 2000"):
        check_deepep_shapes(2000, 4096, 6, 8)
    with pytest.raises(ValueError, match="int32"):
        check_deepep_shapes(2048, 2**28, 8, 8)


def test_virtual_tokens_and_the_way_home():
    x = torch.arange(3 * 4, dtype=torch.float32).view(3, 4)
    ids = torch.tensor([[5, 0], [2, 7], [1, 3]])
    xv, idv = virtual_tokens(x, ids)
    assert idv.shape == (6, 1) and idv.is_contiguous()
    for t in range(3):
        for k in range(2):
            assert torch.equal(xv[t * 2 + k], x[t]) and idv[t * 2 + k, 0] == ids[t, k]
    # DeepEP's combine returns row v = virtual token v's result: the flat (token, slot) order.
    rows, slot_ids = rows_in_slot_order(xv, 6)
    assert torch.equal(rows, xv) and torch.equal(slot_ids, torch.arange(6))


def test_no_tokens_send_one_dummy_row():
    xv, idv = virtual_tokens(torch.zeros(0, 8), torch.zeros(0, 6, dtype=torch.int64))
    assert xv.shape == (1, 8) and idv.tolist() == [[-1]]  # -1: no expert selected
    rows, slot_ids = rows_in_slot_order(xv, 0)
    assert rows.shape == (0, 8) and slot_ids.numel() == 0


class StandInBuffer:
    """deep_ep.ElasticBuffer as DeepEP's source describes it, over gloo with all_gather_object.

    dispatch (expand, deterministic): every rank's rows bound for this rank, sorted by
    (local expert, src_rank * num_max_tokens_per_rank + token) (deep_ep/buffers/elastic.py
    161-192), counts per local expert. combine (no multiple reduction, no weights): each row
    back to its source token's position, added to +0 in bf16 (combine_utils.cuh:212-255).
    is_token_major (the control): within an expert, sort by (token, source rank) instead.
    """

    is_token_major = False

    def __init__(self, group, *, num_max_tokens_per_rank, hidden, num_topk, **flags) -> None:
        assert num_topk == 1 and hidden % 256 == 0
        assert flags["deterministic"] and not flags["allow_multiple_reduction"]
        self.group, self.max_tokens = group, num_max_tokens_per_rank
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def _gather(self, obj) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def dispatch(self, x, *, topk_idx, num_experts, expert_alignment, do_cpu_sync, do_expand):
        assert x.dtype == torch.bfloat16 and topk_idx.shape[1] == 1 and do_expand
        assert 1 <= x.shape[0] <= self.max_tokens  # T = 0 is never sent (untested upstream)
        num_local = num_experts // self.world_size
        keyed = []
        for src, (xs, ids) in enumerate(self._gather((x, topk_idx))):
            for v in range(ids.shape[0]):
                expert = int(ids[v, 0])
                if expert >= 0 and expert // num_local == self.rank:
                    order = v * self.world_size + src if self.is_token_major else None
                    order = src * self.max_tokens + v if order is None else order
                    keyed.append((expert % num_local, order, src, v, xs[v]))
        keyed.sort(key=lambda row: row[:2])
        counts = torch.bincount(
            torch.tensor([r[0] for r in keyed], dtype=torch.int64), minlength=num_local
        )
        recv = torch.stack([r[4] for r in keyed]) if keyed else x.new_zeros(0, x.shape[1])
        handle = types.SimpleNamespace(
            num_unaligned_recv_tokens_per_expert=counts.int(),
            sources=[(r[2], r[3]) for r in keyed],
            num_tokens=x.shape[0],
        )
        return recv, None, None, handle, None

    def combine(self, y, handle):
        assert y.dtype == torch.bfloat16 and y.shape[0] == len(handle.sources)
        out = y.new_zeros(handle.num_tokens, y.shape[1])
        for sources, rows in self._gather((handle.sources, y)):
            for (src, v), row in zip(sources, rows, strict=True):
                if src == self.rank:
                    out[v] = out[v] + row
        return out, None, None

    def destroy(self) -> None:
        pass


class TokenMajorBuffer(StandInBuffer):
    is_token_major = True


# (hidden, local slots per rank, top-k): the CPU case, then DeepSeek-V2-Lite and V3 at EP=2.
SMALL = (256, 3, 4)
GPU_SHAPES = {"v2_lite": (2048, 32, 6), "v3": (7168, 128, 8)}
MAX_TOKENS = 64  # the buffer's tokens per rank (the scheduler's budget in the engine)


def _routing(rank: int, world_size: int, shape: tuple, is_rank1_idle: bool, device) -> tuple:
    """Uneven token counts (rank 1 none when is_rank1_idle), distinct slots per token."""
    hidden, num_local_slots, top_k = shape
    gen = torch.Generator().manual_seed(10 + rank + 100 * is_rank1_idle)
    num_tokens = 0 if rank == 1 and is_rank1_idle else 2 + 3 * rank
    num_physical = world_size * num_local_slots
    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
    rows = [torch.randperm(num_physical, generator=gen)[:top_k] for _ in range(num_tokens)]
    ids = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return to_device([x, ids, weights], device)


def _expert(recv_x: torch.Tensor, group_sizes: torch.Tensor, rank: int) -> torch.Tensor:
    """A per-row stand-in for the grouped GEMM: each row scaled by its physical slot's id + 1."""
    num_local_slots = group_sizes.numel()
    local = torch.arange(num_local_slots, device=recv_x.device)
    slot = local.repeat_interleave(group_sizes) + rank * num_local_slots
    return (recv_x.float() * (slot[:, None] + 1)).bfloat16()


def _compare_worker(rank: int, world_size: int, port: int, backend: str, shape: tuple) -> dict:
    config = backend_config(world_size, backend)
    if config.device == "cuda":
        torch.cuda.set_device(rank)
    else:
        sys.modules["deep_ep"] = types.SimpleNamespace(
            ElasticBuffer=StandInBuffer, topk_idx_t=torch.int64
        )
    groups = init_process_groups(config, rank, MASTER_ADDR, port)
    group, device = groups.ep_group, groups.device
    hidden, num_local_slots, top_k = shape
    all_to_all = AllToAllDispatcher(
        group, rank, world_size, num_local_slots, False, device, moe_combine_ref
    )
    args = (group, rank, world_size, num_local_slots, hidden, MAX_TOKENS, top_k, device)
    # Collective: every rank builds DeepEP's buffer together.
    deepep = DeepEPDispatcher(*args, moe_combine_ref, 60)
    dispatchers = [("all_to_all", all_to_all), ("deepep", deepep)]
    if config.device == "cpu":
        sys.modules["deep_ep"] = types.SimpleNamespace(
            ElasticBuffer=TokenMajorBuffer, topk_idx_t=torch.int64
        )
        dispatchers.append(("token_major", DeepEPDispatcher(*args, moe_combine_ref, 60)))
    result = {}
    # Collectives: every rank runs the dispatchers in the same order, first with rank 1 idle.
    for is_rank1_idle in (True, False):
        x, ids, weights = _routing(rank, world_size, shape, is_rank1_idle, device)
        for name, dispatcher in dispatchers:
            before = dispatcher.num_rows_sent_remote
            recv_x, group_sizes, handle = dispatcher.dispatch(x, ids, weights)
            out = dispatcher.combine(_expert(recv_x, group_sizes, rank), handle, weights)
            result[name, is_rank1_idle] = {
                "recv_x": recv_x,
                "group_sizes": group_sizes,
                "out": out,
                "sent_remote": dispatcher.num_rows_sent_remote - before,
            }
    for _, dispatcher in dispatchers[1:]:
        dispatcher.close()  # collective: DeepEP's destroy starts with a barrier
    destroy_process_groups()
    return to_device(result, torch.device("cpu"))


def _check_equal(results: list[dict], hidden: int) -> None:
    for rank, res in enumerate(results):
        for is_rank1_idle in (True, False):
            ref, got = res["all_to_all", is_rank1_idle], res["deepep", is_rank1_idle]
            for key in ("recv_x", "group_sizes", "out"):
                assert torch.equal(got[key], ref[key]), (rank, is_rank1_idle, key)
            assert got["sent_remote"] == ref["sent_remote"], (rank, is_rank1_idle)
    assert results[1]["deepep", True]["out"].shape == (0, hidden)  # the idle rank joined
    assert all(res["deepep", False]["sent_remote"] > 0 for res in results)


@pytest.mark.parametrize("world_size", [2, 3])
def test_deepep_dispatcher_equals_all_to_all_with_stand_in(tmp_path, world_size):
    results = run_ranks(_compare_worker, world_size, tmp_path, "gloo", SMALL)
    _check_equal(results, SMALL[0])
    # Control: a receive order other than (local slot, source rank, token) is seen.
    assert any(
        not torch.equal(res["token_major", False]["recv_x"], res["all_to_all", False]["recv_x"])
        for res in results
    )


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_deepep_equals_all_to_all_nccl(tmp_path, shape):
    pytest.importorskip("deep_ep")
    # DeepEP compiles its kernels on first use (nvcc): a generous bound.
    results = run_ranks(_compare_worker, 2, tmp_path, "nccl", GPU_SHAPES[shape], timeout_s=600.0)
    _check_equal(results, GPU_SHAPES[shape][0])


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.usefixtures("ray_on_gpu")
@pytest.mark.parametrize("mode", ["invariant", "fast"])
def test_deepep_engine_ep2_equals_world_size_1(mode):
    """Invariant: EP=2 over DeepEP, batched and shuffled, equals world size 1 alone. Control:
    fast mode (arrival-order sums, batch-shaped GEMMs) gives some other bits."""
    pytest.importorskip("deep_ep")
    prompts, params = mixed_prompts(16, 8, 300, seed=11), mixed_params(16, 16)
    shared = {"model.hidden_size": 256, "cache.enable_prefix_caching": False, "kernels.mode": mode}
    alone = LLM(TINY_GPU, **shared)
    try:
        reference = run_in_batches(alone, prompts, params, [[i] for i in range(16)])
    finally:
        alone.shutdown()
    llm = LLM(TINY_GPU, **{**shared, **DEEPEP, "parallel.timeout_s": 300})
    try:
        together = run_in_batches(llm, prompts, params, [list(range(16))])
        shuffled = run_in_batches(llm, prompts, params, random_sub_batches(16, seed=5))
        stats = llm.engine.worker_stats()
    finally:
        llm.shutdown()
    assert [s["ep_dispatcher"] for s in stats] == ["DeepEPDispatcher"] * 2
    assert all(s["num_rows_sent_remote"] > 0 for s in stats), "no rows crossed the GPUs"
    if mode == "fast":
        assert any(together[i] != reference[i] or shuffled[i] != together[i] for i in range(16)), (
            "fast mode gave the world-size-1 bits over DeepEP: the golden test could not fail"
        )
        return
    for i in range(16):
        assert together[i] == reference[i], f"prompt {i}: EP=2 DeepEP batched differs"
        assert shuffled[i] == reference[i], f"prompt {i}: EP=2 DeepEP shuffled differs"


# A rebalance every 4 steps, never skipped (as tests/test_eplb_live.py).
EPLB_ON = {
    "eplb.enabled": True,
    "eplb.interval_steps": 4,
    "eplb.window_steps": 4,
    "eplb.balancedness_threshold": 1.0,
}


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.usefixtures("ray_on_gpu")
def test_deepep_engine_rebalance_mid_generation_changes_nothing():
    """EP=2 over DeepEP with two redundant expert slots, generating across several rebalances,
    gives EPLB off's bits; engagement: rebalances ran and experts moved between the GPUs. The
    control (multiple reduction plus a rebalance changes bits) cannot run on this backend:
    deepep is refused with multiple reduction (it moves rows only; the runtime's combine sums
    them), so it is the all_to_all backend's, tests/test_eplb_live.py."""
    pytest.importorskip("deep_ep")
    prompts, params = mixed_prompts(16, 8, 120, seed=31), mixed_params(16, 24)
    base = {
        **DEEPEP,
        "cache.enable_prefix_caching": False,
        "eplb.num_redundant_experts": 2,
        "parallel.timeout_s": 300,
    }

    def run(**overrides) -> tuple[dict, list[dict], list[dict]]:
        llm = LLM(TINY_GPU, **base, **overrides)
        try:
            got = run_in_batches(llm, prompts, params, [list(range(16))])
            return got, list(llm.engine.balancer.history), llm.engine.worker_stats()
        finally:
            llm.shutdown()

    reference, _, _ = run()
    got, history, stats = run(**EPLB_ON)
    assert [s["ep_dispatcher"] for s in stats] == ["DeepEPDispatcher"] * 2
    moves = [r for r in history if not r["skipped"]]
    assert len(moves) >= 2, f"only {len(moves)} rebalances ran"
    assert sum(r["experts_moved"] for r in moves) > 0, "no expert moved"
    assert sum(r["bytes_moved"] for r in moves) > 0, "no expert weights crossed the GPUs"
    assert got == reference


def _over_budget_worker(rank: int, world_size: int, port: int) -> str:
    sys.modules["deep_ep"] = types.SimpleNamespace(
        ElasticBuffer=StandInBuffer, topk_idx_t=torch.int64
    )
    groups = init_process_groups(backend_config(world_size, "gloo"), rank, MASTER_ADDR, port)
    hidden, num_local_slots, top_k = SMALL
    dispatcher = DeepEPDispatcher(
        groups.ep_group, rank, world_size, num_local_slots, hidden, 4, top_k, "cpu",
        moe_combine_ref, 5,
    )  # fmt: skip
    ids = torch.zeros(6, top_k, dtype=torch.int64)  # 6 tokens, past the buffer's 4
    with pytest.raises(ValueError) as refusal:
        dispatcher.dispatch(torch.zeros(6, hidden).bfloat16(), ids, torch.ones(6, top_k))
    dispatcher.close()
    return str(refusal.value)


def test_a_dispatch_past_the_buffer_names_the_rank(tmp_path):
    """A rank's own token count, over the buffer's bound, is refused by that rank alone (DeepEP's
    dispatch is one call: no agreement of the ranks' counts to carry the refusal), and its peers
    wait out timeout_s in DeepEP's dispatch: the refusal names its rank, so the peers' timeout
    can be traced to it."""
    message = run_ranks(_over_budget_worker, 1, tmp_path)[0]
    assert message.startswith("rank 0: 6 tokens exceed the DeepEP buffer's"), message
