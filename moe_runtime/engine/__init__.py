"""The driver side: requests, scheduling, KV blocks, the expert placement, outputs. It reaches
the worker package only through its wire format (worker/step_input.py) and the executors."""

from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.outputs import CompletionOutput, EngineStats, RequestOutput

__all__ = ["LLMEngine", "CompletionOutput", "EngineStats", "RequestOutput"]
