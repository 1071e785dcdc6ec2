"""A collective whose peer never shows up fails with CollectiveError naming the rank and the
op, in time: AllToAllDispatcher's and FixedCapacityDispatcher's eager dispatch alike."""

from __future__ import annotations

import time

import pytest
import torch

from comm import (
    AllToAllDispatcher,
    CollectiveError,
    FixedCapacityDispatcher,
    all_reduce,
    init_process_groups,
)
from comm.errors import collective_guard
from moe_kernels.combine import moe_combine_ref, sum_over_ranks_ref
from tests.test_comm_groups import MASTER_ADDR, gloo_config, run_ranks

TIMEOUT_S = 3.0
# Dispatcher -> the op its dispatch runs first, which a peer that never dispatches leaves
# waiting: the capacity one first agrees the block size (eager, as on CPU).
FIRST_OPS = {
    AllToAllDispatcher: "dispatch counts all_to_all",
    FixedCapacityDispatcher: "dispatch token count all_reduce",
}


def _absent_peer_worker(rank: int, world_size: int, port: int, dispatcher_cls: type) -> dict:
    groups = init_process_groups(
        gloo_config(world_size, timeout_s=TIMEOUT_S), rank, MASTER_ADDR, port
    )
    if rank == 1:
        # The peer that never shows up: alive, connected, but never joins the collective.
        time.sleep(TIMEOUT_S + 1.5)
        return {}
    dispatcher = dispatcher_cls(groups.ep_group, rank, world_size, 2, False, "cpu", moe_combine_ref)
    start = time.monotonic()
    try:
        dispatcher.dispatch(torch.zeros(1, 4), torch.tensor([[3]]), torch.ones(1, 1))
    except CollectiveError as error:
        return {"error": str(error), "elapsed": time.monotonic() - start}
    return {"error": None}


@pytest.mark.parametrize("dispatcher_cls", list(FIRST_OPS), ids=lambda cls: cls.__name__)
def test_absent_peer_raises_collective_error_within_timeout(tmp_path, dispatcher_cls):
    result = run_ranks(_absent_peer_worker, 2, tmp_path, dispatcher_cls)[0]
    assert result["error"] is not None, "dispatch returned although rank 1 never joined"
    # The error names the rank and the dispatch's own collective (the capacity dispatcher's
    # used to say "graph step all_reduce" for an eager dispatch: the graph runner's call).
    assert result["error"].startswith(f"rank 0: {FIRST_OPS[dispatcher_cls]} failed:")
    if dispatcher_cls is AllToAllDispatcher:
        # It was the group timeout that fired, not a closed connection, and it fired in time.
        assert TIMEOUT_S - 0.5 < result["elapsed"] < TIMEOUT_S + 1.5


def test_collective_guard_wraps_runtime_errors_only():
    with pytest.raises(CollectiveError) as caught:
        with collective_guard(3, "combine all_to_all"):
            raise RuntimeError("Connection closed by peer")
    assert str(caught.value) == "rank 3: combine all_to_all failed: Connection closed by peer"
    assert isinstance(caught.value.__cause__, RuntimeError)
    # Any other error passes through as it is: neither wrapped nor swallowed.
    with pytest.raises(ValueError, match="^bad split$"):
        with collective_guard(0, "x"):
            raise ValueError("bad split")
    with pytest.raises(TypeError, match="^not a tensor$"):
        with collective_guard(0, "x"):
            raise TypeError("not a tensor")


def test_pinned_all_reduce_world1_is_identity(tmp_path):
    results = run_ranks(_world1_worker, 1, tmp_path)
    assert torch.equal(results[0], torch.arange(4.0))


def _world1_worker(rank: int, world_size: int, port: int) -> torch.Tensor:
    groups = init_process_groups(gloo_config(world_size), rank, MASTER_ADDR, port)
    return all_reduce(torch.arange(4.0), groups.ep_group, sum_over_ranks_ref)


def _one_rank_refuses_worker(rank: int, world_size: int, port: int, dispatcher_cls: type) -> dict:
    groups = init_process_groups(
        gloo_config(world_size, timeout_s=TIMEOUT_S), rank, MASTER_ADDR, port
    )
    dispatcher = dispatcher_cls(groups.ep_group, rank, world_size, 2, False, "cpu", moe_combine_ref)
    x, weights = torch.ones(1, 4), torch.ones(1, 1)
    bad_ids = torch.tensor([[4 if rank == 1 else 3]])  # rank 1's: past the 4 physical slots
    start = time.monotonic()
    try:
        dispatcher.dispatch(x, bad_ids, weights)
        result = {"error": None}
    except Exception as error:
        result = {"type": type(error).__name__, "error": str(error)}
    result["elapsed"] = time.monotonic() - start
    # The ranks are still in step: the next dispatch and combine run on both.
    recv, _, handle = dispatcher.dispatch(x, torch.tensor([[3 - rank]]), weights)
    result["out"] = dispatcher.combine(recv, handle, weights)
    return result


@pytest.mark.parametrize("dispatcher_cls", list(FIRST_OPS), ids=lambda cls: cls.__name__)
def test_a_rank_refusing_its_dispatch_arguments_fails_every_rank_at_once(tmp_path, dispatcher_cls):
    """Rank 1's expert ids are out of range: it raised its ValueError alone, before the
    dispatch's first collective, and rank 0 waited there for the whole timeout_s to fail with a
    CollectiveError that named no cause. The refusal now travels in that first collective (the
    counts, or the capacity's token count): both ranks raise a ValueError at once, rank 0's
    (a PeerRefusedError) naming rank 1, and the ranks stay in step."""
    results = run_ranks(_one_rank_refuses_worker, 2, tmp_path, dispatcher_cls)
    assert results[1]["type"] == "ValueError", results[1]
    assert "must lie in [0, 4), got 4..4" in results[1]["error"], results[1]
    assert results[0]["type"] == "PeerRefusedError", results[0]  # a ValueError naming rank 1
    assert "rank 1 refused its dispatch arguments" in results[0]["error"], results[0]
    assert max(result["elapsed"] for result in results) < TIMEOUT_S / 2, results
    assert all(torch.equal(result["out"], torch.ones(1, 4)) for result in results), results
