"""SiLU, the gated-MLP activation, in a form whose bits do not depend on tensor shape.

On this CPU `F.silu` (like `torch.sigmoid`) rounds differently in its vectorised body and its
scalar tail, so an element's bits depend on its offset in the tensor, and so on the batch.
`exp` and IEEE division have no such split: `silu_ref` is built from them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


def silu_ref(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), elementwise, any shape; fp32 math for low-precision inputs."""
    xf = x.float()
    return (xf / (1.0 + torch.exp(-xf))).to(x.dtype)


def silu_fast(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's silu(gate) * up: silu_ref, then one multiply in the inputs' dtype."""
    return silu_ref(gate) * up


def silu_mul_fast(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def grouped_gated_linear_composed(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_sizes: Sequence[int] | torch.Tensor,
    *,
    row_index: torch.Tensor | None = None,
    grouped_linear: Callable,
    silu_mul: Callable,
) -> torch.Tensor:
    """The experts' gated up projection: weight [L, 2I, IN] holds each group's gate rows then
    its up rows; rows of x (or x[row_index]) sorted by group -> silu(gate) * up [N, I], as the
    table's grouped_linear and silu_mul compute them (on CUDA one Triton launch does both)."""
    gate, up = grouped_linear(x, weight, group_sizes, row_index=row_index).chunk(2, dim=-1)
    return silu_mul(gate, up)
