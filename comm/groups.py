"""Process groups for one worker, built once from a ParallelConfig and kept in a registry.

Layout: R = world_size ranks; TP groups are contiguous blocks of tp_size ranks, DP groups hold
the ranks with equal tp_rank, and the EP group is the whole world. The registry below is the
only mutable module state in comm/: `init_process_groups` fills it, `get_process_groups` reads
it, `destroy_process_groups` empties it. Nothing here reads environment variables: rank,
address and port arrive as arguments (launch/ owns the environment).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from comm.config import ParallelConfig
from comm.errors import collective_guard

_registry: ProcessGroups | None = None


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's place in the layout and its groups; the EP group is the default (world)."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    ep_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    device: torch.device


def select_backend(config: ParallelConfig) -> str:
    """gloo on CPU or when asked for (e.g. ranks sharing one GPU); NCCL for CUDA otherwise."""
    if config.backend == "gloo" or (config.device == "cpu" and config.backend == "auto"):
        return "gloo"
    if config.device == "cpu":
        raise ValueError("parallel.backend='nccl' needs parallel.device='cuda', got 'cpu'")
    return "nccl"


def tp_group_ranks(world_size: int, tp_size: int) -> list[list[int]]:
    """TP groups: contiguous blocks of tp_size ranks, in block order."""
    return [list(range(start, start + tp_size)) for start in range(0, world_size, tp_size)]


def dp_group_ranks(world_size: int, tp_size: int) -> list[list[int]]:
    """DP groups: ranks with equal tp_rank, in tp_rank order."""
    return [list(range(tp_rank, world_size, tp_size)) for tp_rank in range(tp_size)]


def open_rendezvous(config: ParallelConfig) -> dist.TCPStore:
    """Rank 0's side of the rendezvous, before any rank joins: a store listening on a port the
    OS picks (its .port), for init_process_groups' `store`.

    Why not a port found free and let go until the init binds it: meanwhile another process
    (a second engine's rank 0, any program's socket) could take it, and the start failed with
    EADDRINUSE, or the other ranks joined that other engine's store.
    """
    timeout = timedelta(seconds=config.timeout_s)
    return dist.TCPStore(
        "127.0.0.1", 0, config.world_size, is_master=True, timeout=timeout, wait_for_workers=False
    )


def init_process_groups(
    config: ParallelConfig,
    rank: int,
    master_addr: str,
    master_port: int,
    store: dist.TCPStore | None = None,
) -> ProcessGroups:
    """Join the job's default group over TCP and build the TP/DP groups; fill the registry.

    Every rank of the job must call this once, with the same config, address and port. On
    CUDA the groups' device is the current one (a Ray rank's: its one visible GPU, device 0;
    Worker.init sets none). store: rank 0's open_rendezvous(), listening at master_port
    already; None: rank 0 binds master_port itself (every other rank connects to it). A failure
    after the default group is joined destroys it again, so the call may be retried.
    """
    global _registry
    if _registry is not None:
        raise RuntimeError(f"rank {rank}: process groups are already initialised")
    if not 0 <= rank < config.world_size:
        raise ValueError(f"rank must be in [0, {config.world_size}), got {rank}")
    backend = select_backend(config)
    device = torch.device("cpu")
    if config.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    timeout = timedelta(seconds=config.timeout_s)
    # Collective: every rank joins the rendezvous at master_addr:master_port.
    with collective_guard(rank, "init_process_group"):
        if store is None:  # (a store given to rank 0 listens already)
            is_master = rank == 0
            store = dist.TCPStore(
                master_addr, master_port, config.world_size, is_master, timeout=timeout
            )
        dist.init_process_group(
            backend, store=store, world_size=config.world_size, rank=rank, timeout=timeout
        )
        try:
            tp_group, dp_group = _new_groups(config, rank, backend, timeout)
        except BaseException:
            # Why: a half-built job (default group joined, a later group failed) stayed
            # initialised outside the registry: a retry was refused ("initialize the default
            # process group twice") and destroy_process_groups had nothing to tear down.
            dist.destroy_process_group()
            raise
    _registry = ProcessGroups(
        rank=rank,
        world_size=config.world_size,
        tp_rank=rank % config.tp_size,
        tp_size=config.tp_size,
        dp_rank=rank // config.tp_size,
        dp_size=config.dp_size,
        ep_group=dist.group.WORLD,
        tp_group=tp_group,
        dp_group=dp_group,
        device=device,
    )
    return _registry


def _new_groups(
    config: ParallelConfig, rank: int, backend: str, timeout: timedelta
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (TP group, DP group), after the default group is joined."""
    # Collective: new_group must be called by ALL ranks, for every group, in the same order
    # (TP groups in block order, then DP groups in tp_rank order), even by ranks that are not
    # members; a different order pairs the wrong groups and hangs.
    tp_group = dp_group = None
    for ranks in tp_group_ranks(config.world_size, config.tp_size):
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        tp_group = group if rank in ranks else tp_group
    for ranks in dp_group_ranks(config.world_size, config.tp_size):
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        dp_group = group if rank in ranks else dp_group
    return tp_group, dp_group


def get_process_groups() -> ProcessGroups:
    if _registry is None:
        raise RuntimeError("process groups are not initialised; call init_process_groups first")
    return _registry


def destroy_process_groups() -> None:
    """Tear down every group of this process; a no-op when none were built."""
    global _registry
    if dist.is_initialized():
        dist.destroy_process_group()
    _registry = None
