"""Tensor parallelism inside one data-parallel group: which weights are split, and the reductions.

Attention heads, the dense MLP and shared-expert intermediate dims, and the LM head's vocabulary
are split over the TP ranks; everything else is replicated. Row-parallel outputs (o_proj,
down_proj) are summed by comm's all_reduce with the op table's `sum_over_ranks`: in invariant
mode an all-gather and a sum in rank order, whose bits ignore the message size and the batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from comm.allreduce import all_gather, all_reduce

# Parameter-name suffix -> the dim split across TP ranks (0: output rows, 1: input columns).
_SHARD_DIMS = (
    ("self_attn.q_proj.weight", 0),
    ("self_attn.q_b_proj.weight", 0),
    ("self_attn.kv_b_proj.weight", 0),
    ("self_attn.o_proj.weight", 1),
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
    sum_over_ranks: Callable | None = None  # the op table's; needed when size > 1
    # Collectives this rank ran in its TP group, by name ("all_reduce", "all_gather"): the
    # record is frozen, the counts are not; Worker.stats reports them, so a test can see the
    # split path ran without relying on TP changing any bits.
    num_calls: Counter = field(default_factory=Counter, compare=False, repr=False)

    def split(self, total: int, what: str) -> int:
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by parallel.tp_size ({self.size})")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the TP ranks' partial results. Collective: every TP rank calls it in order."""
        if self.size == 1:
            return x
        self.num_calls["all_reduce"] += 1
        return all_reduce(x, self.group, self.sum_over_ranks)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the ranks' slices of the last dim in rank order. Collective."""
        if self.size == 1:
            return x
        self.num_calls["all_gather"] += 1
        return torch.cat(all_gather(x, self.group), dim=-1)

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


def shard_dim(name: str) -> int | None:
    if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return None  # routed experts are expert-parallel, never split
    return next((dim for suffix, dim in _SHARD_DIMS if name.endswith(suffix)), None)
