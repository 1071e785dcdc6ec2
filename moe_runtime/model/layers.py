"""Weight-holding building blocks that run through the kernel op table.

Parameter names follow HF DeepSeek checkpoints (`.weight`), so a state dict maps directly.
Every reducing op goes through `ops`, which is the batch-invariant table or the fast one.
`RowParallelLinear` is the one place a TP-split K is summed over the TP ranks (down_proj of
the dense MLP; o_proj runs whole on token shares instead, mla.py), by the table's
`row_parallel_linear`.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_kernels import OpTable
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
    the full IN. The same bits at every TP degree in invariant mode (moe_kernels/tp_linear.py).
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

    gate_proj.weight and up_proj.weight (the HF names loading, updates and TP sharding use)
    are the two halves of one [2 * I_local, D] tensor, `gate_up_weight`, so gate and up run as
    one linear launch with no second copy of the weights. With TP the intermediate dim is split
    (each rank joins its own slices); down_proj is row-parallel (summed over the TP ranks).
    tp None: whole weights on this rank and a plain down_proj (the shared experts, which run
    on this rank's share of the tokens: moe.py).
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        ops: OpTable,
        dtype: torch.dtype,
        tp: TensorParallel | None = NO_TP,
    ) -> None:
        super().__init__()
        local = intermediate if tp is None else tp.split(intermediate, "the MLP intermediate size")
        self.gate_proj = Linear(hidden, local, ops, dtype, intermediate)
        self.up_proj = Linear(hidden, local, ops, dtype, intermediate)
        if tp is None:
            self.down_proj = Linear(local, hidden, ops, dtype)
        else:
            self.down_proj = RowParallelLinear(local, hidden, ops, dtype, tp)
        # Why the whole size: the joint weight's fixed K split must follow the TP-1 joint
        # weight [2 * I, D], so every TP degree gives each column the same bits.
        self.whole_gate_up_rows = 2 * intermediate
        self.ops = ops
        self.gate_up_weight = torch.empty(0)
        self.join_gate_up()

    def is_gate_up_joined(self) -> bool:
        """Whether gate_proj.weight and up_proj.weight are still the halves of gate_up_weight."""
        gate, up, joint = self.gate_proj.weight, self.up_proj.weight, self.gate_up_weight
        return (
            joint.shape[0] == gate.shape[0] + up.shape[0]
            and joint.device == gate.device == up.device
            and joint.dtype == gate.dtype == up.dtype
            and gate.data_ptr() == joint.data_ptr()
            and up.data_ptr() == joint[gate.shape[0] :].data_ptr()
        )

    def join_gate_up(self) -> None:
        """Point gate_proj.weight and up_proj.weight at the halves of one fresh joint tensor,
        values kept; a no-op while they still are. Loading and weight updates copy into the
        parameters in place, so they write the joint tensor; call this after anything that
        replaces a parameter's storage (`.to()`, assignment)."""
        if self.is_gate_up_joined():
            return
        gate, up = self.gate_proj.weight, self.up_proj.weight
        joint = torch.cat([gate.data, up.data])
        gate.data, up.data = joint[: gate.shape[0]], joint[gate.shape[0] :]
        self.gate_up_weight = joint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.ops.linear(x, self.gate_up_weight, whole_out_dim=self.whole_gate_up_rows)
        gate, up = gate_up.chunk(2, dim=-1)  # strided views: silu_mul takes row strides
        return self.down_proj(self.ops.silu_mul(gate, up))
