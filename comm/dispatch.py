"""MoE token dispatch and combine across expert-parallel ranks (layout -> dispatch -> combine).

Shaped like DeepEP: `layout(ids)` (which rows go where), `dispatch(x, ids, w, layout)` ->
(rows, group sizes, handle), `combine(y, handle, w)`.

Inputs are PHYSICAL expert ids: slot p lives on rank p // L as local slot p % L (the caller maps
logical to physical experts with a static replica table). Every (token, slot) pair travels as its
own row, in the fixed order (destination rank, physical expert, source token, slot); the
receiver regroups rows by (local slot, source rank, source token, slot), so each expert's rows
are contiguous and in an order that does not depend on what else the step holds.
The handle returned by dispatch carries everything combine needs, as in DeepEP, so a DeepEP
backend can replace AllToAllDispatcher behind the same calls. Nothing here knows about
the model, EPLB or how workers are launched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from comm.errors import collective_guard

# Key stride for (rank, token) pairs packed into one int64: tokens per step stay far below it.
_TOKEN_KEY_STRIDE = 1 << 32


@dataclass(frozen=True)
class DispatchHandle:
    """What combine needs to send results home. N rows received, T tokens sent, U partials.

    order [T*K]: flat (token * K + slot) index of each sent row, in send order.
    recv_order [N]: for each expert-sorted row, its index in the received buffer.
    The reduce_* fields are set only with multiple reduction: reduce_inverse [N] maps each
    received row (buffer order) to its partial row, recv_weights [N] fp32 are its top-k weights,
    reduce_token_ids [U'] are the source tokens of the partial rows this rank gets back.
    """

    order: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    recv_order: torch.Tensor
    num_tokens: int
    reduce_inverse: torch.Tensor | None = None
    recv_weights: torch.Tensor | None = None
    reduce_send_splits: list[int] | None = None
    reduce_recv_splits: list[int] | None = None
    reduce_token_ids: torch.Tensor | None = None


@dataclass(frozen=True)
class DispatchLayout:
    """The first of DeepEP's three calls: where every (token, slot) row goes, before any data.

    order [T*K]: flat (token * K + slot) indices in send order; rows_per_slot [R*L] int64:
    rows bound for each (destination rank, local slot).
    """

    order: torch.Tensor
    rows_per_slot: torch.Tensor


def dispatch_layout(topk_phys_ids: torch.Tensor, num_physical: int) -> DispatchLayout:
    """[T, K] int64 physical ids (all < num_physical) -> DispatchLayout."""
    order = sort_rows_by_destination(topk_phys_ids)
    return DispatchLayout(order, _count_rows(topk_phys_ids.reshape(-1), num_physical))


def sort_rows_by_destination(topk_phys_ids: torch.Tensor) -> torch.Tensor:
    """[T, K] physical ids -> [T*K] flat indices in (dest rank, physical expert, token, slot)."""
    # Why: a stable sort of the flat ids keeps (token, slot) order inside each expert, and
    # experts of one rank are contiguous ids, so this is exactly the fixed send order.
    return torch.sort(topk_phys_ids.reshape(-1), stable=True).indices


def combine_in_slot_order(
    y_sorted: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * y[t, k] in fp32, k ascending. y_sorted [T*K, D] in `order`."""
    t, k = topk_weights.shape
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted  # index assignment back to (token, slot) order
    y = y.view(t, k, y_sorted.shape[1]).float()  # explicit D: T may be 0
    out = topk_weights[:, 0:1] * y[:, 0]
    for slot in range(1, k):  # why: a fixed summation order, the same on every layout
        out = out + topk_weights[:, slot : slot + 1] * y[:, slot]
    return out


def _check_routing(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
    if x.dim() != 2 or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"need x [T, D] and topk_phys_ids [T, K], got {x.shape}, {ids.shape}")
    if ids.dtype != torch.int64 or weights.shape != ids.shape:
        raise ValueError(
            f"topk_phys_ids must be int64 and topk_weights {tuple(ids.shape)}, got "
            f"{ids.dtype} and {tuple(weights.shape)}"
        )


def _count_rows(flat_ids: torch.Tensor, num_slots: int) -> torch.Tensor:
    counts = torch.bincount(flat_ids, minlength=num_slots)
    if counts.numel() != num_slots:
        raise ValueError(
            f"physical expert ids must lie in [0, {num_slots}), got {counts.numel() - 1}"
        )
    return counts


class LocalDispatcher:
    """World size 1: the same dispatch/combine results with no communication."""

    def __init__(self, num_local_slots: int, allow_multiple_reduction: bool = False) -> None:
        self.num_local_slots = num_local_slots
        self.allow_multiple_reduction = allow_multiple_reduction
        self.num_rows_sent_remote = 0

    def layout(self, topk_phys_ids: torch.Tensor) -> DispatchLayout:
        return dispatch_layout(topk_phys_ids, self.num_local_slots)

    def dispatch(
        self,
        x: torch.Tensor,
        topk_phys_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        layout: DispatchLayout | None = None,
    ) -> tuple[torch.Tensor, list[int], DispatchHandle]:
        """x [T, D] -> rows [T*K, D] sorted by (local slot, token, slot), group_sizes [L]."""
        _check_routing(x, topk_phys_ids, topk_weights)
        k = topk_phys_ids.shape[1]
        layout = layout or self.layout(topk_phys_ids)
        order = layout.order
        # Host sync: group sizes drive the per-expert GEMM loop.
        group_sizes = layout.rows_per_slot.tolist()
        num_rows = order.numel()
        handle = DispatchHandle(
            order=order,
            send_splits=[num_rows],
            recv_splits=[num_rows],
            recv_order=torch.arange(num_rows, device=order.device),
            num_tokens=x.shape[0],
        )
        return x[order // k], group_sizes, handle

    def combine(
        self, y: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """y [T*K, D] in dispatch order -> out [T, D] fp32."""
        if not self.allow_multiple_reduction:
            return combine_in_slot_order(y, handle.order, topk_weights)
        k = topk_weights.shape[1]
        weighted = y.float() * topk_weights.reshape(-1)[handle.order, None]
        out = torch.zeros(handle.num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
        # Fast path only: index_add_ accumulates in an unpinned order (the negative control).
        return out.index_add_(0, handle.order // k, weighted)


class AllToAllDispatcher:
    """Dispatch/combine over all_to_all_single on `group` (gloo on CPU, NCCL on CUDA).

    Every rank of the group must call dispatch and combine the same number of times, in the
    same order, with the same allow_multiple_reduction — a rank with no tokens too (T = 0).
    allow_multiple_reduction=True pre-reduces a token's slots on each expert rank (fewer bytes,
    but the sum order then depends on the placement): the caller must pass False whenever the
    invariance contract is on. num_rows_sent_remote counts rows sent to other ranks by
    dispatch and combine together.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        world_size: int,
        num_local_slots: int,
        allow_multiple_reduction: bool,
        device: torch.device | str,
    ) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.num_local_slots = num_local_slots
        self.allow_multiple_reduction = allow_multiple_reduction
        self.device = torch.device(device)
        self.num_rows_sent_remote = 0

    def _all_to_all(
        self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], op: str
    ) -> torch.Tensor:
        recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
        with collective_guard(self.rank, op):
            dist.all_to_all_single(
                recv, send.contiguous(), recv_splits, send_splits, group=self.group
            )
        return recv

    def _count_remote(self, send_splits: list[int]) -> None:
        self.num_rows_sent_remote += sum(send_splits) - send_splits[self.rank]

    def layout(self, topk_phys_ids: torch.Tensor) -> DispatchLayout:
        return dispatch_layout(topk_phys_ids, self.world_size * self.num_local_slots)

    def dispatch(
        self,
        x: torch.Tensor,
        topk_phys_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        layout: DispatchLayout | None = None,
    ) -> tuple[torch.Tensor, list[int], DispatchHandle]:
        """x [T, D] -> recv_x [N, D] sorted by (local slot, source rank, token, slot),
        group_sizes [L] host ints, handle. topk_phys_ids [T, K] int64, topk_weights fp32.
        `layout` (from `self.layout`) may be computed ahead, as DeepEP's callers do."""
        _check_routing(x, topk_phys_ids, topk_weights)
        r, slots, k = self.world_size, self.num_local_slots, topk_phys_ids.shape[1]
        flat_ids = topk_phys_ids.reshape(-1)
        layout = layout or self.layout(topk_phys_ids)
        order, send_counts = layout.order, layout.rows_per_slot  # [R*L]: (dest rank, slot)
        recv_counts = torch.empty_like(send_counts)
        # Collective (all ranks, every step, first): counts per (rank, local slot), so each
        # receiver knows its group sizes before any row arrives.
        with collective_guard(self.rank, "dispatch counts all_to_all"):
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        recv_counts = recv_counts.view(r, slots)  # [source rank, local slot]
        # Host sync: split sizes and group sizes are host ints for the collective and the GEMM.
        send_splits = send_counts.view(r, slots).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        group_sizes = recv_counts.sum(0).tolist()
        # Collective (all ranks, right after the counts): the rows, uneven splits.
        recv_buf = self._all_to_all(x[order // k], send_splits, recv_splits, "dispatch all_to_all")
        self._count_remote(send_splits)
        # The buffer is (source rank, local slot, token, slot); a stable sort on the local slot
        # makes it (local slot, source rank, token, slot): each expert's rows are contiguous.
        slot_of_row = torch.arange(slots, device=recv_counts.device).repeat(r)
        slot_of_row = slot_of_row.repeat_interleave(recv_counts.reshape(-1))
        recv_order = torch.sort(slot_of_row, stable=True).indices
        handle = DispatchHandle(order, send_splits, recv_splits, recv_order, x.shape[0])
        if self.allow_multiple_reduction:
            handle = self._reduction_plan(handle, flat_ids, topk_weights, k)
        return recv_buf[recv_order], group_sizes, handle

    def _reduction_plan(
        self, handle: DispatchHandle, flat_ids: torch.Tensor, topk_weights: torch.Tensor, k: int
    ) -> DispatchHandle:
        """Multiple reduction: send each row's token id and weight; plan one partial row per
        (source rank, token) on the expert rank, returned in (rank, token) order."""
        order, send_splits, recv_splits = handle.order, handle.send_splits, handle.recv_splits
        # Collectives (all ranks, right after the rows, only in this mode): token ids, weights.
        token_ids = self._all_to_all(order // k, send_splits, recv_splits, "dispatch token ids")
        weights = self._all_to_all(
            topk_weights.reshape(-1)[order].float(), send_splits, recv_splits, "dispatch weights"
        )
        src_rank = torch.arange(self.world_size, device=token_ids.device)
        src_rank = src_rank.repeat_interleave(torch.tensor(recv_splits, device=token_ids.device))
        keys, inverse = torch.unique(
            src_rank * _TOKEN_KEY_STRIDE + token_ids, sorted=True, return_inverse=True
        )
        reduce_send_splits = self._per_rank(keys)
        # The source derives which (dest rank, token) partials come back, in the same order.
        dest_rank = flat_ids // self.num_local_slots
        token_of_flat = torch.arange(flat_ids.numel(), device=flat_ids.device) // k
        back_keys = torch.unique(dest_rank * _TOKEN_KEY_STRIDE + token_of_flat, sorted=True)
        return DispatchHandle(
            order=order,
            send_splits=send_splits,
            recv_splits=recv_splits,
            recv_order=handle.recv_order,
            num_tokens=handle.num_tokens,
            reduce_inverse=inverse,
            recv_weights=weights,
            reduce_send_splits=reduce_send_splits,
            reduce_recv_splits=self._per_rank(back_keys),
            reduce_token_ids=back_keys % _TOKEN_KEY_STRIDE,
        )

    def _per_rank(self, keys: torch.Tensor) -> list[int]:
        # Host sync: split sizes for the combine collective.
        return torch.bincount(keys // _TOKEN_KEY_STRIDE, minlength=self.world_size).tolist()

    def combine(
        self, y: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """y [N, D] in recv_x's order -> out [T, D] fp32 on the source rank."""
        y_buf = torch.empty_like(y)
        y_buf[handle.recv_order] = y  # index assignment back to the received buffer order
        if not self.allow_multiple_reduction:
            # Collective (all ranks, once per dispatch): every row goes home alone, so the
            # source sums each token's slots in slot order whatever the placement.
            y_sorted = self._all_to_all(
                y_buf, handle.recv_splits, handle.send_splits, "combine all_to_all"
            )
            self._count_remote(handle.recv_splits)
            return combine_in_slot_order(y_sorted, handle.order, topk_weights)
        weighted = y_buf.float() * handle.recv_weights[:, None]
        num_partials = sum(handle.reduce_send_splits)
        partial = torch.zeros(num_partials, y.shape[1], dtype=torch.float32, device=y.device)
        # Fast path only: pre-reduction order depends on which slots share a rank.
        partial.index_add_(0, handle.reduce_inverse, weighted)
        # Collective (all ranks, once per dispatch): one partial row per (token, expert rank).
        back = self._all_to_all(
            partial, handle.reduce_send_splits, handle.reduce_recv_splits, "combine all_to_all"
        )
        self._count_remote(handle.reduce_send_splits)
        out = torch.zeros(handle.num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
        return out.index_add_(0, handle.reduce_token_ids, back)
