"""Which Ray the driver uses (`connect_ray`), each check in a process of its own.

- With no address named (the Python API: Ray's default, RAY_ADDRESS or the cluster `ray start`
  recorded) or "local" (launch/ without RAY_ADDRESS) it joins no cluster that merely runs on
  the machine (Ray's address="auto" joined any GCS process it found, a test's private head with
  its own temp dir among them, and ran the driver's ranks there).
- With an address named (launch/ passes RAY_ADDRESS; `ray job submit` sets it) it joins that one;
  a host:port where nothing listens fails at once, naming it (ray.init retried it for some 13
  minutes, and serve_ep deferred Ctrl-C and SIGTERM meanwhile).
- A local Ray started from a thread that then ends keeps running: Ray binds its GCS and raylet
  to the starting thread's life (Linux's parent-death signal), and serve_ep connects on a worker
  thread, so its local Ray died at asyncio.run's end, under the driver's own shutdown.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ray_head import free_port, ray_env

pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parent.parent

CONNECT = """
import sys, ray
from moe_runtime.executor.ray_connect import connect_ray
connect_ray(1, *sys.argv[1:])
print(ray.get_runtime_context().gcs_address, flush=True)
"""

THREAD_STARTED = """
import concurrent.futures, ray
from moe_runtime.executor.ray_connect import connect_ray
with concurrent.futures.ThreadPoolExecutor(1) as pool:
    pool.submit(connect_ray, 1).result()
# the thread that started the local instance has ended
print(ray.get(ray.remote(lambda: "served").remote(), timeout=120), flush=True)
"""


def _python(
    source: str, *args: str, timeout_s: float = 300, env=None
) -> subprocess.CompletedProcess:
    """A fresh Python process running `source` with args, from the checkout, in a user's shell
    (ray_env(): no RAY_ADDRESS; the session's private RAY_TMPDIR stays) unless env is given."""
    return subprocess.run(
        [sys.executable, "-c", source, *args],
        cwd=ROOT,
        env=ray_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _connect(
    *address: str, timeout_s: float = 300, ray_address: str | None = None
) -> subprocess.CompletedProcess:
    """A fresh process's connect_ray(1, *address), printing the GCS address it joined or
    started; ray_address: its RAY_ADDRESS, as `ray job submit` sets it for a job's driver."""
    env = ray_env()
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    return _python(CONNECT, *address, timeout_s=timeout_s, env=env)


def _connected_to(*address: str, ray_address: str | None = None) -> str:
    run = _connect(*address, ray_address=ray_address)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    return run.stdout.split()[-1]


def _driver_logs(head) -> set[Path]:
    """One log per driver that ever connected to the head."""
    return set(head.temp_dir.glob("session_[0-9]*/logs/python-core-driver-*"))


@pytest.mark.parametrize("address", [(), ("local",)])
def test_no_address_starts_a_local_ray_and_joins_no_running_cluster(ray_head, address):
    drivers = _driver_logs(ray_head)
    assert _connected_to(*address) != ray_head.gcs_address
    assert _driver_logs(ray_head) == drivers, "connect_ray joined a cluster it was not given"


def test_the_python_api_joins_the_job_s_cluster_as_ray_does(ray_head):
    """LLM (no address) under `ray job submit`: Ray's default reads the job's RAY_ADDRESS and
    joins its cluster (a local Ray there would run a second instance beside the job's)."""
    drivers = _driver_logs(ray_head)
    assert _connected_to(ray_address=ray_head.gcs_address) == ray_head.gcs_address
    assert len(_driver_logs(ray_head) - drivers) == 1


def test_a_named_address_is_joined(ray_head):
    drivers = _driver_logs(ray_head)
    assert _connected_to(ray_head.gcs_address) == ray_head.gcs_address
    assert len(_driver_logs(ray_head) - drivers) == 1


def test_an_address_where_nothing_listens_fails_at_once_naming_it():
    address = f"127.0.0.1:{free_port()}"  # closed again: nothing listens there
    # Generous against a loaded machine: the check takes well under a second, ray.init minutes.
    run = _connect(address, timeout_s=120)
    assert run.returncode == 1, run.stdout + run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ConnectionError: no Ray cluster answers at {address}"), last


def test_a_recorded_cluster_that_died_fails_at_once_naming_it(tmp_path):
    """The Python API (no address) where `ray start` recorded a cluster that has since died
    (killed, crashed: its record stays): Ray's default joins the recorded address, and ray.init
    retried it for some 13 minutes, LLM() hanging meanwhile with no word of why."""
    address = f"127.0.0.1:{free_port()}"  # closed again: nothing listens there
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(address)
    env = {**ray_env(), "RAY_TMPDIR": str(tmp_path)}
    # 120 s: generous against a loaded machine (the check takes well under a second)
    run = _python(CONNECT, timeout_s=120, env=env)
    assert run.returncode == 1, run.stdout + run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    port = address.rsplit(":", 1)[1]  # (Ray names this machine's address for 127.0.0.1)
    expected = rf"ConnectionError: no Ray cluster answers at [0-9.]+:{port} \(RAY_ADDRESS, else"
    assert re.match(expected, last), last


def test_a_local_ray_started_on_a_thread_outlives_the_thread():
    run = _python(THREAD_STARTED)
    assert run.stdout.split() == ["served"], run.stdout + run.stderr[-3000:]
    assert run.returncode == 0, run.stderr[-3000:]


def test_generate_names_a_cluster_that_does_not_answer():
    """generate.py with RAY_ADDRESS where nothing listens: one error line and exit 1 (it
    printed the ConnectionError's traceback)."""
    env = {**ray_env(), "RAY_ADDRESS": f"127.0.0.1:{free_port()}"}
    cmd = [sys.executable, "launch/generate.py", "--config", "launch/configs/tiny_cpu.yaml"]
    cmd += ["--set", "parallel.world_size=2"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: no Ray cluster answers at")
    assert "Traceback" not in done.stderr, done.stderr


def test_only_rays_refusal_of_num_cpus_means_a_cluster_was_found(monkeypatch):
    """With no address named, a local start that Ray refuses because it found a cluster to join
    (it takes no num_cpus there) joins that cluster; any other ValueError of the start is raised
    as it is (it was taken for "a cluster was found" and a second ray.init tried, hiding it)."""
    from moe_runtime.executor import ray_connect

    joined: list[dict] = []
    monkeypatch.setattr(ray_connect.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_connect.ray, "init", lambda **kwargs: joined.append(kwargs))

    def refused(*_):
        raise ValueError(refusal)

    monkeypatch.setattr(ray_connect, "_start_local_ray", refused)
    refusal = "When connecting to an existing cluster, num_cpus and num_gpus must not be provided."
    ray_connect.connect_ray(2)
    assert joined == [{"log_to_driver": True}]  # joined as it is
    refusal = "some other bad argument"
    with pytest.raises(ValueError, match="some other bad argument"):
        ray_connect.connect_ray(2)
    assert len(joined) == 1


def test_a_ray_without_the_private_lookup_still_joins(monkeypatch):
    """The recorded cluster's reachability check uses a lookup in Ray's private module, which
    may move between Ray releases: without it the driver joins as Ray's default would (it
    raised AttributeError, and on a Ray without the module the executor failed to import)."""
    from ray._private import services

    from moe_runtime.executor import ray_connect

    joined: list[dict] = []
    monkeypatch.setattr(ray_connect.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_connect.ray, "init", lambda **kwargs: joined.append(kwargs))

    def found_a_cluster(*_):
        raise ValueError("When connecting to an existing cluster, num_cpus must not be provided.")

    monkeypatch.setattr(ray_connect, "_start_local_ray", found_a_cluster)
    monkeypatch.delattr(services, "canonicalize_bootstrap_address")
    ray_connect.connect_ray(2)
    assert joined == [{"log_to_driver": True}]


OWN_CLUSTER_TOO_SMALL = """
import time, ray
from moe_runtime.config import load_config
from moe_runtime.executor import WorkerError, create_executor
from moe_runtime.executor.ray_connect import OWN_CLUSTER_RESOURCE, connect_ray
from tests.invariance import TINY_CONFIG
connect_ray(1, "local")  # an earlier, smaller engine's local instance: os.cpu_count() CPUs
num_cpus = int(ray.cluster_resources()["CPU"])
overrides = {"parallel.world_size": 2, "parallel.timeout_s": 5, "kernels.num_threads": num_cpus}
start = time.monotonic()
try:
    create_executor(load_config(TINY_CONFIG, overrides), [])
except WorkerError as error:
    marker = ray.cluster_resources().get(OWN_CLUSTER_RESOURCE)
    print(marker, round(time.monotonic() - start), error, sep="|", flush=True)
"""


def test_a_placement_larger_than_the_own_local_ray_fails_at_once():
    """connect_ray's local instance is marked as the runtime's own, and 2 ranks of all its CPUs
    each are refused at once: the placement waited parallel.timeout_s + 30 s (35 s here)."""
    run = _python(OWN_CLUSTER_TOO_SMALL)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    marker, elapsed_s, message = run.stdout.strip().splitlines()[-1].split("|")
    assert marker == "1.0" and int(elapsed_s) < 10, run.stdout
    assert "and the local Ray cluster this process started has" in message, message
