"""Executors: how the driver reaches its workers.

`LocalExecutor` runs the single rank in this process; `RayExecutor` (with ray_connect.py, the
only driver modules that import ray) one actor per rank. Both take a `StepInput` per rank each
step and return a `StepOutput` per rank, or raise WorkerError.
"""

from __future__ import annotations

import torch

from moe_runtime.config import RuntimeConfig
from moe_runtime.executor.local import LocalExecutor
from moe_runtime.worker.step_input import WorkerError

# The bound of a call that runs no collective and little work (a ping, counters, the expert
# load window): a live rank answers it in milliseconds, so a stalled one is found in seconds,
# not after the collective timeout plus its margin (over two minutes by default) while
# /health still says 200. Generous against a loaded machine's scheduling delays.
QUICK_CALL_TIMEOUT_S = 10.0


def create_executor(
    config: RuntimeConfig,
    physical_to_logical: list[list[int]],
    device: torch.device | None = None,
    sampled_vocab_size: int | None = None,
):
    """In-process for one rank; Ray actors for more (imported lazily: only the driver needs
    ray). physical_to_logical: the placement the workers start with; device: where an
    in-process rank is built (LocalExecutor), None for the current device;
    sampled_vocab_size: the tokenizer's, every rank's bound on the ids it samples (Worker)."""
    if config.parallel.world_size == 1:
        return LocalExecutor(config, physical_to_logical, device, sampled_vocab_size)
    from moe_runtime.executor.ray_executor import RayExecutor

    return RayExecutor(config, physical_to_logical, sampled_vocab_size)


__all__ = ["QUICK_CALL_TIMEOUT_S", "LocalExecutor", "WorkerError", "create_executor"]
