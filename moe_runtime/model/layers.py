"""Weight-holding building blocks that run through the kernel op table.

Parameter names follow HF DeepSeek checkpoints (`.weight`), so a state dict maps directly.
Every reducing op goes through `ops`, which is the batch-invariant table or the fast one.
`RowParallelLinear` is the one place a TP-split K is summed over the TP ranks (o_proj, and
down_proj of the dense MLP and shared experts), by the table's `row_parallel_linear`.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import OpTable
from moe_runtime.model.tensor_parallel import TensorParallel

NO_TP = TensorParallel()


class Linear(nn.Module):
    """y = x W^T, no bias. weight [OUT, IN]; with TP a column-parallel linear holds this rank's
    OUT rows of a whole weight of `whole_out_features` rows (the K split of the invariant
    kernel follows the whole weight: the same bits at every TP degree)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ops: OpTable,
        dtype: torch.dtype,
        whole_out_features: int | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        self.ops = ops
        self.whole_out_features = whole_out_features or out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, whole_out_dim=self.whole_out_features)


class RowParallelLinear(nn.Module):
    """y = sum over the TP ranks of x W^T: weight [OUT, IN_local], this rank's adjacent slice of
    the full IN. The same bits at every TP degree in invariant mode (kernels/tp_linear.py).
    Collective with tp.size > 1: every TP rank calls forward in layer order."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ops: OpTable,
        dtype: torch.dtype,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        self.ops, self.tp = ops, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.row_parallel_linear(x, self.weight, self.ops.row_parallel_linear)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: OpTable, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual x, delta [T, D] -> (x + delta, its norm): one op (one launch on CUDA)."""
        return self.ops.add_rms_norm(x, delta, self.weight, self.eps)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense MLP and the shared experts.

    With TP the intermediate dim is split; down_proj is row-parallel (summed over the TP ranks).
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        ops: OpTable,
        dtype: torch.dtype,
        tp: TensorParallel = NO_TP,
    ) -> None:
        super().__init__()
        local = tp.split(intermediate, "the MLP intermediate size")
        self.gate_proj = Linear(hidden, local, ops, dtype, intermediate)
        self.up_proj = Linear(hidden, local, ops, dtype, intermediate)
        self.down_proj = RowParallelLinear(local, hidden, ops, dtype, tp)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_proj(x), self.up_proj(x)))
