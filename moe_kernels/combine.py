"""Sums of partial results on the token path: the MoE combine over top-k slots, the TP sum.

The invariant versions add in one fixed order (slot order, rank order) with elementwise fp32
ops, so a row's bits ignore the batch, the arrival order and the message size; the fast
versions are what a plain engine does. No collective runs here: comm/ hands in its all_gather
and all_reduce, and the op picks which one does the arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Collective = Callable[[torch.Tensor], torch.Tensor]
Gather = Callable[[torch.Tensor], list[torch.Tensor]]


def moe_combine_ref(
    rows: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    row_of_slot: torch.Tensor | None = None,
) -> torch.Tensor:
    """rows [N, D] in arrival order, slot_ids [N] int64: each row's flat slot m * K + k (each at
    most once), weights [M, K] fp32 -> out [M, D] fp32, out[m] = sum_k weights[m, k] * row(m, k),
    k ascending; an absent slot adds 0. row_of_slot [M*K] int64, optional: slot_ids' inverse
    (each slot's row, -1 if absent) where the caller has it already (the dispatch layout); the
    Triton kernel then skips deriving it, the torch versions index by slot_ids alone."""
    m, k = weights.shape
    y = rows.new_zeros(m * k, rows.shape[1])
    y[slot_ids] = rows  # index assignment back to (m, k) order: a permutation, no arithmetic
    y = y.view(m, k, rows.shape[1]).float()  # explicit D: M may be 0
    out = weights[:, 0:1] * y[:, 0]
    for slot in range(1, k):  # why: one summation order whatever the placement or batch
        out = out + weights[:, slot : slot + 1] * y[:, slot]
    return out


def moe_combine_fast(
    rows: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    row_of_slot: torch.Tensor | None = None,
) -> torch.Tensor:
    """moe_combine_ref's signature; index_add_ accumulates in arrival order (atomics on CUDA),
    so the bits follow the placement that decided the arrival order."""
    m, k = weights.shape
    weighted = rows.float() * weights.reshape(-1)[slot_ids, None]
    out = torch.zeros(m, rows.shape[1], dtype=torch.float32, device=rows.device)
    return out.index_add_(0, slot_ids // k, weighted)


def moe_output_ref(
    routed: torch.Tensor, shared: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """The MoE layer's output on the residual stream: residual [T, D] + (routed [T, D] (the
    fp32 combine, or already in residual's dtype) rounded to residual's dtype + shared [T, D]
    or None). Elementwise, each step rounded to residual's dtype in this order."""
    moe = routed.to(residual.dtype)
    if shared is not None:
        moe = moe + shared
    return residual + moe


def moe_combine_output_composed(
    rows: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    shared: torch.Tensor | None,
    residual: torch.Tensor,
    row_of_slot: torch.Tensor | None = None,
    *,
    moe_combine: Callable,
    moe_output: Callable,
) -> torch.Tensor:
    """moe_output(moe_combine(rows, slot_ids, weights, row_of_slot), shared, residual): the
    combine and the MoE output as one op of the table (one launch on CUDA, where the Triton
    kernel does both). moe_combine, moe_output: the table's ops."""
    return moe_output(moe_combine(rows, slot_ids, weights, row_of_slot), shared, residual)


def sum_over_ranks_ref(x: torch.Tensor, all_gather: Gather, all_reduce: Collective) -> torch.Tensor:
    """Sum of every rank's x (same shape and dtype): all_gather(x) -> [R] parts in rank order,
    added one elementwise add at a time with at least fp32 accumulation, so element i depends
    only on the ranks' element i (R times a ring's bytes: for TP's small activations)."""
    parts = all_gather(x)
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    acc = parts[0].to(acc_dtype)
    for part in parts[1:]:  # why: rank order, never the backend's size-dependent ring/tree
        acc = acc + part.to(acc_dtype)
    return acc.to(x.dtype)


def sum_over_ranks_fast(
    x: torch.Tensor, all_gather: Gather, all_reduce: Collective
) -> torch.Tensor:
    """The backend's own all_reduce: ring/tree/chunking chosen by message size."""
    return all_reduce(x)
