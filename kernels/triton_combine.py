"""The MoE combine as one Triton kernel (GPU path of `moe_combine_ref`, kernels/combine.py).

out[m] = sum over k ascending of weights[m, k] * row(m, k) in fp32, an absent slot adding 0:
one program per (token, column block) walks its K slots in order, so a token's bits depend on
its own rows and weights only, never on the batch, the arrival order or the placement. The
torch reference takes ~14 small launches per layer (scatter, cast, a multiply and an add per
slot); this is 3 small torch ops (the slot -> row map) and one kernel. The compiler may fuse a
multiply and an add into an FMA, so the bits can differ from the torch reference's two
roundings; every CUDA path calls this same kernel. Under TRITON_INTERPRET=1 it runs on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_D = 512


@triton.jit
def _combine_kernel(
    rows_ptr, row_of_slot_ptr, weights_ptr, out_ptr, D, K: tl.constexpr, BLOCK_D: tl.constexpr
):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    # Why: slots added one at a time, k ascending, whatever the placement or the batch.
    for k in tl.static_range(K):
        row = tl.load(row_of_slot_ptr + m * K + k)
        weight = tl.load(weights_ptr + m * K + k)
        y = tl.load(rows_ptr + row * D + cols, mask=col_ok & (row >= 0), other=0.0)
        acc = acc + weight * y.to(tl.float32)
    tl.store(out_ptr + m * D + cols, acc, mask=col_ok)


def moe_combine_triton(
    rows: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    row_of_slot: torch.Tensor | None = None,
) -> torch.Tensor:
    """moe_combine_ref's contract: rows [N, D] in arrival order, slot_ids [N] int64 (each row's
    flat slot m * K + k, each at most once), weights [M, K] fp32 -> out [M, D] fp32.
    row_of_slot [M*K] int64 (slot_ids' inverse, -1 where absent), when given, is trusted and
    read instead of slot_ids: the kernel alone, no launches to derive it."""
    num_tokens, top_k = weights.shape
    dim = rows.shape[1]
    out = torch.empty((num_tokens, dim), dtype=torch.float32, device=rows.device)
    if num_tokens == 0:
        return out
    if row_of_slot is None:
        # Index assignment (a permutation, no arithmetic): the row holding each slot, -1 if none.
        row_of_slot = torch.full((num_tokens * top_k,), -1, dtype=torch.int64, device=rows.device)
        row_of_slot[slot_ids] = torch.arange(slot_ids.numel(), device=rows.device)
    elif row_of_slot.shape != (num_tokens * top_k,) or row_of_slot.dtype != torch.int64:
        raise ValueError(
            f"row_of_slot must be [{num_tokens * top_k}] int64, got "
            f"{tuple(row_of_slot.shape)} {row_of_slot.dtype}"
        )
    _combine_kernel[(num_tokens, triton.cdiv(dim, BLOCK_D))](
        rows.contiguous(),
        row_of_slot.contiguous(),
        weights.contiguous().float(),
        out,
        dim,
        K=top_k,
        BLOCK_D=BLOCK_D,
    )
    return out
