"""Batch-invariant MoE router top-k as one Triton kernel (GPU path).

Contract of `router_topk_ref` (moe_kernels/router.py): fp32 softmax (V2) or sigmoid (V3) scores,
greedy / group_limited_greedy / noaux_tc selection, only `topk_group` groups eligible, weights
the unbiased scores of the chosen experts, optionally normalised, then scaled; slot order is
descending choice score and every tie goes to the lower expert (and group) id.
One program per token row holds the whole row of E experts; every reduction (softmax max and
sum, group scores, the weight sum) is over a fixed-width block fixed by E, K and the group
count alone, so a row's bits never depend on the other rows. Top-k is K rounds of "largest
value, lowest id among equals", which is exact. Under TRITON_INTERPRET=1 it runs on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from moe_kernels.router import _check, is_16bit_router
from moe_kernels.triton_linear import linear_triton
from moe_kernels.triton_pdl import pdl_launch, pdl_start

MAX_EXPERTS = 4096


@triton.jit
def _argmax_lowest(values, ids, is_free, NONE: tl.constexpr):
    """Id of the largest free value, the lowest id among equals (exact, no arithmetic)."""
    best = tl.max(tl.where(is_free, values, float("-inf")), axis=0)
    return tl.min(tl.where(is_free & (values == best), ids, NONE), axis=0)


@triton.jit
def _router_topk_kernel(
    logits_ptr,
    bias_ptr,
    id_map_ptr,
    ids_ptr,
    weights_ptr,
    mapped_ptr,
    num_experts,
    group_size,
    num_groups,
    scaling,
    TOP_K: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MAP: tl.constexpr,
    IS_SIGMOID: tl.constexpr,
    METHOD: tl.constexpr,  # 0 greedy, 1 group_limited_greedy, 2 noaux_tc
    NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + row * num_experts + experts, mask=valid, other=float("-inf"))
    if IS_SIGMOID:
        # Why: exp and one IEEE division, the formula of the reference's _sigmoid_by_exp.
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        shifted = tl.exp(logits - tl.max(logits, axis=0))
        scores = shifted / tl.sum(shifted, axis=0)
    scores = tl.where(valid, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + experts, mask=valid, other=0.0)
    is_free = valid
    if METHOD != 0:
        group_of = experts // group_size
        groups = tl.arange(0, BLOCK_G)
        group_scores = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        for g in range(0, num_groups):
            in_group = valid & (group_of == g)
            top1 = _argmax_lowest(choice, experts, in_group, BLOCK_E)
            score = tl.max(tl.where(in_group, choice, float("-inf")), axis=0)
            if METHOD == 2:  # sum of the group's top 2
                top2 = _argmax_lowest(choice, experts, in_group & (experts != top1), BLOCK_E)
                score = score + tl.max(tl.where(experts == top2, choice, float("-inf")), axis=0)
            group_scores = tl.where(groups == g, score, group_scores)
        group_free = groups < num_groups
        is_free = valid & (experts < 0)
        for _ in tl.static_range(TOPK_GROUP):
            kept = _argmax_lowest(group_scores, groups, group_free, BLOCK_G)
            group_free = group_free & (groups != kept)
            is_free = is_free | (valid & (group_of == kept))
    slots = tl.arange(0, BLOCK_K)
    topk_ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    topk_weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    # Ineligible experts stay choosable (as the reference's -inf masking): only after all
    # eligible ones, lowest id first.
    eligible = is_free
    choice = tl.where(eligible, choice, float("-inf"))
    is_free = valid
    for k in tl.static_range(TOP_K):
        chosen = _argmax_lowest(choice, experts, is_free, BLOCK_E)
        is_free = is_free & (experts != chosen)
        weight = tl.sum(tl.where(experts == chosen, scores, 0.0), axis=0)
        topk_ids = tl.where(slots == k, chosen, topk_ids)
        topk_weights = tl.where(slots == k, weight, topk_weights)
    if NORMALIZE:
        topk_weights = topk_weights / (tl.sum(topk_weights, axis=0) + 1e-20)
    slot_ok = slots < TOP_K
    tl.store(ids_ptr + row * TOP_K + slots, topk_ids.to(tl.int64), mask=slot_ok)
    tl.store(weights_ptr + row * TOP_K + slots, topk_weights * scaling, mask=slot_ok)
    if HAS_MAP:  # the id map's gather, here rather than in a launch of its own
        mapped = tl.load(id_map_ptr + topk_ids, mask=slot_ok, other=0)
        tl.store(mapped_ptr + row * TOP_K + slots, mapped.to(tl.int64), mask=slot_ok)


def router_logits_triton(
    x: torch.Tensor, weight: torch.Tensor, *, arrivals: torch.Tensor | None = None
) -> torch.Tensor:
    """router_logits_ref's contract: x [T, D] (bf16, fp16 or fp32), weight [E, D] -> fp32 logits
    [T, E]. A 16-bit weight against an x of its dtype (the model's router): the 16-bit linear's
    tensor-core dots with fp32 output. Every product of two 16-bit floats is exact in fp32, so
    these are the fp32 logits of x.float() @ weight.float()^T up to the order and rounding of
    the fp32 adds, fixed by the linear's K steps and K split (batch-invariant like every
    linear); ~10x faster than CUDA-core fp32 FMAs at prefill rows. An fp32 weight: linear_triton's
    fp32 GEMM (ieee products), a 16-bit x upcast in registers rather than by x.float()'s copy
    launch. arrivals: linear_triton's."""
    if is_16bit_router(x, weight):
        return linear_triton(x, weight, arrivals=arrivals, out_dtype=torch.float32)
    return linear_triton(x, weight.float(), arrivals=arrivals)


_METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


def router_topk_triton(
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
    """logits [T, E] fp32, bias [E] fp32 or None -> topk_ids [T, K] int64, topk_weights [T, K]
    fp32; with id_map [M >= E] int64 on logits' device, also mapped_ids [T, K] int64 =
    id_map[topk_ids] (the MoE's logical -> physical slot table), written by the same launch."""
    allowed = ("cpu", "cuda") if isinstance(_router_topk_kernel, InterpretedFunction) else ("cuda",)
    if logits.device.type not in allowed:
        raise ValueError(f"logits must be on a device of type {allowed}, got {logits.device}")
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be [T, E] fp32, got {tuple(logits.shape)} {logits.dtype}")
    if bias is not None and (bias.shape != logits.shape[1:] or bias.device != logits.device):
        raise ValueError(
            f"bias must be [{logits.shape[1]}] on {logits.device}, got {tuple(bias.shape)} "
            f"on {bias.device}"
        )
    _check(logits, top_k, num_groups, topk_group, scoring_func, topk_method)
    num_tokens, num_experts = logits.shape
    if id_map is not None and (
        id_map.dim() != 1
        or id_map.shape[0] < num_experts
        or id_map.dtype != torch.int64
        or id_map.device != logits.device
    ):
        raise ValueError(
            f"id_map must be [>= {num_experts}] int64 on {logits.device}, got "
            f"{tuple(id_map.shape)} {id_map.dtype} on {id_map.device}"
        )
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"at most {MAX_EXPERTS} experts per router row, got {num_experts}")
    topk_ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=logits.device)
    topk_weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=logits.device)
    mapped_ids = torch.empty_like(topk_ids) if id_map is not None else None
    outputs = (topk_ids, topk_weights) if id_map is None else (topk_ids, topk_weights, mapped_ids)
    if num_tokens == 0:
        return outputs
    is_grouped = topk_method != "greedy"
    logits = logits.contiguous()
    _router_topk_kernel[(num_tokens,)](
        logits,
        bias.float().contiguous() if bias is not None else logits,  # never read without bias
        id_map.contiguous() if id_map is not None else topk_ids,  # never read without a map
        topk_ids,
        topk_weights,
        mapped_ids if id_map is not None else topk_ids,  # never written without a map
        num_experts,
        num_experts // num_groups if is_grouped else num_experts,
        num_groups if is_grouped else 1,
        float(routed_scaling_factor),
        TOP_K=top_k,
        TOPK_GROUP=topk_group if is_grouped else 1,
        HAS_BIAS=bias is not None,
        HAS_MAP=id_map is not None,
        IS_SIGMOID=scoring_func == "sigmoid",
        METHOD=_METHODS[topk_method],
        NORMALIZE=norm_topk_prob,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_G=triton.next_power_of_2(num_groups if is_grouped else 1),
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4,
        **pdl_launch(logits.device),
    )
    return outputs
