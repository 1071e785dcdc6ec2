"""MoE token dispatch and combine across expert-parallel ranks (layout -> dispatch -> combine).

Shaped like DeepEP: `layout(ids)` (which rows go where), `dispatch(x, ids, w, layout)` ->
(rows, group sizes, handle), `combine(y, handle, w)`.

Inputs are PHYSICAL expert ids: slot p lives on rank p // L as local slot p % L (the caller maps
logical to physical experts with a static replica table). Every (token, slot) pair travels as its
own row, in the fixed order (destination rank, physical expert, source token, slot); the
receiver regroups rows by (local slot, source rank, source token, slot), so each expert's rows
are contiguous and in an order that does not depend on what else the step holds.
The handle returned by dispatch carries everything combine needs, as in DeepEP, so a DeepEP
backend can replace AllToAllDispatcher behind the same calls. Every sum is the op table's
`moe_combine`, given at construction; this module only moves rows. Nothing here knows about
the model, EPLB or how workers are launched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from comm.errors import PeerRefusedError, collective_guard

# Key stride for (rank, token) pairs packed into one int64: tokens per step stay far below it.
_TOKEN_KEY_STRIDE = 1 << 32


@dataclass(frozen=True)
class DispatchHandle:
    """What combine needs to send results home. N rows received, T tokens sent, U partials.

    order [T*K]: flat (token * K + slot) index of each sent row, in send order.
    recv_order [N]: for each expert-sorted row, its index in the received buffer; None at world
    size 1, where the buffer is already expert-sorted.
    row_of_slot [T*K] or None: each flat (token * K + slot)'s row in send order (order's
    inverse), when the layout made it (the combine then needs no launches to invert order).
    The reduce_* fields are set only with multiple reduction: reduce_slot_ids [N] is each
    received row's flat (partial * K + slot) (buffer order), reduce_weights [U, K] fp32 the
    partials' top-k weights (0 where absent), reduce_back_ids [U'] the flat
    (token * R + expert rank) of each partial row this rank gets back.
    """

    order: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    recv_order: torch.Tensor | None
    num_tokens: int
    row_of_slot: torch.Tensor | None = None
    reduce_slot_ids: torch.Tensor | None = None
    reduce_weights: torch.Tensor | None = None
    reduce_send_splits: list[int] | None = None
    reduce_recv_splits: list[int] | None = None
    reduce_back_ids: torch.Tensor | None = None


@dataclass(frozen=True)
class DispatchLayout:
    """The first of DeepEP's three calls: where every (token, slot) row goes, before any data.

    order [T*K]: flat (token * K + slot) indices in send order; rows_per_slot [R*L] int64:
    rows bound for each (destination rank, local slot); token_of_row [T*K]: each sent row's
    source token (order // K); row_of_slot [T*K] or None: order's inverse, made only by the
    one-launch path (the sort path would spend launches on it that only world size 1 uses).
    """

    order: torch.Tensor
    rows_per_slot: torch.Tensor
    token_of_row: torch.Tensor
    row_of_slot: torch.Tensor | None = None


# Up to this many rows (token, slot pairs), a CUDA layout is one Triton launch; above, a sort.
_RANK_MAX_ROWS = 2048


def dispatch_layout(topk_phys_ids: torch.Tensor, num_physical: int) -> DispatchLayout:
    """[T, K] int64 physical ids (all < num_physical) -> DispatchLayout. No host sync on CUDA
    (a CUDA graph can capture it); on CPU the ids are range-checked."""
    flat = topk_phys_ids.reshape(-1)
    if (
        flat.device.type == "cpu"
        and flat.numel()
        and not 0 <= int(flat.min()) <= int(flat.max()) < num_physical
    ):
        raise ValueError(
            f"physical expert ids must lie in [0, {num_physical}), got "
            f"{int(flat.min())}..{int(flat.max())}"
        )
    if flat.device.type == "cuda" and flat.numel() <= _RANK_MAX_ROWS:
        # Decode-sized steps: the stable sort's order exactly, in one launch (a radix sort
        # launch costs ~25 us even for 384 ids). Imported here so CPU-only processes never
        # load Triton's compiler front end.
        from moe_kernels.triton_layout import expert_layout_triton

        return DispatchLayout(*expert_layout_triton(topk_phys_ids, num_physical))
    # Integer adds: exact in any order (torch.bincount would sync to size its output).
    rows_per_slot = torch.zeros(num_physical, dtype=torch.int64, device=flat.device)
    rows_per_slot.index_add_(0, flat, torch.ones_like(flat))
    order = sort_rows_by_destination(topk_phys_ids)
    return DispatchLayout(order, rows_per_slot, order // topk_phys_ids.shape[1])


def sort_rows_by_destination(topk_phys_ids: torch.Tensor) -> torch.Tensor:
    """[T, K] physical ids -> [T*K] flat indices in (dest rank, physical expert, token, slot)."""
    # Why: a stable sort of the flat ids keeps (token, slot) order inside each expert, and
    # experts of one rank are contiguous ids, so this is exactly the fixed send order.
    return torch.sort(topk_phys_ids.reshape(-1), stable=True).indices


def count_rows_per_slot(topk_phys_ids: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[M, n] slot ids (< num_slots) of M MoE layers -> [M, num_slots] int64 row counts, on
    the device without a host sync."""
    offsets = torch.arange(topk_phys_ids.shape[0], device=topk_phys_ids.device)
    flat = (topk_phys_ids + offsets[:, None] * num_slots).reshape(-1)
    counts = torch.zeros(offsets.numel() * num_slots, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # integer adds: exact in any order
    return counts.view(-1, num_slots)


def _check_routing(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
    if x.dim() != 2 or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"need x [T, D] and topk_phys_ids [T, K], got {x.shape}, {ids.shape}")
    if ids.dtype != torch.int64 or weights.shape != ids.shape:
        raise ValueError(
            f"topk_phys_ids must be int64 and topk_weights {tuple(ids.shape)}, got "
            f"{ids.dtype} and {tuple(weights.shape)}"
        )


class LocalDispatcher:
    """World size 1: the same dispatch/combine results with no communication. One rank holds
    every slot of a token, so there is nothing to pre-reduce: no multiple-reduction switch.
    moe_combine: the op table's (rows, slot_ids, weights, row_of_slot=None) -> out."""

    is_capturable = True  # no host sync, no collective: a CUDA graph may hold the MoE layer

    def __init__(self, num_local_slots: int, moe_combine: Callable) -> None:
        self.num_local_slots = num_local_slots
        self.moe_combine = moe_combine
        self.num_rows_sent_remote = 0

    def layout(self, topk_phys_ids: torch.Tensor) -> DispatchLayout:
        return dispatch_layout(topk_phys_ids, self.num_local_slots)

    def agree_num_tokens(self, num_tokens: int, is_ready: bool) -> int:
        """One rank decides alone: num_tokens when ready, else -1 (see FixedCapacityDispatcher)."""
        return num_tokens if is_ready else -1

    def count_served_rows(self, topk_phys_ids: torch.Tensor) -> torch.Tensor:
        """[M, n] physical ids of M layers -> [M, L] int64 rows per slot (no communication)."""
        return count_rows_per_slot(topk_phys_ids, self.num_local_slots)

    def dispatch(
        self,
        x: torch.Tensor,
        topk_phys_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        layout: DispatchLayout | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """x [T, D] -> rows [T*K, D] sorted by (local slot, token, slot), group sizes [L]
        int64 on x's device. No host sync and no collective: a CUDA graph can capture it."""
        token_of_row, group_sizes, handle = self.route(x, topk_phys_ids, topk_weights, layout)
        return x[token_of_row], group_sizes, handle

    def route(
        self,
        x: torch.Tensor,
        topk_phys_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        layout: DispatchLayout | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """dispatch without moving a row: (token_of_row [T*K] int64, group sizes, handle),
        where dispatch's rows are x[token_of_row]; a caller that reads x through the index
        (the grouped GEMM's loads) saves the copy."""
        _check_routing(x, topk_phys_ids, topk_weights)
        layout = layout or self.layout(topk_phys_ids)
        num_rows = layout.order.numel()
        handle = DispatchHandle(
            layout.order, [num_rows], [num_rows], None, x.shape[0], layout.row_of_slot
        )
        return layout.token_of_row, layout.rows_per_slot, handle

    def combine(
        self, y: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """y [T*K, D] in dispatch order -> out [T, D] fp32."""
        return self.moe_combine(y, handle.order, topk_weights, row_of_slot=handle.row_of_slot)


class RankExchange:
    """What every multi-rank dispatcher holds: its group and place in it, this rank's slots of
    the physical experts, the device and the op table's moe_combine; and the layout over every
    rank's slots (destination rank = physical slot // num_local_slots)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        world_size: int,
        num_local_slots: int,
        device: torch.device | str,
        moe_combine: Callable,
    ) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.num_local_slots = num_local_slots
        self.moe_combine = moe_combine
        self.device = torch.device(device)

    def layout(self, topk_phys_ids: torch.Tensor) -> DispatchLayout:
        return dispatch_layout(topk_phys_ids, self.world_size * self.num_local_slots)

    def _checked_layout(
        self,
        x: torch.Tensor,
        topk_phys_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        layout: DispatchLayout | None,
    ) -> tuple[DispatchLayout | None, ValueError | None]:
        """dispatch's argument checks and layout -> (layout, None), or (None, the refusal).

        Why kept, not raised: the ids and shapes are this rank's own, so a rank that refused
        alone left its peers waiting out timeout_s in the dispatch's first collective. The
        refusal rides in that collective instead (_raise_refusal), and every rank raises.
        """
        try:
            _check_routing(x, topk_phys_ids, topk_weights)
            return layout or self.layout(topk_phys_ids), None
        except ValueError as refusal:
            return None, refusal

    def _raise_refusal(self, refused_rank: int | None, refusal: ValueError | None) -> None:
        """Every rank, after the collective that carried the refusals: this rank's own refusal,
        else a PeerRefusedError naming a rank that refused (the ranks stay in step: none goes
        on)."""
        if refusal is not None:
            raise refusal
        if refused_rank is not None:
            raise PeerRefusedError(
                f"dispatch skipped on every rank: rank {refused_rank} refused its dispatch "
                "arguments (its own error says why)"
            )


class AllToAllDispatcher(RankExchange):
    """Dispatch/combine over all_to_all_single on `group` (gloo on CPU, NCCL on CUDA).

    Every rank of the group must call dispatch and combine the same number of times, in the
    same order, with the same allow_multiple_reduction — a rank with no tokens too (T = 0).
    allow_multiple_reduction=True pre-reduces a token's slots on each expert rank (fewer bytes,
    but the sum order then depends on the placement): the caller must pass False whenever the
    invariance contract is on. num_rows_sent_remote counts rows sent to other ranks by
    dispatch and combine together. moe_combine: the op table's, for every sum of combine.
    """

    is_capturable = False  # split sizes are host ints: the MoE layer runs eagerly

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        world_size: int,
        num_local_slots: int,
        allow_multiple_reduction: bool,
        device: torch.device | str,
        moe_combine: Callable,
    ) -> None:
        super().__init__(group, rank, world_size, num_local_slots, device, moe_combine)
        self.allow_multiple_reduction = allow_multiple_reduction
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

    def dispatch(
        self,
        x: torch.Tensor,
        topk_phys_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        layout: DispatchLayout | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """x [T, D] -> recv_x [N, D] sorted by (local slot, source rank, token, slot),
        group sizes [L] int64 on x's device, handle. topk_phys_ids [T, K] int64, topk_weights fp32.
        `layout` (from `self.layout`) may be computed ahead, as DeepEP's callers do. A rank
        whose arguments are refused makes every rank raise ValueError (see _checked_layout)."""
        r, slots = self.world_size, self.num_local_slots
        layout, refusal = self._checked_layout(x, topk_phys_ids, topk_weights, layout)
        if layout is None:  # refused: no rows to send, only the refusal
            send_counts = torch.zeros(r * slots, dtype=torch.int64, device=self.device)
        else:
            send_counts = layout.rows_per_slot  # [R*L]: (dest rank, local slot)
        # [R, L + 1]: the counts bound for each rank, then whether this rank refused.
        send = send_counts.view(r, slots)
        send = torch.cat([send, send.new_full((r, 1), int(refusal is not None))], dim=1)
        recv = torch.empty_like(send)
        # Collective (all ranks, every step, first): counts per (rank, local slot), so each
        # receiver knows its group sizes before any row arrives, and each rank's refusal.
        with collective_guard(self.rank, "dispatch counts all_to_all"):
            dist.all_to_all_single(recv, send, group=self.group)
        recv_counts = recv[:, :slots]  # [source rank, local slot]
        # Host sync (the step's one): the split sizes are host ints for the collectives.
        splits = torch.cat([send[:, :slots].sum(1), recv_counts.sum(1), recv[:, slots]]).tolist()
        send_splits, recv_splits, refused = splits[:r], splits[r : 2 * r], splits[2 * r :]
        self._raise_refusal(refused.index(1) if 1 in refused else None, refusal)
        order, k, flat_ids = layout.order, topk_phys_ids.shape[1], topk_phys_ids.reshape(-1)
        group_sizes = recv_counts.sum(0)
        # Collective (all ranks, right after the counts): the rows, uneven splits.
        recv_buf = self._all_to_all(
            x[layout.token_of_row], send_splits, recv_splits, "dispatch all_to_all"
        )
        self._count_remote(send_splits)
        # The buffer is (source rank, local slot, token, slot); a stable sort on the local slot
        # makes it (local slot, source rank, token, slot): each expert's rows are contiguous.
        slot_of_row = torch.arange(slots, device=recv_counts.device).repeat(r)
        slot_of_row = slot_of_row.repeat_interleave(
            recv_counts.reshape(-1), output_size=sum(recv_splits)
        )
        recv_order = torch.sort(slot_of_row, stable=True).indices
        handle = DispatchHandle(order, send_splits, recv_splits, recv_order, x.shape[0])
        if self.allow_multiple_reduction:
            handle = self._reduction_plan(handle, flat_ids, topk_weights, k)
        return recv_buf[recv_order], group_sizes, handle

    def _reduction_plan(
        self, handle: DispatchHandle, flat_ids: torch.Tensor, topk_weights: torch.Tensor, k: int
    ) -> DispatchHandle:
        """Multiple reduction: send each row's (token, slot) and weight; plan one partial row
        per (source rank, token) on the expert rank, returned in (rank, token) order."""
        order, send_splits, recv_splits = handle.order, handle.send_splits, handle.recv_splits
        # Collectives (all ranks, right after the rows, only in this mode): slot ids, weights.
        flat = self._all_to_all(order, send_splits, recv_splits, "dispatch slot ids")
        weights = self._all_to_all(
            topk_weights.reshape(-1)[order].float(), send_splits, recv_splits, "dispatch weights"
        )
        src_rank = torch.arange(self.world_size, device=flat.device)
        src_rank = src_rank.repeat_interleave(torch.tensor(recv_splits, device=flat.device))
        keys, inverse = torch.unique(
            src_rank * _TOKEN_KEY_STRIDE + flat // k, sorted=True, return_inverse=True
        )
        slot_ids = inverse * k + flat % k
        reduce_weights = weights.new_zeros(keys.numel() * k)
        reduce_weights[slot_ids] = weights  # index assignment: each (partial, slot) once
        # The source derives which (dest rank, token) partials come back, in the same order.
        dest_rank = flat_ids // self.num_local_slots
        token_of_flat = torch.arange(flat_ids.numel(), device=flat_ids.device) // k
        back_keys = torch.unique(dest_rank * _TOKEN_KEY_STRIDE + token_of_flat, sorted=True)
        back_rank, back_token = back_keys // _TOKEN_KEY_STRIDE, back_keys % _TOKEN_KEY_STRIDE
        return replace(
            handle,
            reduce_slot_ids=slot_ids,
            reduce_weights=reduce_weights.view(-1, k),
            reduce_send_splits=self._per_rank(keys),
            reduce_recv_splits=self._per_rank(back_keys),
            reduce_back_ids=back_token * self.world_size + back_rank,
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
            # source's moe_combine sees all of a token's slots whatever the placement.
            y_sorted = self._all_to_all(
                y_buf, handle.recv_splits, handle.send_splits, "combine all_to_all"
            )
            self._count_remote(handle.recv_splits)
            return self.moe_combine(y_sorted, handle.order, topk_weights)
        # Pre-reduction: which slots share a partial depends on the placement, whatever the op.
        partial = self.moe_combine(y_buf, handle.reduce_slot_ids, handle.reduce_weights)
        # Collective (all ranks, once per dispatch): one partial row per (token, expert rank).
        back = self._all_to_all(
            partial, handle.reduce_send_splits, handle.reduce_recv_splits, "combine all_to_all"
        )
        self._count_remote(handle.reduce_send_splits)
        # The partials weigh 1 each: a sum over expert ranks, by the same op.
        ones = back.new_ones(handle.num_tokens, self.world_size)
        return self.moe_combine(back, handle.reduce_back_ids, ones)
