"""The tests leave a user's Ray cluster alone: with a cluster started the way the README does
(`ray start --head --num-cpus 8`, Ray's default ports), a Ray test run in its own pytest process
joins none of it, stops none of it, and the cluster still runs tasks afterwards."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ray_head import head_pids, ray_env, start_ray_head, stop_ray_head

pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PORTS = (6379, 8265)  # GCS, dashboard: the README's cluster fails to start without them
RAY_TEST = "tests/test_eplb_live.py::test_load_statistics_count_every_row[2]"
PROBE = (
    "import sys, ray; ray.init(address=sys.argv[1], log_to_driver=False);"
    "print(ray.get(ray.remote(lambda: 'served').remote()), len(ray.nodes()))"
)


def _port_taken(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def user_cluster():
    if any(_port_taken(port) for port in DEFAULT_PORTS):
        pytest.skip(f"a cluster already holds Ray's default ports {DEFAULT_PORTS}")
    head = start_ray_head(num_cpus=8, use_default_ports=True)
    yield head
    stop_ray_head(head)


def _driver_logs(head) -> set[Path]:
    """One log per driver that ever connected to the cluster from this node."""
    return set(head.temp_dir.glob("session_[0-9]*/logs/python-core-driver-*"))


def test_ray_tests_neither_join_nor_stop_the_users_cluster(user_cluster):
    pids, drivers = head_pids(user_cluster), _driver_logs(user_cluster)
    env = ray_env()  # a user's shell: no RAY_ADDRESS, no private RAY_TMPDIR
    env.pop("RAY_TMPDIR", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", RAY_TEST],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 passed" in run.stdout, run.stdout[-3000:]
    assert head_pids(user_cluster) >= pids, "a process of the user's cluster died"
    assert _driver_logs(user_cluster) == drivers, "the Ray test joined the user's cluster"
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, user_cluster.gcs_address],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.stdout.split() == ["served", "1"], probe.stdout + probe.stderr[-3000:]
    assert len(_driver_logs(user_cluster) - drivers) == 1  # the probe joined: the check can see it
