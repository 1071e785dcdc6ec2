"""Executors: how the driver reaches its workers.

`LocalExecutor` runs the single rank in this process. `RayExecutor` (moe_runtime/ray_executor.py,
the only driver module that imports ray) runs one actor per rank. Both take one list of chunks
per rank each step and return one (samples, scored) pair per rank, or raise WorkerError.
"""

from __future__ import annotations

from moe_runtime.config import RuntimeConfig
from moe_runtime.model_runner import StepOutput
from moe_runtime.scheduler import ScheduledChunk
from moe_runtime.worker import Worker


class WorkerError(RuntimeError):
    """A worker died, timed out or failed a step; the message names the rank and the step."""


class LocalExecutor:
    def __init__(self, config: RuntimeConfig) -> None:
        if config.parallel.world_size != 1:
            raise ValueError(
                f"LocalExecutor runs one rank, parallel.world_size is {config.parallel.world_size}"
            )
        self.worker = Worker(config, rank=0)
        self.worker.init("127.0.0.1", 0)

    def execute(self, per_rank_chunks: list[list[ScheduledChunk]]) -> list[StepOutput]:
        return [self.worker.execute(per_rank_chunks[0])]

    def call(self, method: str, per_rank_args: list[tuple]) -> list:
        """Run Worker.<method> on every rank with its own arguments; results in rank order."""
        return [getattr(self.worker, method)(*per_rank_args[0])]

    def call_all(self, method: str, *args) -> list:
        return self.call(method, [args])

    def stats(self) -> list[dict]:
        return self.call_all("stats")

    def shutdown(self) -> None:
        self.worker.shutdown()


def create_executor(config: RuntimeConfig):
    """In-process for one rank; Ray actors for more (imported lazily: ray is the driver's only)."""
    if config.parallel.world_size == 1:
        return LocalExecutor(config)
    from moe_runtime.ray_executor import RayExecutor

    return RayExecutor(config)
