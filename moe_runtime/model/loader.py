"""Model weights: HF DeepSeek-V2/V3 safetensors checkpoints, or random weights from a seed.

HF names map one to one except the routed experts, stored per expert in checkpoints
(`mlp.experts.{e}.gate_proj.weight`, ...) and stacked here by local slot
(`mlp.experts.gate_up_proj [L, 2I, D]`, `mlp.experts.down_proj [L, D, I]`).
`local_experts [L_moe][slots]` lists the logical expert each local slot holds per MoE layer, so
a rank loads only its own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

from kernels import OpTable
from moe_runtime.model.deepseek import DeepseekForCausalLM
from moe_runtime.model.layers import NO_TP
from moe_runtime.model.tensor_parallel import TensorParallel
from moe_runtime.model_config import ModelConfig

_EXPERT_KEY = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def build_model(
    cfg: ModelConfig,
    ops: OpTable,
    device: torch.device | str = "cpu",
    local_experts: Sequence[Sequence[int]] | None = None,
    tp: TensorParallel = NO_TP,
) -> DeepseekForCausalLM:
    num_moe = cfg.num_moe_layers
    if local_experts is None:
        local_experts = [range(cfg.n_routed_experts)] * num_moe
    local_experts = [[int(e) for e in row] for row in local_experts]
    if len(local_experts) != num_moe or len({len(row) for row in local_experts}) > 1:
        raise ValueError(f"local_experts must hold one equal-length row per MoE layer ({num_moe})")
    model = DeepseekForCausalLM(cfg, ops, len(local_experts[0]) if local_experts else None, tp)
    if cfg.path:
        load_hf_weights(model, Path(cfg.path), local_experts)
    else:
        init_random_weights(model, cfg.seed, cfg.init_std, local_experts)
    model.to(device)
    model.after_weights_loaded()
    return model


def init_random_weights(
    model: DeepseekForCausalLM, seed: int, std: float, local_experts: list[list[int]]
) -> None:
    """Draw every weight from `seed` in fp32 on the CPU, so any dtype/device gets the same values.

    Routed experts are drawn per logical expert, so a rank holding a subset gets the same weights.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                continue
            # Drawn at full size and then sliced: every TP degree sees the same weights.
            shape = model.tp.full_shape(name, param.shape)
            if name.endswith("norm.weight"):
                value = torch.ones(shape)
            elif name.endswith("e_score_correction_bias"):
                value = torch.rand(shape, generator=gen) * 0.2 - 0.1
            else:
                value = torch.randn(shape, generator=gen) * std
            param.copy_(model.tp.shard(name, value).to(param.dtype))
        first_moe = model.config.first_k_dense_replace
        for layer_id, layer in enumerate(model.model.layers):
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            for slot, logical in enumerate(local_experts[layer_id - first_moe]):
                expert_gen = torch.Generator().manual_seed(
                    seed * 1_000_003 + layer_id * 10_007 + logical
                )
                experts.gate_up_proj[slot].copy_(
                    torch.randn(experts.gate_up_proj.shape[1:], generator=expert_gen) * std
                )
                experts.down_proj[slot].copy_(
                    torch.randn(experts.down_proj.shape[1:], generator=expert_gen) * std
                )


def load_hf_weights(model: DeepseekForCausalLM, path: Path, local_experts: list[list[int]]) -> None:
    staged = check_weights(model, read_checkpoint(path, model.config), local_experts, str(path))
    assign_weights(model, staged)


def read_checkpoint(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory that belongs to this model, by HF name."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"weights path {str(path)!r} holds no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for key, value in load_file(str(file)).items():
            layer = _LAYER_KEY.match(key)
            if layer and int(layer.group(1)) >= cfg.num_hidden_layers:
                continue  # multi-token-prediction layers are not part of this model
            tensors[key] = value
    return tensors


def check_weights(
    model: DeepseekForCausalLM,
    tensors: dict[str, torch.Tensor],
    local_experts: list[list[int]],
    source: str,
) -> dict[str, torch.Tensor]:
    """HF-named tensors -> this rank's value of every parameter, every name, shape and dtype
    checked (ValueError naming the first bad one); the model is not touched."""
    tensors = _stack_experts(tensors, local_experts, model.config.first_k_dense_replace)
    params = dict(model.named_parameters())
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
        params.pop("lm_head.weight", None)
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"weights {source!r} do not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    values = {name: model.tp.shard(name, tensors[name]) for name in params}
    for name, param in params.items():
        value = values[name]
        if value.shape != param.shape or not value.dtype.is_floating_point:
            raise ValueError(
                f"weights {source!r}: tensor {name} is {tuple(value.shape)} {value.dtype}, the "
                f"model expects {tuple(param.shape)} floating point"
            )
    return values


def assign_weights(model: DeepseekForCausalLM, values: dict[str, torch.Tensor]) -> None:
    """Copy checked values (check_weights) into the model's parameters."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in values.items():
            params[name].copy_(value.to(params[name].dtype))


def _stack_experts(
    tensors: dict[str, torch.Tensor], local_experts: list[list[int]], first_moe: int
) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors -> stacked gate_up_proj / down_proj for the local slots."""
    per_expert: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for key, value in tensors.items():
        match = _EXPERT_KEY.match(key)
        if match is None:
            out[key] = value
            continue
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        per_expert.setdefault(prefix, {}).setdefault(expert, {})[proj] = value
    for prefix, experts in per_expert.items():
        expert_ids = local_experts[int(prefix.split(".")[2]) - first_moe]
        absent = [e for e in expert_ids if e not in experts]
        if absent:
            raise ValueError(f"checkpoint lacks {prefix}.{absent[0]}")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in expert_ids]
        )
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in expert_ids])
    return out
