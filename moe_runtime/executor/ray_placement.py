"""Where a Ray executor's ranks go: one bundle a rank (its CPUs, and a GPU or a share of one),
refused at once where GPU sharing cannot work, and the wait for the cluster to place them."""

from __future__ import annotations

import logging

import ray

from comm.groups import select_backend
from moe_runtime.config import RuntimeConfig
from moe_runtime.executor.ray_connect import OWN_CLUSTER_RESOURCE
from moe_runtime.worker.step_input import WorkerError

log = logging.getLogger(__name__)

PLACEMENT_NOTICE_S = 10.0  # a placement wait longer than this is logged


def wait_for_placement(
    group, world_size: int, bundle: dict[str, float], timeout_s: float, bound: str
) -> None:
    """The placement group's bundles (one a rank, each `bundle`) reserved, or WorkerError
    saying what the cluster lacked: a world larger than the cluster waits for room that never
    comes. A wait past PLACEMENT_NOTICE_S is logged with what the cluster has (else the
    start-up said nothing for the whole bound, minutes by default). bound: how timeout_s is
    set, named in the refusal."""
    refuse_what_never_fits(world_size, bundle)
    ready_ref = group.ready()
    ready, _ = ray.wait([ready_ref], timeout=min(PLACEMENT_NOTICE_S, timeout_s))
    if not ready and timeout_s > PLACEMENT_NOTICE_S:
        log.warning(
            "waiting for the Ray cluster to place parallel.world_size=%d ranks of %s each "
            "(up to %.0fs more): it has %s",
            world_size, bundle, timeout_s - PLACEMENT_NOTICE_S, cluster_has(bundle),
        )  # fmt: skip
        ready, _ = ray.wait([ready_ref], timeout=timeout_s - PLACEMENT_NOTICE_S)
    if ready:
        return
    raise WorkerError(
        f"the Ray cluster could not place parallel.world_size={world_size} ranks of "
        f"{bundle} each within {timeout_s:.0f}s ({bound}): it has {cluster_has(bundle)}; the "
        "rest is held by other jobs, or by another engine of this process (an LLM at world "
        "size > 1 holds its ranks until its shutdown())"
    )


def refuse_what_never_fits(world_size: int, bundle: dict[str, float]) -> None:
    """WorkerError at once where the ranks ask for more of a resource, in all, than the local
    cluster connect_ray started (OWN_CLUSTER_RESOURCE) has: one node and no autoscaler, so the
    wait could only run out. Any other cluster may grow (nodes joining, an autoscaler): the
    wait decides there."""
    total = ray.cluster_resources()
    if not total.get(OWN_CLUSTER_RESOURCE):
        return
    asked = {key: world_size * amount for key, amount in bundle.items()}
    short = [key for key, amount in asked.items() if amount > total.get(key, 0) + 1e-9]
    if short:
        raise WorkerError(
            f"parallel.world_size={world_size} ranks of {bundle} each ask for "
            f"{', '.join(f'{asked[key]:g} {key}' for key in short)} in all, and the local Ray "
            f"cluster this process started has "
            f"{', '.join(f'{total.get(key, 0):g} {key}' for key in short)} in all: it never "
            "grows (it was sized for the first engine of the process; call ray.shutdown() "
            "before a larger one, or give it a cluster with room through RAY_ADDRESS)"
        )


def node_address(group, bundle_index: int) -> str:
    """The address Ray reaches the node of a ready placement group's bundle at (its raylet's,
    which every other node of the cluster connects to)."""
    node_id = ray.util.placement_group_table(group)["bundles_to_node_id"][bundle_index]
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node["NodeManagerAddress"]
    raise WorkerError(f"the Ray cluster has no node {node_id} (bundle {bundle_index}'s)")


def cluster_has(bundle: dict[str, float]) -> str:
    """The cluster's total and free amounts of each resource a bundle asks for."""
    total, free = ray.cluster_resources(), ray.available_resources()
    return ", ".join(f"{total.get(k, 0):g} {k} ({free.get(k, 0):g} free)" for k in bundle)


def rank_cpus(config: RuntimeConfig) -> int:
    """The CPUs a rank's bundle asks for. device cpu: kernels.num_threads, the threads its whole
    step runs on, so Ray gives each rank cores of its own (ranks packed one a core ran
    num_threads threads on it, as slow as one; the bits are the same either way: the thread
    count is the rank's, not Ray's). device cuda: 1, the norm for a GPU worker: the GPU runs
    the step and the CPU launches it; num_threads CPUs a rank would not fit ranks sharing one
    GPU (EP=8 at 4 threads on a 16-core GPU machine) for no speed."""
    return config.kernels.num_threads if config.parallel.device == "cpu" else 1


def bundles(device: str, world_size: int, num_cpus: int) -> list[dict[str, float]]:
    """One bundle a rank: num_cpus CPUs (rank_cpus), and its GPU or share of one on CUDA."""
    gpu = gpu_share(device, world_size)
    return [{"CPU": num_cpus, "GPU": gpu} if gpu else {"CPU": num_cpus}] * world_size


def check_gpu_sharing(config: RuntimeConfig) -> None:
    """ValueError where more ranks than the cluster has GPUs (their bundles would share GPUs,
    gpu_share) would fail later: over NCCL, which refuses two ranks of one communicator on one
    GPU ("Duplicate GPU detected") at its first collective, after every rank loaded; or with
    cache.num_blocks 0, where each rank sizes its cache from the memory free on its GPU, which
    the ranks sharing it all count (the later ones run out of memory, or find no block fits)."""
    parallel = config.parallel
    if parallel.device != "cuda" or parallel.world_size == 1:
        return
    num_gpus = cluster_gpus()
    if not 0 < num_gpus < parallel.world_size:
        return
    sharing = f"parallel.world_size={parallel.world_size} ranks share the Ray cluster's {num_gpus}"
    if select_backend(parallel) == "nccl":
        raise ValueError(
            f"{sharing} GPU(s), which NCCL refuses (a GPU each): set parallel.backend: gloo to "
            f"share them (got {parallel.backend!r})"
        )
    if config.cache.is_sized_from_memory:
        raise ValueError(
            f"{sharing} GPU(s), and cache.num_blocks: 0 would size each rank's cache from the "
            "memory free on its GPU, which the ranks sharing it all count: set cache.num_blocks"
        )


def gpu_share(device: str, world_size: int) -> float:
    """One GPU per rank when there are enough; otherwise ranks share them evenly."""
    if device != "cuda":
        return 0
    num_gpus = cluster_gpus()
    if num_gpus == 0:
        raise WorkerError("parallel.device is 'cuda' but the Ray cluster has no GPU")
    if num_gpus >= world_size:
        return 1
    return 1 / -(-world_size // num_gpus)


def cluster_gpus() -> int:
    """The whole GPUs the Ray cluster has (a fractional total rounded down)."""
    return int(ray.cluster_resources().get("GPU", 0))
