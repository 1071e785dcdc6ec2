"""The Ray executor's failures: freed, bounded and readable.

- A worker group that fails to start frees what it took: its placement group and its workers.
  A rebuild after a fault starts a new group; when that start failed (a second fault, a rank
  that cannot load), its bundles and live workers stayed, so on a cluster sized to the world
  every later rebuild waited for them and failed, and the server gave up. Here a group whose
  ranks cannot read their weights (a damaged safetensors file: the driver reads only
  config.json) fails in its init; afterwards its placement group is removed (which ends the
  workers placed in it; shutdown also kills them).
- A rank stalled while the engine is idle is found by the idle check's ping within
  QUICK_CALL_TIMEOUT_S, not after the collective timeout plus its margin.
- A worker's exception reaches the client as its type and first line: no terminal colours, no
  Ray traceback, pids or ids (those go to the log).
- Bad input every rank refuses is raised once every rank has answered, each answer read.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import signal
import time
from types import SimpleNamespace

import pytest

from moe_runtime import SamplingParams
from moe_runtime.config import load_config
from moe_runtime.executor import QUICK_CALL_TIMEOUT_S, WorkerError, create_executor
from tests.serving import write_checkpoint

pytest.importorskip("transformers")


def _held_groups(ray) -> set[str]:
    return {
        group_id
        for group_id, info in ray.util.placement_group_table().items()
        if info["state"] != "REMOVED"
    }


def test_a_group_that_fails_to_start_frees_its_placement_group(ray_local, tmp_path):
    """The group's bundles go back (its workers go down with them, Ray's rule for a removed
    placement group)."""
    import ray

    path = write_checkpoint(tmp_path / "ckpt", seed=1)
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    config = load_config(
        {
            "model": {"path": path},
            "scheduler": {"max_model_len": 256},
            "parallel": {"world_size": 2, "timeout_s": 5},
        }
    )
    groups_before = _held_groups(ray)
    known_before = set(ray.util.placement_group_table())
    p2l = [list(range(config.model.n_routed_experts))] * 2  # unused: init fails first
    with pytest.raises(ValueError, match="not valid safetensors"):
        create_executor(config, p2l)
    deadline = time.monotonic() + 20  # the group's removal lands asynchronously
    while (left := _held_groups(ray) - groups_before) and time.monotonic() < deadline:
        time.sleep(0.5)
    # A removed placement group takes the workers placed in it down with it.
    assert not left, f"the failed group's placement group is still held: {left}"
    # engagement: the call made a group (the failure came from its ranks, not before them)
    table = ray.util.placement_group_table()
    made = [info["state"] for group_id, info in table.items() if group_id not in known_before]
    assert made == ["REMOVED"], made


def _two_ranks(timeout_s: float):
    from moe_runtime import LLM
    from tests.invariance import TINY_CONFIG

    return LLM(TINY_CONFIG, **{"parallel.world_size": 2, "parallel.timeout_s": timeout_s})


def test_a_rank_stalled_while_idle_is_found_within_the_quick_bound(ray_local):
    """timeout_s 30: the collective bound plus its margin is 60 s; the ping's is 10 s."""
    llm = _two_ranks(30)
    engine = llm.engine
    pids = engine.executor.call_all("pid")
    os.kill(pids[1], signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(WorkerError, match=r"ranks \[1\] did not finish ping within 10s"):
            engine.check_workers()
        assert time.monotonic() - started < QUICK_CALL_TIMEOUT_S + 5
        assert engine.error is not None, "the engine must die as if a step had found the rank"
    finally:
        os.kill(pids[1], signal.SIGCONT)
        llm.shutdown()


def test_a_worker_exception_reads_as_its_type_and_first_line(ray_local):
    llm = _two_ranks(5)
    try:
        with pytest.raises(WorkerError) as failure:
            llm.engine.executor.call_all("execute", None)  # every rank: AttributeError on None
        message = str(failure.value)
        assert re.search(r"rank [01] failed during execute: AttributeError: ", message), message
        assert "\x1b" not in message and "pid=" not in message and "Traceback" not in message
        assert len(message) < 1000, message
    finally:
        llm.shutdown()


def test_each_rank_freezes_its_start_up_objects(ray_local):
    """A Ray actor is a process of the runtime's own: after init its model and torch's objects
    leave the cyclic collector's view (moe_runtime/heap.py), so no full collection of them
    stalls a step."""
    llm = _two_ranks(30)
    try:
        num_frozen = llm.engine.executor.num_frozen
        assert len(num_frozen) == 2 and min(num_frozen) > 10_000, num_frozen  # torch alone has more
        out = llm.generate(["frozen ranks"], SamplingParams(max_tokens=2, seed=1))[0]
        assert len(out.token_ids) == 2
    finally:
        llm.shutdown()


def test_a_world_larger_than_the_cluster_says_what_it_lacked(ray_local, monkeypatch, caplog):
    """16 ranks of one CPU on the private head's 8: the placement group waits for room that
    never comes; the error named 'ranks [0]' as if a worker had stalled. The wait is logged
    once it runs long, with what the cluster has: the start-up said nothing for the whole
    bound (parallel.timeout_s + 30 s)."""
    from moe_runtime import LLM
    from moe_runtime.executor import ray_placement
    from tests.invariance import TINY_CONFIG

    monkeypatch.setattr(ray_placement, "PLACEMENT_NOTICE_S", 0.5)
    with pytest.raises(WorkerError) as failure, caplog.at_level(logging.WARNING):
        LLM(TINY_CONFIG, **{"parallel.world_size": 16, "parallel.timeout_s": 1})
    waits = [r.getMessage() for r in caplog.records if "waiting for the Ray" in r.getMessage()]
    assert waits == [
        "waiting for the Ray cluster to place parallel.world_size=16 ranks of {'CPU': 1} each "
        "(up to 30s more): it has 8 CPU (8 free)"
    ], waits
    message = str(failure.value)
    assert "could not place parallel.world_size=16 ranks of {'CPU': 1} each" in message, message
    assert "it has 8 CPU (" in message and "free); the rest is held by" in message, message
    assert "another engine of this process" in message and "ranks [" not in message, message


def test_a_refusal_on_every_rank_reads_every_rank_s_answer(ray_local, monkeypatch):
    """A state dict that fits no rank is refused by each: the driver raised the first rank's
    ValueError and dropped the others' answers unread, which Ray logs as 'Unhandled error'
    with the rank's traceback (one per refused update, at every world size > 1)."""
    import gc

    import ray._private.worker as ray_worker
    import torch

    unhandled = []
    monkeypatch.setattr(ray_worker, "_unhandled_error_handler", unhandled.append)
    llm = _two_ranks(10)
    try:
        with pytest.raises(ValueError, match=r"rank [01]: weights 'the state dict' do not"):
            llm.update_weights({"model.embed_tokens.weight": torch.zeros(3, 3)})
        gc.collect()
        time.sleep(3)  # Ray reports a dropped error from its own thread
        gc.collect()
        # This update's answers only: an earlier test's dropped answer (a rank's own failure
        # raised before its peers answered) may be collected, and reported, meanwhile.
        dropped = [str(error) for error in unhandled if "prepare_weights" in str(error)]
        assert not dropped, [error[:200] for error in dropped]
        out = llm.generate(["still serving"], SamplingParams(max_tokens=2, seed=1))[0]
        assert len(out.token_ids) == 2
    finally:
        llm.shutdown()


@pytest.mark.parametrize("backend", ["nccl", "auto", "gloo"])
def test_nccl_ranks_sharing_gpus_are_refused_before_any_worker(monkeypatch, backend):
    """parallel.device cuda over NCCL ('auto' resolves to it) with more ranks than the cluster
    has GPUs: the bundles took fractional GPUs, the ranks shared them, and NCCL refused the
    communicator ("Duplicate GPU detected") at the first collective, after the workers had
    loaded their weights. Refused at once now, naming the backend; gloo may share them."""
    from moe_runtime.executor import ray_placement
    from tests.invariance import TINY_CONFIG

    monkeypatch.setattr(ray_placement.ray, "cluster_resources", lambda: {"GPU": 1.0, "CPU": 8.0})
    overrides = {"parallel.device": "cuda", "parallel.world_size": 2, "parallel.backend": backend}
    config = load_config(TINY_CONFIG, overrides)
    if backend == "gloo":
        ray_placement.check_gpu_sharing(config)  # ranks sharing a GPU over gloo: allowed
        assert ray_placement.gpu_share("cuda", 2) == 0.5
        return
    with pytest.raises(ValueError, match=r"ranks share the Ray cluster's 1 GPU.*backend: gloo"):
        ray_placement.check_gpu_sharing(config)


def test_ranks_sharing_a_gpu_refuse_a_cache_sized_from_free_memory(monkeypatch):
    """Gloo ranks sharing one GPU with cache.num_blocks 0: each rank measured the memory free
    on the GPU and took its fraction of it, every rank counting the same memory. Refused at
    once, naming cache.num_blocks; with a GPU a rank, or a fixed cache, allowed."""
    from moe_runtime.executor import ray_placement
    from tests.invariance import TINY_CONFIG

    gpus = {"GPU": 1.0}
    monkeypatch.setattr(ray_placement.ray, "cluster_resources", lambda: gpus)
    overrides = {"parallel.device": "cuda", "parallel.world_size": 2, "parallel.backend": "gloo"}
    sized = load_config(TINY_CONFIG, {**overrides, "cache.num_blocks": 0})
    with pytest.raises(ValueError, match=r"share the Ray cluster's 1 GPU.*set cache.num_blocks"):
        ray_placement.check_gpu_sharing(sized)
    ray_placement.check_gpu_sharing(load_config(TINY_CONFIG, overrides))  # a fixed cache
    gpus["GPU"] = 2.0
    ray_placement.check_gpu_sharing(sized)  # a GPU a rank


def test_a_peer_that_fails_after_the_raised_failure_is_not_reported_again(ray_local, monkeypatch):
    """Rank 1 fails in a step and the driver raises that at once; rank 0, waiting for it in the
    step's collective, fails parallel.timeout_s later. Its result was never read, and Ray
    logged it as an "Unhandled error" with its whole traceback: a second report of the fault,
    long after the first, in the console of an LLM user or a rollout."""
    import ray._private.worker as ray_worker

    from moe_runtime import LLM
    from moe_runtime.worker.step_input import StepInput
    from tests.invariance import TINY_CONFIG

    unhandled: list = []
    monkeypatch.setattr(ray_worker, "_unhandled_error_handler", unhandled.append)
    # pytest keeps log records, and the failure's in them its frames and so the calls' refs
    logger = logging.getLogger("moe_runtime.executor.ray_executor")
    monkeypatch.setattr(logger, "disabled", True)
    llm = LLM(TINY_CONFIG, **{"parallel.world_size": 2, "parallel.timeout_s": 2})
    try:
        try:  # (not pytest.raises: its traceback would keep the calls' refs alive)
            llm.engine.executor.execute([StepInput(), StepInput(released_seq_ids=[12345])])
            message = "no failure"
        except WorkerError as exc:
            message = str(exc)
        assert message.startswith("rank 1 failed during step 1: KeyError"), message
        gc.collect()  # the failure's frames are gone, as a caller's are once it has handled it
        # A rank runs its calls in order: rank 0 answers this once its step has failed.
        llm.engine.executor.call_all("pid")
        deadline = time.monotonic() + 5
        while not unhandled and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        llm.shutdown()
    assert unhandled == [], unhandled


def test_a_call_past_the_collective_bound_names_the_key_that_sets_it(ray_local):
    """A rank's load (init) or step that outran the driver's bound read "did not finish init
    within 150s": a number no config key holds, where a slow checkpoint needs a larger
    parallel.timeout_s."""
    from moe_runtime import LLM
    from tests.invariance import TINY_CONFIG

    llm = LLM(TINY_CONFIG, **{"parallel.world_size": 2, "parallel.timeout_s": 20})
    executor = llm.engine.executor
    pids = executor.call_all("pid")
    os.kill(pids[1], signal.SIGSTOP)
    try:
        executor.timeout_s = 2  # (the bound parallel.timeout_s + 30 s sets, cut for the test)
        expected = r"ranks \[1\] did not finish pid within 2s \(parallel.timeout_s \+ 30s\)$"
        with pytest.raises(WorkerError, match=expected):
            executor.call_all("pid")
    finally:
        os.kill(pids[1], signal.SIGCONT)
        llm.shutdown()


def _never_placed(monkeypatch, resources: dict[str, float], world_size: int, device: str) -> str:
    """The refusal of a placement that never comes on a cluster of `resources` (no cluster:
    only the wait runs, Ray's calls stood in for)."""
    from moe_runtime.executor import ray_placement

    monkeypatch.setattr(ray_placement.ray, "cluster_resources", lambda: resources)
    monkeypatch.setattr(ray_placement.ray, "available_resources", lambda: resources)
    monkeypatch.setattr(ray_placement.ray, "wait", lambda refs, timeout=None: ([], refs))
    group = SimpleNamespace(ready=lambda: "the group's ready ref")
    with pytest.raises(WorkerError) as failure:
        bundle = ray_placement.bundles(device, world_size, 1)[0]  # as RayExecutor passes it
        ray_placement.wait_for_placement(group, world_size, bundle, 1.0, "parallel.timeout_s + 30s")
    return str(failure.value)


def test_a_placement_that_never_comes_names_each_rank_s_share_of_a_gpu(monkeypatch):
    """8 ranks sharing one GPU each ask for 1/8 of it; the refusal said "{'CPU': 1, 'GPU': 1}
    each" (the bundle of a world of one), as if each rank wanted a GPU of its own. A cluster
    with one GPU and 4 CPUs: the ranks' CPUs are what it lacks."""
    message = _never_placed(monkeypatch, {"CPU": 4.0, "GPU": 1.0}, 8, "cuda")
    expected = "place parallel.world_size=8 ranks of {'CPU': 1, 'GPU': 0.125} each within 1s"
    assert expected in message, message


def test_a_placement_past_the_collective_bound_names_the_key_that_sets_it(monkeypatch):
    """The placement wait is bounded by parallel.timeout_s + 30 s, as a call is, and its refusal
    read "within 150s": a number no config key holds, where a cluster that adds nodes on demand
    (an autoscaler) needs a larger parallel.timeout_s to place the world. RayExecutor passes
    that bound's phrase."""
    from moe_runtime.executor import ray_executor

    message = _never_placed(monkeypatch, {"CPU": 4.0}, 8, "cpu")
    assert "each within 1s (parallel.timeout_s + 30s): it has 4 CPU" in message, message
    assert ray_executor._BOUND == "parallel.timeout_s + 30s"


def _rendezvous_worker():
    """A Worker that remembers the rendezvous point the driver gave its init (a local class:
    shipped to the actors by value)."""
    from moe_runtime.worker.worker import Worker

    class RendezvousWorker(Worker):
        def init(self, master_addr, master_port, physical_to_logical):
            self.rendezvous = (master_addr, master_port)
            super().init(master_addr, master_port, physical_to_logical)

        def joined(self):
            return self.rendezvous

    return RendezvousWorker


def test_the_rendezvous_is_rank_0_s_node_as_ray_reaches_it(ray_local, monkeypatch):
    """The ranks meet at the address Ray reaches rank 0's node at. It was the one rank 0's
    hostname resolves to, which is often loopback (127.0.1.1: Debian's /etc/hosts), so ranks
    on other nodes waited the collective timeout and failed, or no address at all (a container
    whose hostname resolves to nothing: rank 0 failed with gaierror). This machine's hostname
    resolves to 127.0.0.1 while Ray reaches its node at another address."""
    import ray

    from moe_runtime.engine.balancer import initial_placement
    from moe_runtime.executor import ray_executor
    from tests.invariance import TINY_CONFIG

    monkeypatch.setattr(ray_executor, "Worker", _rendezvous_worker())
    config = load_config(TINY_CONFIG, {"parallel.world_size": 2, "parallel.timeout_s": 30})
    executor = create_executor(config, initial_placement(config).physical_to_logical.tolist())
    try:
        joined = executor.call_all("joined")
        table = ray.util.placement_group_table(executor.placement_group)
        node_id = table["bundles_to_node_id"][0]
        (node,) = [n for n in ray.nodes() if n["NodeID"] == node_id]
        assert joined[0] == joined[1], joined
        assert joined[0][0] == node["NodeManagerAddress"], (joined, node["NodeManagerAddress"])
    finally:
        executor.shutdown()


def test_the_rendezvous_port_is_held_from_its_choice_to_the_init():
    """Rank 0 found a free port, let it go and bound it again in its init, after every rank's
    init call went out: meanwhile any process could take it (a second engine's rank 0 picking
    ports at the same time), and the start failed with EADDRINUSE, or the other ranks joined
    that engine's store. Now rank 0's store listens on the port from the moment it is chosen,
    and the init joins that store."""
    import errno
    import socket

    from moe_runtime.worker.worker import Worker
    from tests.invariance import TINY_CONFIG

    config = load_config(TINY_CONFIG, {"parallel.world_size": 2})
    worker = Worker(config, rank=0)
    port = worker.open_rendezvous()
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("", port))
    assert taken.value.errno == errno.EADDRINUSE, taken.value


def _worker_that_cannot_start():
    """A Worker whose actor fails in its creation, as one whose node lacks a package does."""
    from moe_runtime.worker.worker import Worker

    class UnstartableWorker(Worker):
        def __init__(self, config, rank, sampled_vocab_size):
            raise ModuleNotFoundError("No module named 'triton_on_this_node'")

    return UnstartableWorker


def test_a_rank_that_fails_to_start_says_why(ray_local, monkeypatch):
    """An actor that died in its creation (its class failing to import on a node that lacks a
    package, its constructor raising) read "rank 0 died during configure_logging": the cause
    went to the log only. It is named now, without Ray's pids and ids."""
    from moe_runtime.engine.balancer import initial_placement
    from moe_runtime.executor import ray_executor
    from tests.invariance import TINY_CONFIG

    monkeypatch.setattr(ray_executor, "Worker", _worker_that_cannot_start())
    config = load_config(TINY_CONFIG, {"parallel.world_size": 2, "parallel.timeout_s": 30})
    with pytest.raises(WorkerError) as failure:
        create_executor(config, initial_placement(config).physical_to_logical.tolist())
    message = str(failure.value)
    assert re.fullmatch(
        r"rank [01] died during configure_logging: its actor failed to start: "
        r"ModuleNotFoundError: No module named 'triton_on_this_node'",
        message,
    ), message


def test_a_placement_group_whose_removal_fails_is_logged_and_a_stopped_kill_still_removes_it(
    monkeypatch, caplog
):
    """The release of an executor (shutdown, a failed start, a dropped LLM) removed its
    placement group last and bare: a removal that raised came out of shutdown(), hiding a failed
    start's own error, and a kill interrupted before it (Ctrl-C) never removed the group."""
    import ray

    from moe_runtime.executor import ray_executor

    group = SimpleNamespace(id=SimpleNamespace(hex=lambda: "c0ffee"))
    removed = []

    def refuse(placement_group):
        removed.append(placement_group)
        raise RuntimeError("GCS unavailable")

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "kill", lambda worker, no_restart: None)
    monkeypatch.setattr(ray_executor, "remove_placement_group", refuse)
    with caplog.at_level(logging.ERROR, logger=ray_executor.__name__):
        ray_executor._release(os.getpid(), ["worker"], group)
    assert removed == [group]
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 1 and "c0ffee" in messages[0], messages
    assert "GCS unavailable" in messages[0], messages

    def interrupted(worker, no_restart):
        raise KeyboardInterrupt

    monkeypatch.setattr(ray, "kill", interrupted)
    monkeypatch.setattr(ray_executor, "remove_placement_group", removed.append)
    with pytest.raises(KeyboardInterrupt):
        ray_executor._release(os.getpid(), ["worker"], group)
    assert removed == [group, group]


@pytest.mark.parametrize(
    ("device", "bundle", "num_cpus"),
    [("cpu", {"CPU": 3}, 6), ("cuda", {"CPU": 1, "GPU": 1}, 2)],
)
def test_a_rank_s_bundle_asks_for_the_cpus_its_threads_use(monkeypatch, device, bundle, num_cpus):
    """A CPU rank runs its step on kernels.num_threads threads, but its bundle asked for 1 CPU:
    Ray packed ranks of 3 threads onto one core each as if they used one, and a local cluster
    was started with a CPU a rank. A CUDA rank keeps 1 CPU (the GPU runs its step). No
    cluster: Ray's calls stood in for, the placement group's bundles recorded."""
    from moe_runtime.executor import ray_executor, ray_placement
    from tests.invariance import TINY_CONFIG

    asked = {}

    def placement_group(bundles, strategy):
        asked["bundles"] = bundles
        raise InterruptedError("recorded")

    monkeypatch.setattr(ray_executor, "connect_ray", lambda cpus: asked.setdefault("cpus", cpus))
    monkeypatch.setattr(ray_placement.ray, "cluster_resources", lambda: {"CPU": 64.0, "GPU": 2.0})
    monkeypatch.setattr(ray_executor, "placement_group", placement_group)
    overrides = {"parallel.world_size": 2, "parallel.device": device, "kernels.num_threads": 3}
    with pytest.raises(InterruptedError, match="recorded"):
        create_executor(load_config(TINY_CONFIG, overrides), [])
    assert asked == {"cpus": num_cpus, "bundles": [bundle, bundle]}


def _placement_refusal(monkeypatch, resources: dict[str, float], world_size: int, bundle) -> str:
    """wait_for_placement's refusal on a cluster of `resources` whose group never becomes ready;
    "waited" when it waited for it (Ray's calls stood in for)."""
    from moe_runtime.executor import ray_placement

    waited = []
    monkeypatch.setattr(ray_placement.ray, "cluster_resources", lambda: resources)
    monkeypatch.setattr(ray_placement.ray, "available_resources", lambda: resources)
    monkeypatch.setattr(
        ray_placement.ray, "wait", lambda refs, timeout: waited.append(1) or ([], refs)
    )
    group = SimpleNamespace(ready=lambda: "the group's ready ref")
    with pytest.raises(WorkerError) as failure:
        ray_placement.wait_for_placement(group, world_size, bundle, 1.0, "parallel.timeout_s + 30s")
    return "waited" if waited else str(failure.value)


def test_a_placement_the_runtime_s_own_cluster_can_never_hold_is_refused_at_once(monkeypatch):
    """4 ranks of a CPU each on the local cluster this process started with 2 CPUs (an earlier,
    smaller engine's): it never grows, yet the placement waited parallel.timeout_s + 30 s for
    room. Refused at once now, naming what was asked and what exists. A cluster the runtime
    did not start (nodes may join it, an autoscaler may grow it) is still waited for, and so is
    a placement the own cluster can hold (8 ranks sharing its one GPU)."""
    from moe_runtime.executor.ray_connect import OWN_CLUSTER_RESOURCE

    own = {"CPU": 2.0, "GPU": 1.0, OWN_CLUSTER_RESOURCE: 1.0}
    message = _placement_refusal(monkeypatch, own, 4, {"CPU": 1})
    assert message == (
        "parallel.world_size=4 ranks of {'CPU': 1} each ask for 4 CPU in all, and the local Ray "
        "cluster this process started has 2 CPU in all: it never grows (it was sized for the "
        "first engine of the process; call ray.shutdown() before a larger one, or give it a "
        "cluster with room through RAY_ADDRESS)"
    ), message
    assert _placement_refusal(monkeypatch, {"CPU": 2.0}, 4, {"CPU": 1}) == "waited"
    shared_gpu = {"CPU": 1, "GPU": 0.125}
    assert _placement_refusal(monkeypatch, {**own, "CPU": 8.0}, 8, shared_gpu) == "waited"


def test_a_peer_s_refusal_is_reported_by_the_rank_that_refused(ray_local):
    """When one rank refuses its own dispatch arguments, every rank raises in step: that rank its
    own ValueError (which says why), the others a PeerRefusedError naming it. The driver
    raised whichever it read first, often the peers' "rank 1 refused ... (its own error says
    why)", which does not say why; now it reports the refusing rank's own error."""
    import ray

    from comm.errors import PeerRefusedError
    from moe_runtime.executor.ray_executor import RayExecutor

    @ray.remote
    def answer(rank: int) -> None:
        if rank == 1:  # the refusing rank answers last
            time.sleep(1.0)
            raise ValueError("expert id 99 is outside [0, 64)")
        raise PeerRefusedError("dispatch skipped on every rank: rank 1 refused its arguments")

    executor = RayExecutor.__new__(RayExecutor)  # _get reads timeout_s only
    executor.timeout_s = 30.0
    with pytest.raises(ValueError, match=r"^rank 1: expert id 99 is outside \[0, 64\)$"):
        executor._get([answer.remote(rank) for rank in range(3)], "step 1")
