"""Executors: how the driver reaches its workers.

`LocalExecutor` runs the single rank in this process; `RayExecutor` (ray_executor.py, the
only driver module that imports ray) runs one actor per rank. Both take one `StepInput` per
rank each step and return one `StepOutput` per rank, or raise WorkerError. The engine reaches
the worker package only through them and the wire format.
"""

from __future__ import annotations

from moe_runtime.config import RuntimeConfig
from moe_runtime.executor.base import WorkerError
from moe_runtime.executor.local import LocalExecutor


def create_executor(config: RuntimeConfig, physical_to_logical: list[list[int]]):
    """In-process for one rank; Ray actors for more (imported lazily: only the driver needs
    ray). physical_to_logical: the placement the workers start with."""
    if config.parallel.world_size == 1:
        return LocalExecutor(config, physical_to_logical)
    from moe_runtime.executor.ray_executor import RayExecutor

    return RayExecutor(config, physical_to_logical)


__all__ = ["LocalExecutor", "WorkerError", "create_executor"]
