"""DeepSeekMoE: router, routed experts and shared experts on one rank.

Invariant path: (token, slot) pairs are grouped by expert with a stable sort (so inside an
expert rows stay in (token, slot) order), each expert's rows run through the grouped GEMM whose
per-row result ignores the other rows, results are placed back by index assignment and summed on
the token in fp32 in top-k slot order. No float index_add_/scatter_add_ (unordered accumulation).
Fast path: the same routing, summed with index_add_ (the negative control).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import OpTable
from moe_runtime.model.layers import GatedMLP
from moe_runtime.model_config import ModelConfig


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: OpTable) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(cfg.n_routed_experts, cfg.hidden_size), requires_grad=False
        )
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(cfg.n_routed_experts), requires_grad=False
            )
        else:
            self.e_score_correction_bias = None
        self.cfg, self.ops = cfg, ops

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> topk_ids [T, K] int64, topk_weights [T, K] fp32 (router math in fp32)."""
        logits = self.ops.linear(x.float(), self.weight.float())
        cfg = self.cfg
        return self.ops.router_topk(
            logits,
            self.e_score_correction_bias,
            top_k=cfg.num_experts_per_tok,
            num_groups=cfg.n_group,
            topk_group=cfg.topk_group,
            scoring_func=cfg.scoring_func,
            topk_method=cfg.topk_method,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
        )


class Experts(nn.Module):
    """Routed experts stacked by local slot: gate_up_proj [L, 2I, D], down_proj [L, D, I]."""

    def __init__(
        self, num_local: int, hidden: int, intermediate: int, ops: OpTable, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_local, 2 * intermediate, hidden, dtype=dtype), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_local, hidden, intermediate, dtype=dtype), requires_grad=False
        )
        self.ops = ops

    def forward(self, rows: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
        """rows [N, D] sorted by local expert (group_sizes [L] host ints) -> [N, D]."""
        gate, up = self.ops.grouped_linear(rows, self.gate_up_proj, group_sizes).chunk(2, dim=-1)
        return self.ops.grouped_linear(
            self.ops.silu(gate) * up, self.down_proj, group_sizes
        )


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: OpTable, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = Router(cfg, ops)
        self.experts = Experts(
            cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, ops, dtype
        )
        if cfg.n_shared_experts:
            self.shared_experts = GatedMLP(
                cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, ops, dtype
            )
        else:
            self.shared_experts = None
        self.num_experts, self.ops = cfg.n_routed_experts, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.gate(x)
        routed = self.routed(x, topk_ids, topk_weights)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)

    def routed(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        t, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        # Stable sort: rows of one expert keep (token, slot) order, whatever the batch holds.
        order = torch.sort(flat_ids, stable=True).indices
        # Host sync: the group sizes drive the per-expert GEMM loop.
        group_sizes = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        y_sorted = self.experts(x[order // k], group_sizes)
        if self.ops.mode == "fast":
            out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
            weighted = y_sorted.float() * topk_weights.reshape(-1)[order, None]
            return out.index_add_(0, order // k, weighted).to(x.dtype)
        return combine_in_slot_order(y_sorted, order, topk_weights).to(x.dtype)


def combine_in_slot_order(
    y_sorted: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * y[t, k] in fp32, k ascending. y_sorted [T*K, D] in `order`."""
    t, k = topk_weights.shape
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted  # index assignment back to (token, slot) order
    y = y.view(t, k, -1).float()
    out = topk_weights[:, 0:1] * y[:, 0]
    for slot in range(1, k):  # why: a fixed summation order, the same on every layout
        out = out + topk_weights[:, slot : slot + 1] * y[:, slot]
    return out
