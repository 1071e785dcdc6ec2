"""MoE router top-k with DeepSeek-V2 and DeepSeek-V3 semantics (as in transformers 5.x).

Scores are softmax (V2) or sigmoid (V3) of fp32 logits. Selection: greedy top-k, V2's
group_limited_greedy (group score = max in group) or V3's noaux_tc (choice = scores + bias,
group score = sum of the group's top 2). Only `topk_group` groups stay eligible. Weights are
the unbiased scores of the chosen experts, optionally normalised, then scaled.
Slot order is descending choice score; ties go to the lower expert (and group) id in the
invariant path. The fast path uses torch.topk and torch.sigmoid as transformers does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe_kernels.linear import linear_fast, linear_ref
from moe_kernels.tiling import pad_rows

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
TopK = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor, *, tile_rows: int) -> torch.Tensor:
    """x [T, D] (any float dtype), weight [E, D] -> fp32 logits [T, E]: the router's linear in
    fp32 (x.float() @ weight.float()^T), by the tiled reference linear."""
    return linear_ref(x.float(), weight.float(), tile_rows=tile_rows)


def is_16bit_router(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the logits come from the 16-bit GEMM with fp32 output (x and weight of one 16-bit
    dtype: every product exact in fp32), in both kernel modes on CUDA."""
    return weight.dtype != torch.float32 and x.dtype == weight.dtype


def router_logits_fast(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits; on CUDA a 16-bit x and weight of one dtype take cuBLAS's 16-bit GEMM with
    fp32 output (exact products, fp32 sums on tensor cores: what the invariant kernel does)."""
    if x.is_cuda and is_16bit_router(x, weight):
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return linear_fast(x.float(), weight.float())


def _stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Why: a stable descending sort keeps equal scores in id order: lower id wins a tie.
    values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], ids[..., :k]


def _torch_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.topk(x, k, dim=-1, sorted=True)


def _sigmoid_by_exp(x: torch.Tensor) -> torch.Tensor:
    # Why: torch.sigmoid's vectorised body and scalar tail round differently, so its bits
    # depend on an element's offset in the tensor; exp and division have no such split.
    return 1.0 / (1.0 + torch.exp(-x))


def _route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    routing: tuple[int, int, int, str, str, bool],
    scale: float,
    topk: TopK,
    sigmoid: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """routing: (top_k, num_groups, topk_group, scoring_func, topk_method, norm_topk_prob)."""
    top_k, num_groups, topk_group, scoring_func, topk_method, norm_topk_prob = routing
    num_tokens, num_experts = logits.shape
    if scoring_func == "softmax":
        scores = torch.softmax(logits.float(), dim=-1)
    else:
        scores = sigmoid(logits.float())
    choice = scores if bias is None else scores + bias
    if topk_method != "greedy":
        grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)
        if topk_method == "group_limited_greedy":
            group_scores = grouped.amax(-1)
        else:
            group_scores = topk(grouped, 2)[0].sum(-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, topk(group_scores, topk_group)[1], True)
        eligible = kept[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~eligible, float("-inf"))
    topk_ids = topk(choice, top_k)[1]
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
    return topk_ids, topk_weights * scale


def _check(logits, top_k, num_groups, topk_group, scoring_func, topk_method):
    num_experts = logits.shape[1]
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")
    if topk_method not in TOPK_METHODS:
        raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {topk_method!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if topk_method != "greedy" and (num_experts % num_groups or not 1 <= topk_group <= num_groups):
        raise ValueError(
            f"num_groups={num_groups} must divide {num_experts} experts and "
            f"topk_group={topk_group} must be in [1, num_groups]"
        )


def router_topk_fast(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    top_k: int,
    num_groups: int,
    topk_group: int,
    scoring_func: str,
    topk_method: str,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    id_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """logits [T, E] fp32, bias [E] or None -> topk_ids [T, K] int64, topk_weights [T, K] fp32;
    with id_map [M] int64 (e.g. a logical -> physical expert table) also mapped_ids [T, K] =
    id_map[topk_ids], appended as a third output."""
    routing = (top_k, num_groups, topk_group, scoring_func, topk_method, norm_topk_prob)
    _check(logits, top_k, num_groups, topk_group, scoring_func, topk_method)
    routed = _route(logits, bias, routing, routed_scaling_factor, _torch_topk, torch.sigmoid)
    return with_mapped_ids(*routed, id_map)


def with_mapped_ids(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, id_map: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """(topk_ids, topk_weights), plus id_map[topk_ids] when an id map is given."""
    if id_map is None:
        return topk_ids, topk_weights
    return topk_ids, topk_weights, id_map[topk_ids]


def router_topk_ref(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    top_k: int,
    num_groups: int,
    topk_group: int,
    scoring_func: str,
    topk_method: str,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    tile_rows: int,
    id_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """router_topk_fast's contract (and id_map), invariant: stable top-k, ties to the lower id."""
    routing = (top_k, num_groups, topk_group, scoring_func, topk_method, norm_topk_prob)
    _check(logits, top_k, num_groups, topk_group, scoring_func, topk_method)
    # Why: fixed [tile_rows, E] tiles fix the softmax/sum reduction plans for every row.
    tiles = pad_rows(logits, tile_rows).split(tile_rows)
    scale = routed_scaling_factor
    routed = [_route(t, bias, routing, scale, _stable_topk, _sigmoid_by_exp) for t in tiles]
    num_tokens = logits.shape[0]
    topk_ids = torch.cat([ids for ids, _ in routed])[:num_tokens]
    topk_weights = torch.cat([weights for _, weights in routed])[:num_tokens]
    return with_mapped_ids(topk_ids, topk_weights, id_map)
