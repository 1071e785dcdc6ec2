"""Shared pytest fixtures: seeded randomness and a guard for torch's global thread count."""

from __future__ import annotations

import pytest
import torch


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


@pytest.fixture(scope="module")
def ray_local():
    """A private local Ray cluster of 8 single-CPU slots for one test module.

    `address="local"` starts a fresh cluster even if another one runs on the machine.
    """
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
