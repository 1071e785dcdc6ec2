"""Tensor parallelism inside one data-parallel group: which weights are split, and the collectives.

Attention heads, the dense MLP's intermediate dim and the LM head's vocabulary are split over
the TP ranks; everything else is replicated. o_proj and the MoE layers split tokens instead:
each TP rank runs them whole on its own share of the group's tokens (`token_share`; attention
first swaps its heads of every token for every head of its share, `heads_to_share`) and the
finished rows are gathered (`gather_shares`). Column-parallel linears keep every output
element's K order, so they need no reduction. The one row-parallel linear left, the dense MLP's
down_proj, runs the op table's `row_parallel_linear` through comm: in invariant mode K is cut
into kernels.tp_max fixed chunks, each rank sums its subtree of one fixed binary tree in fp32,
and the fp32 subtree sums are all-gathered and the tree finished in rank order, rounded once:
the same bits at every TP degree (tp 1 included) and every batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from comm.allreduce import all_gather, all_to_all_equal, row_parallel_linear

# Parameter-name suffix -> the dim split across TP ranks (0: output rows, 1: input columns).
_SHARD_DIMS = (
    ("self_attn.q_proj.weight", 0),
    ("self_attn.q_b_proj.weight", 0),
    ("self_attn.kv_b_proj.weight", 0),
    (".gate_proj.weight", 0),
    (".up_proj.weight", 0),
    (".down_proj.weight", 1),
    ("lm_head.weight", 0),
)


@dataclass(frozen=True)
class TensorParallel:
    size: int = 1
    rank: int = 0
    group: Any = None
    # Collectives this rank ran in its TP group, by name ("all_reduce": row-parallel sums,
    # "fp32_subtree_gather": the all-gathers of fp32 subtree sums among them, "all_gather": the
    # LM head's slices, "head_exchange": attention's heads swapped for token shares,
    # "attention_share_gather": o_proj's finished rows of each rank's token share,
    # "share_gather": the MoE layers' finished rows of each rank's token share): the record is
    # frozen, the counts are not; Worker.stats reports them, so a test can see the split path
    # ran without relying on TP changing any bits.
    num_calls: Counter = field(default_factory=Counter, compare=False, repr=False)

    def split(self, total: int, what: str) -> int:
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by parallel.tp_size ({self.size})")
        return total // self.size

    def row_parallel_linear(
        self, x: torch.Tensor, weight: torch.Tensor, op: Callable
    ) -> torch.Tensor:
        """Sum over the TP ranks of x [T, K_local] @ weight [N, K_local]^T, by the op table's
        `row_parallel_linear` op. Collective: every TP rank calls it in layer order."""
        if self.size == 1:
            return row_parallel_linear(x, weight, None, op)
        self.num_calls["all_reduce"] += 1
        return row_parallel_linear(x, weight, self.group, op, self._count_gather)

    def _count_gather(self, t: torch.Tensor) -> None:
        if t.dtype == torch.float32:
            self.num_calls["fp32_subtree_gather"] += 1

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the ranks' slices of the last dim in rank order. Collective."""
        if self.size == 1:
            return x
        self.num_calls["all_gather"] += 1
        return torch.cat(all_gather(x, self.group), dim=-1)

    def token_share(self, num_tokens: int) -> slice:
        """This rank's contiguous share of the group's num_tokens rows: ceil(T / size) each in
        rank order, the last ones shorter (or empty)."""
        per_rank = self.rows_per_share(num_tokens)
        start = min(self.rank * per_rank, num_tokens)
        return slice(start, min(start + per_rank, num_tokens))

    def rows_per_share(self, num_tokens: int) -> int:
        """Rows of the longest token share, ceil(T / size): every share's size on the wire."""
        return -(-num_tokens // self.size)

    def heads_to_share(self, heads: torch.Tensor) -> torch.Tensor:
        """This rank's heads of every token [T, H_local * v] -> every head of this rank's
        `token_share` tokens [T_share, H * v], heads in global order (rank r holds heads
        r * H_local .. (r + 1) * H_local - 1, as q_b_proj and kv_b_proj are chunked). Collective
        (every TP rank calls it with the same T, even with an empty share); padded to
        ceil(T / size) rows per rank on the wire, so each rank receives only its own rows."""
        if self.size == 1:
            return heads
        self.num_calls["head_exchange"] += 1
        num_tokens, width = heads.shape
        per_rank = self.rows_per_share(num_tokens)
        padded = _pad_rows(heads, self.size * per_rank)
        # Block r of what arrives: rank r's heads of this rank's rows; side by side in rank order.
        blocks = all_to_all_equal(padded, self.group).view(self.size, per_rank, width)
        rows = blocks.transpose(0, 1).reshape(per_rank, self.size * width)
        share = self.token_share(num_tokens)
        return rows[: share.stop - share.start]

    def gather_shares(
        self, share: torch.Tensor, num_tokens: int, name: str = "share_gather"
    ) -> torch.Tensor:
        """The group's rows [num_tokens, ...] from every rank's `token_share` rows; counted in
        num_calls under `name`. Collective (every TP rank calls it with the same num_tokens);
        padded to equal sizes on the wire."""
        if self.size == 1:
            return share
        self.num_calls[name] += 1
        padded = _pad_rows(share, self.rows_per_share(num_tokens))
        return torch.cat(all_gather(padded, self.group))[:num_tokens]

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full-size parameter (replicated ones are returned whole)."""
        dim = shard_dim(name)
        if self.size == 1 or dim is None:
            return full
        return full.chunk(self.size, dim=dim)[self.rank]

    def full_shape(self, name: str, local_shape: torch.Size) -> tuple[int, ...]:
        shape = list(local_shape)
        dim = shard_dim(name)
        if dim is not None:
            shape[dim] *= self.size
        return tuple(shape)


def _pad_rows(x: torch.Tensor, num_rows: int) -> torch.Tensor:
    """x [n, ...] followed by zero rows up to [num_rows, ...] (n <= num_rows)."""
    padded = x.new_zeros((num_rows, *x.shape[1:]))
    padded[: x.shape[0]] = x
    return padded


def shard_dim(name: str) -> int | None:
    if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return None  # routed experts are expert-parallel, never split
    if ".mlp.shared_experts." in name:
        return None  # whole on every TP rank, run on its token share (moe.py)
    return next((dim for suffix, dim in _SHARD_DIMS if name.endswith(suffix)), None)
