"""LocalExecutor: the single rank, in this process (parallel.world_size 1)."""

from __future__ import annotations

from moe_runtime.config import RuntimeConfig
from moe_runtime.worker.step_input import StepInput, StepOutput
from moe_runtime.worker.worker import Worker


class LocalExecutor:
    def __init__(self, config: RuntimeConfig, physical_to_logical: list[list[int]]) -> None:
        if config.parallel.world_size != 1:
            raise ValueError(
                f"LocalExecutor runs one rank, parallel.world_size is {config.parallel.world_size}"
            )
        self.worker = Worker(config, rank=0)
        self.worker.init("127.0.0.1", 0, physical_to_logical)

    def execute(self, per_rank_inputs: list[StepInput]) -> list[StepOutput]:
        return [self.worker.execute(per_rank_inputs[0])]

    def call(self, method: str, per_rank_args: list[tuple], timeout_s: float | None = None) -> list:
        """Run Worker.<method> on every rank with its own arguments; results in rank order.
        timeout_s is the Ray executor's bound; a call in this process has none to keep."""
        return [getattr(self.worker, method)(*per_rank_args[0])]

    def call_all(self, method: str, *args, timeout_s: float | None = None) -> list:
        return self.call(method, [args], timeout_s)

    def shutdown(self) -> None:
        self.worker.shutdown()
