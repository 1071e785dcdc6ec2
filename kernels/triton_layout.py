"""The MoE dispatch layout of a decode-sized step as one Triton program (GPU path).

From the flat physical expert ids [N] of a step's (token, slot) rows: the rows per expert, and
the order that lists rows by expert, then by row index (a stable sort's order exactly). A row's
place is its expert's first place plus how many earlier rows chose that expert: integer counts
and comparisons only, exact. One launch instead of ~14 small torch ones; for large N (prefill)
`comm.dispatch` sorts instead. Under TRITON_INTERPRET=1 it runs on CPU tensors.
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
    experts = tl.arange(0, BLOCK_E)
    rows = tl.arange(0, BLOCK_N)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int64)
    for start in range(0, num_rows, BLOCK_N):
        ids = tl.load(ids_ptr + start + rows, mask=start + rows < num_rows, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int64), 0)
    tl.store(counts_ptr + experts, counts, mask=experts < num_experts)
    first = tl.cumsum(counts, 0) - counts  # each expert's first place
    seen = tl.zeros((BLOCK_E,), dtype=tl.int64)  # rows of each expert in earlier chunks
    for start in range(0, num_rows, BLOCK_N):
        is_row = start + rows < num_rows
        ids = tl.load(ids_ptr + start + rows, mask=is_row, other=-1)
        is_mine = ids[:, None] == experts[None, :]
        base = tl.sum(tl.where(is_mine, (first + seen)[None, :], 0), 1)
        earlier_same = (ids[:, None] == ids[None, :]) & (rows[None, :] < rows[:, None])
        place = base + tl.sum(earlier_same.to(tl.int64), 1)
        tl.store(order_ptr + place, (start + rows).to(tl.int64), mask=is_row)
        seen += tl.sum(is_mine.to(tl.int64), 0)


def expert_layout_triton(
    flat_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """flat_ids [N] int64 (all in [0, num_experts)) -> (order [N] int64: row indices by expert
    then row, rows_per_expert [num_experts] int64). No host sync."""
    order = torch.empty_like(flat_ids)
    counts = torch.empty(num_experts, dtype=torch.int64, device=flat_ids.device)
    _layout_kernel[(1,)](
        flat_ids.contiguous(),
        order,
        counts,
        flat_ids.numel(),
        num_experts,
        BLOCK_N=BLOCK_N,
        BLOCK_E=max(triton.next_power_of_2(num_experts), 16),
    )
    return order, counts
