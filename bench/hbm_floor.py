"""The memory floor of a decode step: the bytes it must read, over the device's copy bandwidth.

A decode step of B sequences at context C reads every non-expert weight once (attention, dense
MLP layers, shared experts, routers, norms, LM head), B rows of the embedding, the routed
experts its tokens touch (B tokens x K distinct picks of E per MoE layer, uniform routing
assumed: E * (1 - (1 - K/E)^B) experts expected) and the KV cache (B x C positions x layers x
latent width). Weight bytes come from the parameter shapes of the model class, built on the
meta device, so they follow the config. Activations and the KV write are left out (tiny).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from moe_kernels import KernelConfig, build_op_table
from moe_runtime.model.deepseek import TORCH_DTYPES, DeepseekForCausalLM
from moe_runtime.model_config import ModelConfig

_ROUTED_SUFFIXES = ("experts.gate_up_proj", "experts.down_proj")


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of the model's weights by how a decode step reads them."""

    non_expert: int  # read whole every step
    embedding_row: int  # one row of the embedding table
    routed_expert: int  # one routed expert (gate, up, down) of one MoE layer
    num_moe_layers: int


@dataclass(frozen=True)
class StepBytes:
    non_expert: int
    embedding: int
    routed_experts: float  # expected over uniform routing
    kv_cache: int

    @property
    def total(self) -> float:
        return self.non_expert + self.embedding + self.routed_experts + self.kv_cache


def weight_bytes(cfg: ModelConfig) -> WeightBytes:
    """Classify every parameter of the model (all experts local, no TP) by its name."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg, build_op_table(KernelConfig(), "cpu"))
    non_expert, embedding_row, routed = 0, 0, {}
    for name, param in model.named_parameters():
        nbytes = param.numel() * param.element_size()
        if name.endswith("embed_tokens.weight"):
            embedding_row = param.shape[1] * param.element_size()
        elif name.endswith(_ROUTED_SUFFIXES):
            suffix = next(s for s in _ROUTED_SUFFIXES if name.endswith(s))
            routed[suffix] = routed.get(suffix, 0) + nbytes // param.shape[0]
        else:
            non_expert += nbytes
    num_moe = cfg.num_moe_layers
    per_expert = sum(routed.values()) // num_moe if num_moe else 0
    return WeightBytes(non_expert, embedding_row, per_expert, num_moe)


def expected_experts_touched(num_experts: int, top_k: int, num_tokens: int) -> float:
    """E * (1 - (1 - K/E)^B): experts with at least one of B tokens, each picking K of E."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def decode_step_bytes(cfg: ModelConfig, num_seqs: int, context: float) -> StepBytes:
    """Bytes one decode step of num_seqs sequences reads, each attending over `context`
    cached positions (per layer, latent_dim values in the model's dtype)."""
    weights = weight_bytes(cfg)
    touched = expected_experts_touched(cfg.n_routed_experts, cfg.num_experts_per_tok, num_seqs)
    elem = torch.finfo(TORCH_DTYPES[cfg.dtype]).bits // 8
    kv = num_seqs * context * cfg.num_hidden_layers * cfg.latent_dim * elem
    return StepBytes(
        non_expert=weights.non_expert,
        embedding=num_seqs * weights.embedding_row,
        routed_experts=weights.num_moe_layers * touched * weights.routed_expert,
        kv_cache=int(kv),
    )


def copy_bandwidth(device: torch.device, nbytes: int = 2**30, repeats: int = 7) -> float:
    """Bytes/s of a device copy of an nbytes buffer, counting the read and the write: the
    ceiling a step's reads are measured against. CUDA: do_bench median (CUDA events); CPU:
    median of `repeats` timed copies."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        import triton.testing

        seconds = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1e3
    else:
        dst.copy_(src)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
    return 2 * nbytes / seconds
