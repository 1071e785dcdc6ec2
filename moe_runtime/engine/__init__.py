"""The driver side: requests, scheduling, KV block bookkeeping, the expert placement, outputs.

Imports the worker package only through its wire format (moe_runtime.worker.step_input) and
the executors.
"""

from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.outputs import CompletionOutput, EngineStats, RequestOutput

__all__ = ["LLMEngine", "CompletionOutput", "EngineStats", "RequestOutput"]
