"""All-reduce (sum) for TP groups: the collectives here, the arithmetic from the op table.

`all_reduce(x, group, sum_over_ranks)` offers the op two collectives, an all-gather and the
backend's own all_reduce; the op table's `sum_over_ranks` picks which does the arithmetic. The
invariant op sums the gathered parts in rank order (bits independent of message size, the
same on every rank); the fast one is the backend's ring/tree, chosen by message size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from comm.errors import collective_guard


def all_gather(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """[R] copies of every rank's x, in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    # Collective: every rank of the group calls this, in the same order as its other collectives.
    with collective_guard(dist.get_rank(), "all_gather"):
        dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def all_reduce(
    x: torch.Tensor, group: dist.ProcessGroup | None, sum_over_ranks: Callable
) -> torch.Tensor:
    """Sum of x over the group's ranks; same shape and dtype as x, on every rank. Collective:
    every rank calls it with the same op (the ops use different collectives)."""

    def backend_all_reduce(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        with collective_guard(dist.get_rank(), "all_reduce"):
            dist.all_reduce(out, group=group)
        return out

    return sum_over_ranks(x, lambda t: all_gather(t, group), backend_all_reduce)
