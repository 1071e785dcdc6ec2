"""connect_ray: which Ray cluster the driver joins, or starts, before any rank is placed.

Uses the Ray this process already joined, else joins the cluster its caller names (launch/ passes
RAY_ADDRESS, which `ray job submit` sets for its driver), else starts a local one with enough
logical CPUs for one single-CPU actor per rank. Apart from RayExecutor (ray_executor.py) because
it places and drives nothing: launch/ calls it before an engine loads, with no executor built.
"""

from __future__ import annotations

import os
import socket
import threading

import ray

# How long a named cluster's GCS address has to accept a TCP connection before ray.init is tried.
_REACH_TIMEOUT_S = 10.0
# A custom resource (1 unit, never asked for) that marks a local instance connect_ray started:
# one node, no autoscaler, so its totals are all it will ever have (ray_placement reads it).
OWN_CLUSTER_RESOURCE = "moe_runtime_own_cluster"
_OWN = {OWN_CLUSTER_RESOURCE: 1}


def connect_ray(num_cpus_needed: int, address: str | None = None) -> None:
    """Ray for this driver: the cluster this process already joined; else, `address` None (the
    Python API), Ray's own default: the cluster RAY_ADDRESS names or the one `ray start`
    recorded under Ray's temp dir, else a new local instance big enough; "local" (or "") a new
    local instance; else the cluster at `address`, as ray.init takes it.

    Why never Ray's address="auto": with no address named, it also joins any GCS process it
    sees on the machine, another user's cluster or a test's private head (each with a temp dir
    of its own), and runs this driver's ranks there.
    """
    if ray.is_initialized():
        return
    num_cpus = max(num_cpus_needed, os.cpu_count() or 1)
    if address in ("", "local"):
        _start_local_ray(num_cpus, "local")
    elif address is None:
        try:
            _start_local_ray(num_cpus, None)
        except ValueError as exc:
            if "existing cluster" not in str(exc):  # not Ray's refusal of num_cpus
                raise
            # A cluster was found (RAY_ADDRESS, or the one `ray start` recorded): joined as it
            # is, once it answers. Why check: a recorded cluster that has since died (killed,
            # crashed) had ray.init retry it for some 13 minutes, an LLM() hanging meanwhile.
            found = _recorded_address()
            if found is not None:
                _check_reachable(found, "RAY_ADDRESS, else the cluster `ray start` recorded")
            ray.init(log_to_driver=True)
    else:
        _check_reachable(address)
        ray.init(address=address, log_to_driver=True)


def _recorded_address() -> str | None:
    """The cluster ray.init(address=None) joins (RAY_ADDRESS, else the one `ray start`
    recorded), by Ray's own lookup; None where this Ray has no such lookup: its private module
    may move between releases, and the reachability check is a courtesy (ray.init then retries
    a dead cluster as before), not something to refuse to start over."""
    try:
        from ray._private import services
    except ImportError:
        return None
    lookup = getattr(services, "canonicalize_bootstrap_address", None)
    return None if lookup is None else lookup(None)


def _check_reachable(address: str, named_by: str = "") -> None:
    """ConnectionError at once where a plain host:port address accepts no TCP connection (other
    forms, "auto" or "ray://...", are left to ray.init); `named_by` says where it came from.

    Why: ray.init retries an address that nobody listens on for some 13 minutes (20 tries of
    about 40 s each) before it fails, and a server joining it acts on a stop signal only after.
    """
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit() or "/" in host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), _REACH_TIMEOUT_S).close()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        where = f" ({named_by})" if named_by else ""
        raise ConnectionError(f"no Ray cluster answers at {address}{where} ({why})") from None


def _start_local_ray(num_cpus: int, address: str | None) -> None:
    """ray.init(address, num_cpus) of a new local instance ("local"; None: unless Ray finds a
    cluster to join, which raises ValueError for the num_cpus), marked with
    OWN_CLUSTER_RESOURCE, called on a thread that lives
    as long as the process: the main thread (there Ray also sets its SIGTERM handler, which
    exits through its shutdown), else a daemon thread of its own.

    Why: Ray starts its GCS and raylet with Linux's parent-death signal (fate sharing), which the
    kernel ties to the thread that started them, not to the process. Started on a worker thread
    (serve_ep connects on one so that it answers meanwhile; a caller's thread pool), the local
    cluster was killed when that thread ended (at asyncio.run's end, a pool's shutdown): the
    driver then waited on a dead GCS at exit, Ray's agents outlived the process by a minute, and
    a caller's pool that ended before its last Ray call left that call hanging.
    """
    if threading.current_thread() is threading.main_thread():
        ray.init(address=address, num_cpus=num_cpus, resources=_OWN, log_to_driver=True)
        return
    done = threading.Event()
    failures: list[BaseException] = []

    def own_ray() -> None:
        try:
            ray.init(address=address, num_cpus=num_cpus, resources=_OWN, log_to_driver=True)
        except BaseException as exc:  # raised on the caller's thread below
            failures.append(exc)
        done.set()
        if not failures:
            threading.Event().wait()  # never set: the thread (a daemon) ends with the process

    threading.Thread(target=own_ray, name="ray-local-instance", daemon=True).start()
    done.wait()
    if failures:
        raise failures[0]
