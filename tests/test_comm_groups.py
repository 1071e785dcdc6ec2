"""Process groups on CPU with gloo: layout arithmetic, registry, and the multi-process harness.

`run_ranks` (used by every tests/test_comm_*.py) starts one process per rank, lines them up on a
barrier so a short group timeout is not eaten by start-up, runs `worker(rank, world_size, port,
*args)` in each and returns the per-rank results (a failure carries the rank's traceback).
Processes come from a forkserver that imported torch once: a clean parent (no threads, no
process group) that forks in milliseconds, where spawning 8 fresh interpreters on CI's 2 cores
costs ~10 s of imports.
"""

from __future__ import annotations

import socket
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from comm import (
    ParallelConfig,
    ProcessGroups,
    destroy_process_groups,
    get_process_groups,
    init_process_groups,
)
from comm.groups import dp_group_ranks, open_rendezvous, select_backend, tp_group_ranks

MASTER_ADDR = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((MASTER_ADDR, 0))
        return sock.getsockname()[1]


def _rank_main(worker, rank, world_size, port, barrier, out_dir, args) -> None:
    torch.set_num_threads(1)  # why: R processes share CI's 2 cores
    try:
        barrier.wait()
        result = {"ok": worker(rank, world_size, port, *args)}
    except BaseException:  # reported to the parent, which fails the test
        result = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def run_ranks(worker, world_size: int, tmp_path: Path, *args, timeout_s: float = 40.0) -> list:
    """Run worker in world_size spawned processes; return [result of rank 0, 1, ...]."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "comm", "moe_kernels", __name__])
    barrier = ctx.Barrier(world_size)
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(worker, rank, world_size, port, barrier, str(tmp_path), args),
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert not hung, f"ranks {hung} still running after {timeout_s} s"
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world_size)]
    errors = [res["error"] for res in results if "error" in res]
    assert not errors, "\n".join(errors)
    return [res["ok"] for res in results]


def gloo_config(world_size: int, tp_size: int = 1, timeout_s: float = 30.0) -> ParallelConfig:
    return ParallelConfig(
        world_size=world_size, tp_size=tp_size, backend="gloo", timeout_s=timeout_s
    )


def backend_config(world_size: int, backend: str) -> ParallelConfig:
    """gloo on CPU, or NCCL with rank r on cuda:r (selected here, before the groups)."""
    if backend == "gloo":
        return gloo_config(world_size)
    return ParallelConfig(world_size=world_size, backend="nccl", device="cuda", timeout_s=60.0)


BACKENDS = [
    pytest.param("gloo", id="gloo"),
    pytest.param(
        "nccl",
        id="nccl",
        marks=[
            pytest.mark.multi_gpu,
            pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
        ],
    ),
]


def test_group_ranks_layout():
    assert tp_group_ranks(8, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dp_group_ranks(8, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert tp_group_ranks(4, 1) == [[0], [1], [2], [3]]
    assert dp_group_ranks(4, 1) == [[0, 1, 2, 3]]


def test_select_backend():
    assert select_backend(ParallelConfig(device="cpu")) == "gloo"
    assert select_backend(ParallelConfig(device="cuda")) == "nccl"
    assert select_backend(ParallelConfig(device="cuda", backend="gloo")) == "gloo"
    assert select_backend(ParallelConfig(device="cuda", backend="nccl")) == "nccl"
    with pytest.raises(ValueError, match="parallel.backend='nccl'"):
        select_backend(ParallelConfig(device="cpu", backend="nccl"))


def test_get_process_groups_before_init_fails():
    with pytest.raises(RuntimeError, match="not initialised"):
        get_process_groups()


def _groups_worker(rank: int, world_size: int, port: int) -> dict:
    groups = init_process_groups(gloo_config(world_size, tp_size=2), rank, MASTER_ADDR, port)
    assert get_process_groups() is groups
    with pytest.raises(RuntimeError, match="already initialised"):
        init_process_groups(gloo_config(world_size, tp_size=2), rank, MASTER_ADDR, port)
    value = torch.tensor([float(rank)])
    tp_sum, dp_sum, ep_sum = value.clone(), value.clone(), value.clone()
    # Collectives: every rank reduces over its TP, then DP, then EP group, in that order.
    dist.all_reduce(tp_sum, group=groups.tp_group)
    dist.all_reduce(dp_sum, group=groups.dp_group)
    dist.all_reduce(ep_sum, group=groups.ep_group)
    result = {
        "groups": {
            name: getattr(groups, name)
            for name in ("rank", "world_size", "tp_rank", "tp_size", "dp_rank", "dp_size")
        },
        "tp_ranks": dist.get_process_group_ranks(groups.tp_group),
        "dp_ranks": dist.get_process_group_ranks(groups.dp_group),
        "sums": (tp_sum.item(), dp_sum.item(), ep_sum.item()),
        "device": groups.device,
    }
    destroy_process_groups()
    result["destroyed"] = not dist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialised"):
        get_process_groups()
    return result


def test_process_groups_tp2_world4(tmp_path):
    results = run_ranks(_groups_worker, 4, tmp_path)
    for rank, res in enumerate(results):
        tp_rank, dp_rank = rank % 2, rank // 2
        assert res["groups"] == {
            "rank": rank, "world_size": 4, "tp_rank": tp_rank, "tp_size": 2,
            "dp_rank": dp_rank, "dp_size": 2,
        }  # fmt: skip
        assert res["tp_ranks"] == [2 * dp_rank, 2 * dp_rank + 1]
        assert res["dp_ranks"] == [tp_rank, tp_rank + 2]
        assert res["sums"] == (4 * dp_rank + 1, 2 + 2 * tp_rank, 6)
        assert res["device"] == torch.device("cpu") and res["destroyed"]


def test_process_groups_is_frozen():
    assert ProcessGroups.__dataclass_params__.frozen


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("world_size", True),
        ("tp_size", True),
        ("max_restarts", False),
        ("allow_multiple_reduction", "false"),
        ("allow_multiple_reduction", 0),
    ],
)
def test_parallel_config_refuses_a_value_of_the_wrong_kind(key, value):
    """A bool is no rank count, and a non-bool is no switch (the string "false" is true to the
    dispatchers): each refused naming the key and the value."""
    with pytest.raises(ValueError, match=rf"parallel\.{key} .*got {value!r}"):
        ParallelConfig(**{key: value})


def _partial_init_worker(rank: int, world_size: int, port: int) -> dict:
    """The second new_group (the DP group) fails: the init raises and leaves nothing behind."""
    real_new_group, made = dist.new_group, []

    def new_group(*args, **kwargs):
        made.append(args)
        if len(made) == 2:
            raise RuntimeError("second group refused")
        return real_new_group(*args, **kwargs)

    config = gloo_config(world_size, timeout_s=5)
    dist.new_group = new_group
    try:
        with pytest.raises(RuntimeError, match="second group refused"):
            init_process_groups(config, rank, MASTER_ADDR, port)
    finally:
        dist.new_group = real_new_group
    result = {"initialised_after_failure": dist.is_initialized(), "groups_tried": len(made)}
    # A retry joins afresh (its own store: the failed one's port may still be held).
    store = open_rendezvous(config)
    groups = init_process_groups(config, rank, MASTER_ADDR, store.port, store=store)
    result["retry_rank"] = groups.rank
    destroy_process_groups()
    return result


def test_a_partial_init_tears_down_what_it_built(tmp_path):
    """The default group joined, the TP group made, the DP group's creation failing: the group
    stayed initialised, so a retry failed ("trying to initialize the default process group
    twice") and the registry never learnt of it to destroy it."""
    result = run_ranks(_partial_init_worker, 1, tmp_path)[0]
    assert result == {"initialised_after_failure": False, "groups_tried": 2, "retry_rank": 0}
