"""The MoE combine as one Triton kernel (GPU path of `moe_combine_ref`, moe_kernels/combine.py).

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

from moe_kernels.triton_moe_output import check_moe_output, moe_output_value
from moe_kernels.triton_pdl import pdl_launch, pdl_start

BLOCK_D = 512


@triton.jit
def _combine_kernel(
    rows_ptr,
    row_of_slot_ptr,
    weights_ptr,
    out_ptr,
    shared_ptr,
    residual_ptr,
    D,
    K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_OUTPUT: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out[m] = the fp32 combine of token m; IS_OUTPUT: the MoE output of it instead
    (moe_output_value, in out's dtype), with shared (HAS_SHARED) and residual [M, D]."""
    pdl_start(PDL)
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
    offs = m * D + cols
    if IS_OUTPUT:
        out = moe_output_value(
            acc, shared_ptr, residual_ptr, offs, col_ok, HAS_SHARED, out_ptr.dtype.element_ty
        )
        tl.store(out_ptr + offs, out, mask=col_ok)
    else:
        tl.store(out_ptr + offs, acc, mask=col_ok)


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
    out = torch.empty((weights.shape[0], rows.shape[1]), dtype=torch.float32, device=rows.device)
    return _launch(rows, slot_ids, weights, row_of_slot, out, None, None)


def moe_combine_output_triton(
    rows: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    shared: torch.Tensor | None,
    residual: torch.Tensor,
    row_of_slot: torch.Tensor | None = None,
) -> torch.Tensor:
    """moe_combine_output_composed's contract (moe_kernels/combine.py) in one launch: each token's
    combine, then moe_output_triton's roundings in its order (the same jit helper), so the bits
    of the two kernels it replaces. residual [M, D]; shared [M, D] in its dtype or None."""
    check_moe_output(None, shared, residual)
    if residual.shape != (weights.shape[0], rows.shape[1]):
        raise ValueError(
            f"residual must be [{weights.shape[0]}, {rows.shape[1]}] (tokens, rows' width), got "
            f"{tuple(residual.shape)}"
        )
    residual = residual.contiguous()
    shared = None if shared is None else shared.contiguous()
    return _launch(
        rows, slot_ids, weights, row_of_slot, torch.empty_like(residual), shared, residual
    )


def _launch(rows, slot_ids, weights, row_of_slot, out, shared, residual) -> torch.Tensor:
    """One combine launch into out [M, D]: fp32 sums, or (residual given) the MoE output."""
    num_tokens, top_k = weights.shape
    dim = rows.shape[1]
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
        out if shared is None else shared,  # unread without HAS_SHARED
        out if residual is None else residual,  # unread without IS_OUTPUT
        dim,
        K=top_k,
        BLOCK_D=BLOCK_D,
        IS_OUTPUT=residual is not None,
        HAS_SHARED=shared is not None,
        **pdl_launch(rows.device),
    )
    return out
