"""DeepSeekMoE: router, routed experts and shared experts on one rank.

Logical expert ids from the router are mapped to physical slots by a static replica table, the
dispatcher (comm/) moves (token, slot) rows to the ranks holding those slots in a fixed order,
each expert's rows run through the grouped GEMM whose per-row result ignores the other rows, and
the combine (the op table's `moe_combine`) sums every token's rows on its own rank, in fp32 in
top-k slot order in invariant mode.
"""

from __future__ import annotations

import torch
from torch import nn

from comm.dispatch import LocalDispatcher
from moe_kernels import OpTable
from moe_runtime.model.layers import GatedMLP
from moe_runtime.model.tensor_parallel import TensorParallel
from moe_runtime.model_config import ModelConfig


class Router(nn.Module):
    """The gate: weight [E, D] in the model's dtype (as DeepSeek's checkpoints store it and its
    reference code keeps it), fp32 logits. Products of two 16-bit floats are exact in fp32, so
    16-bit logits differ from the fp32 GEMM of the upcast operands only in how the fp32 adds
    round; the op table's kernel sums them on tensor cores (moe_kernels/triton_router.py)."""

    def __init__(self, cfg: ModelConfig, ops: OpTable, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype), requires_grad=False
        )
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(cfg.n_routed_experts), requires_grad=False
            )
        else:
            self.e_score_correction_bias = None
        self.cfg, self.ops = cfg, ops

    def forward(
        self, x: torch.Tensor, replica_row: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """x [T, D] -> logical topk_ids [T, K] int64, topk_weights [T, K] fp32 (router math in
        fp32); with replica_row [E] int64 also the physical slots replica_row[topk_ids] [T, K],
        mapped inside the top-k op (no launch of its own on CUDA)."""
        logits = self.ops.router_logits(x, self.weight)
        cfg = self.cfg
        return self.ops.router_topk(
            logits,
            self.e_score_correction_bias,
            top_k=cfg.num_experts_per_tok,
            num_groups=cfg.n_group,
            topk_group=cfg.topk_group,
            scoring_func=cfg.scoring_func,
            topk_method=cfg.topk_method,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
            id_map=replica_row,
        )


class Experts(nn.Module):
    """Routed experts stacked by local slot: gate_up_proj [L, 2I, D], down_proj [L, D, I]."""

    def __init__(
        self, num_local: int, hidden: int, intermediate: int, ops: OpTable, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_local, 2 * intermediate, hidden, dtype=dtype), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_local, hidden, intermediate, dtype=dtype), requires_grad=False
        )
        self.ops = ops

    def forward(
        self, rows: torch.Tensor, group_sizes: torch.Tensor, row_index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """rows [N, D] sorted by local expert (group_sizes [L] int64 on rows' device) -> [N, D];
        with row_index [N] int64 the sorted rows are rows[row_index], read in place."""
        hidden = self.ops.grouped_gated_linear(
            rows, self.gate_up_proj, group_sizes, row_index=row_index
        )
        return self.ops.grouped_linear(hidden, self.down_proj, group_sizes)


class MoE(nn.Module):
    """Router + routed experts (this rank's physical slots) + shared experts.

    `bind_expert_parallel` gives the layer its dispatcher and this rank's row of the static
    replica table (logical expert -> physical slot); until then it runs all experts locally.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        ops: OpTable,
        dtype: torch.dtype,
        num_local_slots: int,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.gate = Router(cfg, ops, dtype)
        self.experts = Experts(
            num_local_slots, cfg.hidden_size, cfg.moe_intermediate_size, ops, dtype
        )
        if cfg.n_shared_experts:
            # Why whole (tp None): each TP rank runs the shared experts on its own share of the
            # tokens, as the routed ones, so a token's shared output is one rank's plain linears
            # at every TP degree (the same bits, no fixed K tree: the plain linear's prefill
            # tiles) and the layer's one gather carries the finished rows. The price: their
            # weights are whole on every TP rank.
            self.shared_experts = GatedMLP(
                cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, ops, dtype, None
            )
        else:
            self.shared_experts = None
        self.ops, self.tp = ops, tp
        self.dispatcher = LocalDispatcher(num_local_slots, ops.moe_combine)
        self.replica_row = torch.arange(cfg.n_routed_experts, device=self.gate.weight.device)
        # Rows per local slot in the last forward ([L] int64 on the weights' device): read back
        # once per step for the expert load.
        self.last_slot_counts = torch.zeros(num_local_slots, dtype=torch.int64)
        self.last_topk_ids = torch.zeros(0, cfg.num_experts_per_tok, dtype=torch.int64)

    def bind_expert_parallel(self, dispatcher, replica_row: torch.Tensor) -> None:
        """replica_row [E] int64: the physical slot serving each logical expert from this rank."""
        self.dispatcher = dispatcher
        self.replica_row = replica_row.to(self.experts.gate_up_proj.device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Normed input x [T, D], the layer's residual [T, D] -> residual + MoE(x) [T, D]."""
        if self.tp.size == 1 and isinstance(self.dispatcher, LocalDispatcher):
            return self._forward_local(x, residual)
        # Why shares: the TP ranks of a group hold the same tokens; each dispatches its own
        # share, runs the shared experts on it and finishes its rows, and the rows are
        # gathered back, so no expert runs a token twice. A token's result does not depend on
        # which rank ran it (rows are independent in the grouped GEMM and the linears, the
        # combine sums its own slots), so the bits do not change.
        mine = self.tp.token_share(x.shape[0])
        x_mine = x[mine]
        # Why a branch: the shared experts read only this rank's share, so at decode sizes they
        # run beside the router, the exchange and the routed experts on a second stream
        # (moe_kernels/streams.py; no bit moves), filling the SMs the exchange leaves idle.
        with self.ops.branch(x.shape[0]) as side:
            shared, topk_weights, slot_ids = self._shared_beside_gate(side, x_mine, x)
            weights = topk_weights[mine]
            # Collective: every rank calls dispatch and combine once per MoE layer per step, in
            # layer order, even with zero tokens.
            recv, group_sizes, handle = self.dispatcher.dispatch(x_mine, slot_ids[mine], weights)
            self.last_slot_counts = group_sizes
            routed = self.dispatcher.combine(self.experts(recv, group_sizes), handle, weights)
        # One op (one launch on CUDA): the fp32 routed sum rounded, + shared, + residual.
        out = self.ops.moe_output(routed, shared, residual[mine])
        return self.tp.gather_shares(out, x.shape[0])

    def _shared_beside_gate(self, side, x_shared: torch.Tensor, x: torch.Tensor) -> tuple:
        """The shared experts on x_shared launched in the branch `side`, then the router on x:
        -> (shared output or None, topk_weights, slot_ids); the logical ids kept for
        routed-expert reporting."""
        shared = None if self.shared_experts is None else side.run(self.shared_experts, x_shared)
        topk_ids, topk_weights, slot_ids = self.gate(x, self.replica_row)
        self.last_topk_ids = topk_ids
        return shared, topk_weights, slot_ids

    def _forward_local(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """forward's result when this rank holds every slot and every token (no exchange)."""
        # Why a branch: the shared experts read only x, so at decode sizes they run beside the
        # router and routed experts on a second stream (moe_kernels/streams.py; no bit moves).
        with self.ops.branch(x.shape[0]) as side:
            shared, topk_weights, slot_ids = self._shared_beside_gate(side, x, x)
            # Why: no row moves, so the experts read x through the layout's token index and
            # the combine writes the layer's output: two launches and a [T*K, D] copy fewer a
            # layer, with the same loads and the same adds in the same order, so the same bits.
            token_of_row, group_sizes, handle = self.dispatcher.route(x, slot_ids, topk_weights)
            self.last_slot_counts = group_sizes
            routed_rows = self.experts(x, group_sizes, row_index=token_of_row)
        return self.ops.moe_combine_output(
            routed_rows, handle.order, topk_weights, shared, residual, handle.row_of_slot
        )
