"""Executors: how the driver reaches its workers.

`LocalExecutor` runs the single rank in this process; `RayExecutor` (the only driver module
that imports ray) one actor per rank. Both take a `StepInput` per rank each step and return a
`StepOutput` per rank, or raise WorkerError.
"""

from __future__ import annotations

from moe_runtime.config import RuntimeConfig
from moe_runtime.executor.local import LocalExecutor
from moe_runtime.worker.step_input import WorkerError


def create_executor(config: RuntimeConfig, physical_to_logical: list[list[int]]):
    """In-process for one rank; Ray actors for more (imported lazily: only the driver needs
    ray). physical_to_logical: the placement the workers start with."""
    if config.parallel.world_size == 1:
        return LocalExecutor(config, physical_to_logical)
    from moe_runtime.executor.ray_executor import RayExecutor

    return RayExecutor(config, physical_to_logical)


__all__ = ["LocalExecutor", "WorkerError", "create_executor"]
