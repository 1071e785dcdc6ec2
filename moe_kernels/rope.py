"""Rotary embedding of the MLA rope channels as one elementwise op of the op table.

out = (x1 cos - x2 sin, x2 cos + x1 sin) with cos/sin looked up by each token's absolute
position and cast to x's dtype; pairs are interleaved (x0, x1), (x2, x3), ... or rotate-half
(x_i, x_{i+R/2}). Each product, difference and sum is rounded to x's dtype, as torch's
elementwise ops do. `rope_triton` (one launch instead of ~11, CUDA) takes the same steps but
was measured one bf16 rounding off these bits on some elements, so CPU and CUDA runs differ
here as they do elsewhere. A token's rotation depends on its position only: batch-invariant
by construction, in both.
"""

from __future__ import annotations

import torch


def rope_ref(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    is_interleaved: bool,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H, R], positions [T] int64, cos/sin tables [S, R/2] fp32 -> [T, H, R]
    (rotated first halves, then second halves); written into `out` (any strides, e.g. a
    slice of a wider buffer) and returned when given."""
    cos = cos_table[positions].to(x.dtype)[:, None, :]
    sin = sin_table[positions].to(x.dtype)[:, None, :]
    if is_interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    result = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return result if out is None else out.copy_(result)
