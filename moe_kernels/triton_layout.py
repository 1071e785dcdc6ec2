"""The MoE dispatch layout of a decode-sized step as one Triton launch (GPU path).

From the physical expert ids [T, K] of a step's (token, slot) rows, flat row r = token * K +
slot: the rows per expert, the order that lists rows by expert, then by row index (a stable
sort's order exactly), each ordered row's source token (order // K) and each row's place in the
order (the order's inverse), so neither the dispatch gather nor the combine needs launches of
its own to derive them. A row's place is its expert's first place plus how many earlier rows
chose that expert: integer counts and comparisons only, exact. One launch instead of ~14 small
torch ones, one program per 64 rows; for large N (prefill) `comm.dispatch` sorts instead.
Under TRITON_INTERPRET=1 it runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels.triton_pdl import pdl_launch, pdl_start

BLOCK_N = 64


@triton.jit
def _layout_kernel(
    ids_ptr,
    order_ptr,
    counts_ptr,
    token_ptr,
    place_ptr,
    num_rows,
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program c places the rows of chunk c (BLOCK_N rows). It counts every chunk's rows per
    expert (all of them: each expert's first place; those before c: its rows already placed)
    so the programs need nothing from each other; program 0 stores the counts."""
    pdl_start(PDL)
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    rows = tl.arange(0, BLOCK_N)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    seen = tl.zeros((BLOCK_E,), dtype=tl.int32)  # rows of each expert in chunks before c
    for start in range(0, num_rows, BLOCK_N):
        ids = tl.load(ids_ptr + start + rows, mask=start + rows < num_rows, other=-1)
        chunk_counts = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), 0)
        counts += chunk_counts
        seen += tl.where(start < chunk * BLOCK_N, chunk_counts, 0)
    if chunk == 0:
        tl.store(counts_ptr + experts, counts.to(tl.int64), mask=experts < num_experts)
    first = tl.cumsum(counts, 0) - counts  # each expert's first place
    start = chunk * BLOCK_N
    is_row = start + rows < num_rows
    ids = tl.load(ids_ptr + start + rows, mask=is_row, other=-1)
    is_mine = ids[:, None] == experts[None, :]
    base = tl.sum(tl.where(is_mine, (first + seen)[None, :], 0), 1)
    earlier_same = (ids[:, None] == ids[None, :]) & (rows[None, :] < rows[:, None])
    place = base + tl.sum(earlier_same.to(tl.int32), 1)
    row_ids = (start + rows).to(tl.int64)
    tl.store(order_ptr + place, row_ids, mask=is_row)
    tl.store(token_ptr + place, row_ids // TOP_K, mask=is_row)
    tl.store(place_ptr + row_ids, place.to(tl.int64), mask=is_row)


def expert_layout_triton(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] int64 (all in [0, num_experts)), flat row r = token * K + slot ->
    order [T*K] int64 (flat rows by expert, then row), rows_per_expert [num_experts] int64,
    token_of_row [T*K] int64 (order // K), row_of_slot [T*K] int64 (each flat row's place in
    order: order's inverse). No host sync; one program per BLOCK_N rows (integer counts:
    exact whichever program does them)."""
    if topk_ids.dim() != 2 or topk_ids.dtype != torch.int64:
        raise ValueError(
            f"topk_ids must be [T, K] int64, got {tuple(topk_ids.shape)} {topk_ids.dtype}"
        )
    flat_ids = topk_ids.reshape(-1).contiguous()
    order = torch.empty_like(flat_ids)
    token_of_row = torch.empty_like(flat_ids)
    row_of_slot = torch.empty_like(flat_ids)
    counts = torch.empty(num_experts, dtype=torch.int64, device=flat_ids.device)
    _layout_kernel[(max(1, triton.cdiv(flat_ids.numel(), BLOCK_N)),)](
        flat_ids,
        order,
        counts,
        token_of_row,
        row_of_slot,
        flat_ids.numel(),
        num_experts,
        TOP_K=topk_ids.shape[1],
        BLOCK_N=BLOCK_N,
        BLOCK_E=max(triton.next_power_of_2(num_experts), 16),
        **pdl_launch(topk_ids.device),
    )
    return order, counts, token_of_row, row_of_slot
