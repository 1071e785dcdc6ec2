"""FixedCapacityDispatcher over gloo at 2 and 4 ranks, bitwise against AllToAllDispatcher.

Both dispatchers run the same calls in one process group: random routing with a rank holding
no tokens (tests/test_comm_dispatch.py's case, at three placements), every row to one expert
on the last rank, every row to another rank's experts, every rank sending, no rank sending.
Received rows, group sizes, combine output and the remote-row count must be equal, and the
graph runner's slot counts summed over ranks equal the group sizes. Controls: the capacity
path with the fast combine (index_add_ in arrival order) moves bits with the placement, and
rows left in receive-buffer order (not regrouped by expert) change the output.
"""

from __future__ import annotations

import pytest
import torch

from comm import AllToAllDispatcher, FixedCapacityDispatcher
from comm.groups import destroy_process_groups, init_process_groups
from moe_kernels.combine import moe_combine_fast, moe_combine_ref
from moe_kernels.linear import grouped_linear_ref
from tests.test_comm_dispatch import (
    HIDDEN,
    NUM_LOCAL_SLOTS,
    SHIFTS,
    TILE_ROWS,
    TOP_K,
    make_case,
    shifted_placement,
    to_device,
)
from tests.test_comm_groups import BACKENDS, MASTER_ADDR, backend_config, run_ranks


def routings(case: dict, rank: int, world_size: int) -> dict:
    """Name -> (x, physical ids, weights, expert weights [P, D, D]) of this rank."""
    x, weights = case["x"][rank], case["weights"][rank]
    out = {}
    for shift in SHIFTS:
        ids, expert_weight = shifted_placement(case, shift)
        out["random", shift] = (x, ids[rank], weights, expert_weight)
    # Skew: every row of every rank to the last rank's first slot (one block holds them all).
    last = torch.full_like(case["ids"][rank], (world_size - 1) * NUM_LOCAL_SLOTS)
    out["one_expert"] = (x, last, weights, case["expert_weight"])
    # Every row leaves its rank: slots of the next rank only.
    first = (rank + 1) % world_size * NUM_LOCAL_SLOTS
    remote = first + torch.arange(x.shape[0] * TOP_K).view(-1, TOP_K) % NUM_LOCAL_SLOTS
    out["all_remote"] = (x, remote.to(x.device), weights, case["expert_weight"])
    # Every rank sends (the case above leaves rank 1 empty): a receiver gets several sources.
    gen = torch.Generator().manual_seed(100 + rank)
    num_physical = world_size * NUM_LOCAL_SLOTS
    ids = torch.stack([torch.randperm(num_physical, generator=gen)[:TOP_K] for _ in range(6)])
    every = (torch.randn(6, HIDDEN, generator=gen), ids, torch.rand(6, TOP_K, generator=gen))
    out["every_rank_sends"] = (*to_device(list(every), x.device), case["expert_weight"])
    out["no_rank_sends"] = (x[:0], ids[:0], weights[:0], case["expert_weight"])
    return out


def _exchange(dispatcher, x, ids, weights, expert_weight, rank) -> dict:
    local = expert_weight[rank * NUM_LOCAL_SLOTS : (rank + 1) * NUM_LOCAL_SLOTS]
    before = dispatcher.num_rows_sent_remote
    before_eager = getattr(dispatcher, "num_eager_rows_sent_remote", 0)
    recv_x, group_sizes, handle = dispatcher.dispatch(x, ids, weights)
    # On CUDA the capacity dispatcher returns every row of its padded blocks and the grouped
    # GEMM stops at the group sizes' sum, leaving the padding rows' results unspecified: the
    # reference GEMM takes the real rows, NaN stands in for the rest (combine must not read it).
    num_real = int(group_sizes.sum())
    y = grouped_linear_ref(recv_x[:num_real], local, group_sizes, tile_rows=TILE_ROWS)
    y = torch.cat([y, y.new_full((recv_x.shape[0] - num_real, y.shape[1]), float("nan"))])
    out = dispatcher.combine(y, handle, weights)
    return {
        "recv_x": recv_x,
        "group_sizes": group_sizes,
        "out": out,
        "sent_remote": dispatcher.num_rows_sent_remote - before,
        "handle": type(handle).__name__,
        "sent_eager": getattr(dispatcher, "num_eager_rows_sent_remote", 0) - before_eager,
    }


class SourceOrderDispatcher(FixedCapacityDispatcher):
    """Control: real rows left in receive-buffer order (source rank first, not regrouped by
    local slot), padding last; the group sizes then cut rows of one expert into another."""

    def _expert_order(self, recv_counts: torch.Tensor, capacity: int) -> torch.Tensor:
        r = recv_counts.shape[0]
        within = torch.arange(capacity, device=recv_counts.device).expand(r, capacity)
        is_padding = within >= recv_counts.sum(1, keepdim=True)
        buffer_index = torch.arange(r * capacity, device=within.device)
        keys = is_padding.reshape(-1) * (r * capacity) + buffer_index
        return torch.sort(keys, stable=True).indices


class CudaShapedDispatcher(FixedCapacityDispatcher):
    """FixedCapacityDispatcher returning what its CUDA path returns on the CPU too: all R*C rows
    of the padded blocks (real rows first, zero padding rows after), not the real rows only."""

    def dispatch(self, x, topk_phys_ids, topk_weights, layout=None):
        rows, group_sizes, handle = super().dispatch(x, topk_phys_ids, topk_weights, layout)
        padding = rows.new_zeros(handle.recv_order.numel() - rows.shape[0], rows.shape[1])
        return torch.cat([rows, padding]), group_sizes, handle


def _fixed_capacity_worker(rank: int, world_size: int, port: int, backend: str) -> dict:
    config = backend_config(world_size, backend)
    if config.device == "cuda":
        torch.cuda.set_device(rank)
    groups = init_process_groups(config, rank, MASTER_ADDR, port)
    case = to_device(make_case(world_size), groups.device)
    args = (groups.ep_group, rank, world_size, NUM_LOCAL_SLOTS, False, groups.device)
    # A graph-running worker's eager step: the uneven exchange inside the capacity dispatcher.
    eager = FixedCapacityDispatcher(*args, moe_combine_ref)
    eager.begin_step(is_graph_step=False)
    dispatchers = {
        "all_to_all": AllToAllDispatcher(*args, moe_combine_ref),
        "capacity": FixedCapacityDispatcher(*args, moe_combine_ref),
        "capacity_fast": FixedCapacityDispatcher(*args, moe_combine_fast),
        "capacity_eager_step": eager,
        "capacity_cuda_shaped": CudaShapedDispatcher(*args, moe_combine_ref),
    }
    result = {}
    # Collectives: every rank runs the same calls in the same order, rank 1 with 0 tokens.
    for name, (x, ids, weights, expert_weight) in routings(case, rank, world_size).items():
        for kind, dispatcher in dispatchers.items():
            result[kind, name] = _exchange(dispatcher, x, ids, weights, expert_weight, rank)
    # The graph runner's slot counts: every rank's rows per local slot, two layers at once.
    cases = routings(case, rank, world_size)
    ids = torch.stack([cases["random", shift][1].reshape(-1) for shift in SHIFTS[:2]])
    result["served"] = dispatchers["capacity"].count_served_rows(ids)
    # The graph runner's step agreement: the most rows and the widest block table of any
    # rank, or (-1, -1) (every rank eager) when one rank is not ready.
    capacity = dispatchers["capacity"]
    result["agreed"] = capacity.agree_graph_step(3 + rank, 16 << rank, True)
    result["agreed_not_ready"] = capacity.agree_graph_step(5, 16, rank != 1)
    # Control: the rows of each source rank left together instead of regrouped by expert.
    unsorted = SourceOrderDispatcher(*args, moe_combine_ref)
    x, ids, weights, expert_weight = routings(case, rank, world_size)["every_rank_sends"]
    result["unsorted"] = _exchange(unsorted, x, ids, weights, expert_weight, rank)
    destroy_process_groups()
    return to_device(result, torch.device("cpu"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_fixed_capacity_equals_all_to_all_bitwise(tmp_path, world_size, backend):
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA devices")
    results = run_ranks(_fixed_capacity_worker, world_size, tmp_path, backend)
    names = [key[1] for key in results[0] if key[0] == "all_to_all"]
    num_fast_differ = num_unsorted_differ = num_padded = 0
    for rank, res in enumerate(results):
        for name in names:
            ref, got = res["all_to_all", name], res["capacity", name]
            num_real = int(ref["group_sizes"].sum())
            assert torch.equal(got["group_sizes"], ref["group_sizes"]), (rank, name)
            # On the GPU the padding rows follow the real ones; CPU returns the real rows only.
            assert torch.equal(got["recv_x"][:num_real], ref["recv_x"]), (rank, name)
            assert not got["recv_x"][num_real:].any()
            assert torch.equal(got["out"], ref["out"]), (rank, name)
            # Engagement: the same rows crossed ranks, counted alike, without a host int.
            assert got["sent_remote"] == ref["sent_remote"], (rank, name)
            # The CUDA path's shapes: padding rows after the real ones, their results unread.
            shaped = res["capacity_cuda_shaped", name]
            num_padded += shaped["recv_x"].shape[0] > num_real
            assert torch.equal(shaped["recv_x"][:num_real], ref["recv_x"]), (rank, name)
            assert torch.equal(shaped["out"], ref["out"]), (rank, name)
            fast = res["capacity_fast", name]["out"]
            torch.testing.assert_close(fast, ref["out"])
            # An eager step of a graph-running worker: AllToAllDispatcher's exchange ran (its
            # handle, no padding rows), the same rows and sums, the same remote count.
            eager = res["capacity_eager_step", name]
            assert (got["handle"], eager["handle"]) == ("CapacityHandle", "DispatchHandle")
            for key in ("recv_x", "group_sizes", "out"):
                assert torch.equal(eager[key], ref[key]), (rank, name, key)
            assert eager["sent_remote"] == ref["sent_remote"], (rank, name)
            assert eager["sent_eager"] == eager["sent_remote"] and got["sent_eager"] == 0
        for shift in SHIFTS[1:]:
            a, b = res["capacity_fast", ("random", 0)], res["capacity_fast", ("random", shift)]
            num_fast_differ += int((a["out"] != b["out"]).any(dim=1).sum())
        assert res["agreed"] == (2 + world_size, 16 << (world_size - 1)), res["agreed"]
        assert res["agreed_not_ready"] == (-1, -1)
        served = [res["all_to_all", ("random", shift)]["group_sizes"] for shift in SHIFTS[:2]]
        assert torch.equal(res["served"], torch.stack(served))
        unsorted, ref = res["unsorted"]["out"], res["all_to_all", "every_rank_sends"]["out"]
        num_unsorted_differ += int((unsorted != ref).any(dim=1).sum())
    for name in ("one_expert", "all_remote", ("random", 0)):
        assert sum(res["all_to_all", name]["sent_remote"] for res in results) > 0, name
    # Every row of "all_remote" left its rank, in dispatch and again in combine.
    sent = sum(res["all_to_all", "all_remote"]["sent_remote"] for res in results)
    assert sent == 2 * TOP_K * sum(len(x) for x in make_case(world_size)["x"])
    assert num_padded > 0  # engagement: some CUDA-shaped dispatch had padding rows
    # Negative controls: arrival-order sums move with the placement; unsorted rows differ.
    assert num_fast_differ > 0 and num_unsorted_differ > 0, (num_fast_differ, num_unsorted_differ)


def test_fixed_capacity_refuses_multiple_reduction():
    with pytest.raises(ValueError, match="allow_multiple_reduction=True is not supported"):
        FixedCapacityDispatcher(None, 0, 2, NUM_LOCAL_SLOTS, True, "cpu", moe_combine_ref)
