"""Shared pytest fixtures: seeded randomness, a guard for torch's global thread count, and a
private Ray cluster (tests never join, nor stop, a cluster they did not start)."""

from __future__ import annotations

import shutil
import signal
import tempfile

import pytest
import torch

from tests.ray_head import start_ray_head, stop_ray_head


@pytest.fixture
def generator() -> torch.Generator:
    """A CPU generator seeded to 0; pass it to torch.randn(..., generator=generator)."""
    return torch.Generator().manual_seed(0)


@pytest.fixture
def seeded() -> None:
    """Seed torch's global generator for code that draws without an explicit generator."""
    torch.manual_seed(0)


@pytest.fixture
def restore_num_threads():
    """Let a test change torch.set_num_threads; the previous count comes back afterwards."""
    num_threads = torch.get_num_threads()
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="session", autouse=True)
def teardown_on_sigterm():
    """A SIGTERM to the test run (a CI time limit, `kill`, `timeout`) ends it as Ctrl-C does, so
    pytest still runs the fixtures' teardown: a private Ray head started for the tests is
    stopped instead of left running (a killed run once left one behind)."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="session", autouse=True)
def no_user_ray_cluster():
    """No test, and no process a test starts, finds the user's Ray cluster.

    Ray's `address="auto"` joins RAY_ADDRESS, else the cluster named in
    `$RAY_TMPDIR/ray/ray_current_cluster`, else any running one. Pointing both at this session
    makes a stray `ray.init` start a local instance under a private temp dir instead.
    """
    ray_tmpdir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: socket paths are capped
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_ADDRESS", "local")
        patch.setenv("RAY_TMPDIR", ray_tmpdir)
        yield
    shutil.rmtree(ray_tmpdir, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_head():
    """A private head node (own temp dir, own ports, 8 CPUs, dashboard), shared by the session,
    stopped by stopping exactly its processes (never `ray stop`)."""
    pytest.importorskip("ray")
    head = start_ray_head(num_cpus=8)
    yield head
    stop_ray_head(head)


@pytest.fixture(scope="module")
def ray_local(ray_head):
    """The test process connected to the private head for one module: `connect_ray` sees
    `ray.is_initialized()` and joins no other cluster; the module's actors end with it."""
    import ray

    ray.init(address=ray_head.gcs_address, log_to_driver=False)
    yield ray_head
    ray.shutdown()
