"""moe-runtime: a batch-invariant, expert-parallel inference runtime for DeepSeek-style MoE."""

from moe_runtime.engine.outputs import CompletionOutput, RequestOutput
from moe_runtime.llm import LLM
from moe_runtime.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
