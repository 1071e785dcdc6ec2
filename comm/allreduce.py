"""TP collectives: the reductions (their arithmetic from the op table) and the equal exchange.

`all_reduce(x, group, sum_over_ranks)` offers the op two collectives, an all-gather and the
backend's own all_reduce; the op table's `sum_over_ranks` picks which does the arithmetic. The
invariant op sums the gathered parts in rank order (bits independent of message size, the
same on every rank); the fast one is the backend's ring/tree, chosen by message size.
`row_parallel_linear(x, weight, group, op)` offers the op table's row-parallel linear the same
two collectives: its invariant version all-gathers every rank's fp32 subtree sum and finishes
one fixed binary tree (moe_kernels/tp_linear.py), the same bits at every TP degree.
`all_to_all_equal(x, group)` swaps equal row blocks between the ranks (attention's heads for
token shares; no arithmetic).
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


def all_to_all_equal(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """x [R * n, ...], block j (rows j * n .. (j + 1) * n) for rank j -> [R * n, ...], block j
    from rank j. n may be 0; ValueError when x's rows do not split in R equal blocks."""
    num_ranks = dist.get_world_size(group)
    if x.dim() == 0 or x.shape[0] % num_ranks:
        # Checked here: gloo sends such an x as it is and fills the output with garbage, or
        # torch refuses it with a RuntimeError that collective_guard would call a failed
        # collective. The shape is the same on every rank by contract, so each refuses alike.
        raise ValueError(
            f"rank {dist.get_rank()}: all_to_all_equal needs x's rows in {num_ranks} equal "
            f"blocks (one a rank), got shape {tuple(x.shape)}"
        )
    # Why contiguous first: empty_like keeps a view's strides, and the collective writes the
    # output as one dense buffer, so a transposed or sliced x came back with its rows scrambled.
    x = x.contiguous()
    out = torch.empty_like(x)
    # Collective: every rank of the group calls this with the same shape, even with n 0, in the
    # same order as its other collectives.
    with collective_guard(dist.get_rank(), "all_to_all"):
        dist.all_to_all_single(out, x, group=group)
    return out


def backend_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The backend's own sum (algorithm chosen by message size) into a copy of x. Collective."""
    out = x.clone()
    with collective_guard(dist.get_rank(), "all_reduce"):
        dist.all_reduce(out, group=group)
    return out


def all_reduce(
    x: torch.Tensor, group: dist.ProcessGroup | None, sum_over_ranks: Callable
) -> torch.Tensor:
    """Sum of x over the group's ranks; same shape and dtype as x, on every rank. Collective:
    every rank calls it with the same op (the ops use different collectives)."""
    return sum_over_ranks(x, lambda t: all_gather(t, group), lambda t: backend_all_reduce(t, group))


def row_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: dist.ProcessGroup | None,
    op: Callable,
    on_gather: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Sum over the group of x [T, K_local] @ weight [N, K_local]^T -> [T, N] in x's dtype, by
    the op table's `row_parallel_linear`. group None: one rank holds all of K and no collective
    runs. on_gather(t) is told of every tensor the op all-gathers (stats). Collective otherwise:
    every rank of the group calls it with the same op, in layer order."""
    if group is None:
        return op(x, weight, 1, lambda t: [t], lambda t: t)

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        if on_gather is not None:
            on_gather(t)
        return all_gather(t, group)

    return op(
        x,
        weight,
        dist.get_world_size(group),
        gather,
        lambda t: backend_all_reduce(t, group),
        tp_rank=dist.get_rank(group),
    )
