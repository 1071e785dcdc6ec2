"""The MoE dispatch layout of a decode-sized step as one Triton launch (GPU path).

From the flat physical expert ids [N] of a step's (token, slot) rows: the rows per expert, and
the order that lists rows by expert, then by row index (a stable sort's order exactly). A row's
place is its expert's first place plus how many earlier rows chose that expert: integer counts
and comparisons only, exact. One launch instead of ~14 small torch ones, one program per 64
rows; for large N (prefill) `comm.dispatch` sorts instead. Under TRITON_INTERPRET=1 it runs on
CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64


@triton.jit
def _layout_kernel(
    ids_ptr,
    order_ptr,
    counts_ptr,
    num_rows,
    num_experts,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Program c places the rows of chunk c (BLOCK_N rows). It counts every chunk's rows per
    expert (all of them: each expert's first place; those before c: its rows already placed)
    so the programs need nothing from each other; program 0 stores the counts."""
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
    tl.store(order_ptr + place, (start + rows).to(tl.int64), mask=is_row)


def expert_layout_triton(
    flat_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """flat_ids [N] int64 (all in [0, num_experts)) -> (order [N] int64: row indices by expert
    then row, rows_per_expert [num_experts] int64). No host sync; one program per BLOCK_N rows
    (integer counts: exact whichever program does them)."""
    order = torch.empty_like(flat_ids)
    counts = torch.empty(num_experts, dtype=torch.int64, device=flat_ids.device)
    _layout_kernel[(max(1, triton.cdiv(flat_ids.numel(), BLOCK_N)),)](
        flat_ids.contiguous(),
        order,
        counts,
        flat_ids.numel(),
        num_experts,
        BLOCK_N=BLOCK_N,
        BLOCK_E=max(triton.next_power_of_2(num_experts), 16),
    )
    return order, counts
