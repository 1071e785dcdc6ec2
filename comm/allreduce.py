"""All-reduce for TP groups: a pinned version whose bits ignore message size, and the control.

`pinned_all_reduce` gathers every rank's tensor and sums them in rank order, elementwise, with
at least fp32 accumulation: element i's result depends only on the ranks' values of element i,
never on how long the message was or which algorithm the backend picked for that length, and
every rank computes the same bits. `plain_all_reduce` is the backend's own all-reduce (ring,
tree, chunking chosen by size), kept as the fast path and the negative control.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from comm.errors import collective_guard


def pinned_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum x over the group's ranks in rank order; same shape and dtype as x, on every rank.

    Costs R times the bytes of a ring all-reduce: meant for the small activations of TP layers.
    """
    world_size = dist.get_world_size(group)
    gathered = [torch.empty_like(x) for _ in range(world_size)]
    # Collective: every rank of the group calls this, in the same order as its other collectives.
    with collective_guard(dist.get_rank(), "pinned_all_reduce all_gather"):
        dist.all_gather(gathered, x.contiguous(), group=group)
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    acc = gathered[0].to(acc_dtype)
    for part in gathered[1:]:  # why: rank order, one elementwise add at a time
        acc = acc + part.to(acc_dtype)
    return acc.to(x.dtype)


def plain_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The backend's all-reduce (sum) on a copy of x; its order may change with message size."""
    out = x.clone()
    # Collective: every rank of the group calls this, in the same order as its other collectives.
    with collective_guard(dist.get_rank(), "plain_all_reduce"):
        dist.all_reduce(out, group=group)
    return out
