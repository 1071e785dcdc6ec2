"""The DeepEP backend (parallel.ep_backend: deepep): config checks, virtual-token bookkeeping,
and the dispatcher against AllToAllDispatcher, bitwise.

CPU: every refusal names its condition; the virtual tokens and the rows' way home; and
DeepEPDispatcher over gloo with a stand-in for deep_ep that follows what DeepEP's source says
(deterministic expand order by (local expert, source rank * max tokens + token), combine adding
each row's single valid slot to +0 in bf16): this checks the dispatcher's own index logic, not
DeepEP. GPU (marked multi_gpu, skipped without 2 GPUs or without deep_ep): the real ElasticBuffer
against AllToAllDispatcher over NCCL at V2-Lite and V3 shapes, and the engine at EP=2 with
ep_backend deepep against world size 1. The GPU tests have not run yet.
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
from kernels.combine import moe_combine_ref
from moe_runtime.config import load_config
from tests.test_comm_dispatch import to_device
from tests.test_comm_groups import MASTER_ADDR, backend_config, run_ranks

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
    monkeypatch.setattr("moe_runtime.config.is_deepep_installed", lambda: True)


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
    monkeypatch.setattr("moe_runtime.config.is_deepep_installed", lambda: False)
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


HIDDEN, NUM_LOCAL_SLOTS, TOP_K = 256, 3, 4


def _routing(rank: int, world_size: int, device) -> tuple:
    """Rank 1 holds no tokens; the others uneven counts, distinct slots per token."""
    gen = torch.Generator().manual_seed(10 + rank)
    num_tokens = 0 if rank == 1 else 2 + 3 * rank
    num_physical = world_size * NUM_LOCAL_SLOTS
    x = torch.randn(num_tokens, HIDDEN, generator=gen).bfloat16()
    rows = [torch.randperm(num_physical, generator=gen)[:TOP_K] for _ in range(num_tokens)]
    ids = torch.stack(rows) if rows else torch.zeros(0, TOP_K, dtype=torch.int64)
    weights = torch.rand(num_tokens, TOP_K, generator=gen)
    return to_device([x, ids, weights], device)


def _expert(recv_x: torch.Tensor, group_sizes: torch.Tensor, rank: int) -> torch.Tensor:
    """A per-row stand-in for the grouped GEMM: each row scaled by its physical slot's id + 1."""
    local = torch.arange(NUM_LOCAL_SLOTS, device=recv_x.device)
    slot = local.repeat_interleave(group_sizes) + rank * NUM_LOCAL_SLOTS
    return (recv_x.float() * (slot[:, None] + 1)).bfloat16()


def _compare_worker(rank: int, world_size: int, port: int, backend: str) -> dict:
    config = backend_config(world_size, backend)
    if config.device == "cuda":
        torch.cuda.set_device(rank)
    else:
        sys.modules["deep_ep"] = types.SimpleNamespace(ElasticBuffer=StandInBuffer)
    groups = init_process_groups(config, rank, MASTER_ADDR, port)
    group, device = groups.ep_group, groups.device
    x, ids, weights = _routing(rank, world_size, device)
    all_to_all = AllToAllDispatcher(
        group, rank, world_size, NUM_LOCAL_SLOTS, False, device, moe_combine_ref
    )
    args = (group, rank, world_size, NUM_LOCAL_SLOTS, HIDDEN, 16, TOP_K, device)
    deepep = DeepEPDispatcher(*args, moe_combine_ref, 30)
    dispatchers = [("all_to_all", all_to_all), ("deepep", deepep)]
    if config.device == "cpu":
        sys.modules["deep_ep"] = types.SimpleNamespace(ElasticBuffer=TokenMajorBuffer)
        dispatchers.append(("token_major", DeepEPDispatcher(*args, moe_combine_ref, 30)))
    result = {}
    # Collectives: every rank runs the dispatchers in the same order, rank 1 with no tokens.
    for name, dispatcher in dispatchers:
        recv_x, group_sizes, handle = dispatcher.dispatch(x, ids, weights)
        out = dispatcher.combine(_expert(recv_x, group_sizes, rank), handle, weights)
        result[name] = {
            "recv_x": recv_x,
            "group_sizes": group_sizes,
            "out": out,
            "sent_remote": dispatcher.num_rows_sent_remote,
        }
    deepep.close()
    destroy_process_groups()
    return to_device(result, torch.device("cpu"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_deepep_dispatcher_equals_all_to_all_with_stand_in(tmp_path, world_size):
    results = run_ranks(_compare_worker, world_size, tmp_path, "gloo")
    for rank, res in enumerate(results):
        ref, got = res["all_to_all"], res["deepep"]
        for key in ("recv_x", "group_sizes", "out"):
            assert torch.equal(got[key], ref[key]), (rank, key)
        assert got["sent_remote"] == ref["sent_remote"], rank
    assert sum(res["deepep"]["sent_remote"] for res in results) > 0
    # Control: a receive order other than (local slot, source rank, token) is seen (at world
    # size 2 only rank 0 sends, so one source leaves no other order).
    assert world_size == 2 or any(
        not torch.equal(res["token_major"]["recv_x"], res["all_to_all"]["recv_x"])
        for res in results
    )
    assert results[1]["deepep"]["out"].shape == (0, HIDDEN)
