"""FixedCapacityDispatcher: the MoE exchange with fixed shapes and counts on the device.

AllToAllDispatcher's rows, in its order, through equal-split all_to_all_single calls: every
rank sends each destination one block of C = T*K rows (T the call's token count, the same on
every rank; padding after the real rows), so no split size is a host int and a CUDA graph can
capture dispatch and combine, collectives included. The receiver sorts its real rows by (local
slot, source rank, token, slot) on the device, padding rows last; the grouped GEMM stops at the
sum of the device group sizes. Combine sends every row home in the same blocks and gathers the
real ones back into send order, so the op table's moe_combine sees exactly AllToAllDispatcher's
rows: the same bits. Moving rows is all it does; nothing here knows about the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from comm.dispatch import (
    AllToAllDispatcher,
    DispatchHandle,
    DispatchLayout,
    RankExchange,
    count_rows_per_slot,
)
from comm.errors import collective_guard


@dataclass(frozen=True)
class CapacityHandle:
    """What combine needs, all on the device. T tokens sent, R ranks, C rows per block.

    order [T*K]: flat (token * K + slot) index of each sent row, in send order.
    send_pos [T*K]: each sent row's index in the padded send buffer [R*C] (block = dest rank).
    recv_order [R*C]: for each expert-sorted row, its index in the received buffer.
    num_remote_back: int64 scalar, real rows received from other ranks (combine returns them).
    """

    order: torch.Tensor
    send_pos: torch.Tensor
    recv_order: torch.Tensor
    num_remote_back: torch.Tensor


class FixedCapacityDispatcher(RankExchange):
    """Dispatch/combine over equal-split all_to_all_single on `group`; capturable.

    Every rank of the group must call dispatch and combine the same number of times, in the
    same order, a rank with no tokens too. Inside a CUDA graph capture every rank must pass the
    same token count T (the graph runner pads all ranks to one agreed bucket, see
    `agree_num_tokens`): dispatch and combine then do no host sync at all. Called eagerly, the
    ranks' T may differ: one small all_reduce (a host sync) agrees on the largest T first.
    Multiple reduction is refused (ValueError): pre-reduced partials have placement-dependent
    counts, and the invariant mode never uses it. num_rows_sent_remote counts rows sent to
    other ranks by dispatch and combine together, padding tokens of a graph bucket included
    (the padding blocks are not); it is kept on the device and read only by this property.

    A graph-running worker says before each step whether the step replays a graph
    (`begin_step`, agreed by all ranks); the steps that do not (prefill, mixed, scoring) take
    AllToAllDispatcher's uneven exchange: the same rows in the same order, so the same bits,
    without R padded blocks of T*K rows per layer (GBs for a large prefill at EP 8).
    """

    is_capturable = True  # no host ints in captured calls: a CUDA graph may hold the MoE layer

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
        if allow_multiple_reduction:
            raise ValueError(
                "FixedCapacityDispatcher sends every (token, slot) row home alone: "
                "allow_multiple_reduction=True is not supported (use AllToAllDispatcher)"
            )
        super().__init__(group, rank, world_size, num_local_slots, device, moe_combine)
        self._num_remote = torch.zeros((), dtype=torch.int64, device=self.device)
        self._uneven = AllToAllDispatcher(
            group, rank, world_size, num_local_slots, False, device, moe_combine
        )
        self._is_graph_step = True  # without a graph runner every call takes the fixed blocks

    @property
    def num_rows_sent_remote(self) -> int:
        # Host sync: stats only, never inside a step.
        return int(self._num_remote) + self._uneven.num_rows_sent_remote

    @property
    def num_eager_rows_sent_remote(self) -> int:
        """The part of num_rows_sent_remote that went through the uneven exchange (steps
        begun as eager)."""
        return self._uneven.num_rows_sent_remote

    def begin_step(self, is_graph_step: bool) -> None:
        """Whether this step replays (or warms up and captures) a CUDA graph: every rank must
        pass the same value (the graph runner's agreed bucket, or none). False: this step's
        dispatch and combine take the uneven exchange."""
        self._is_graph_step = is_graph_step

    def agree_num_tokens(self, num_tokens: int, is_ready: bool) -> int:
        """Collective (all ranks, the same calls in the same order; a host sync, never inside a
        capture): -> the most tokens any rank holds when every rank is ready, else -1."""
        return self.agree_graph_step(num_tokens, 0, is_ready)[0]

    def agree_graph_step(
        self, num_tokens: int, table_width: int, is_ready: bool
    ) -> tuple[int, int]:
        """Collective, as agree_num_tokens: -> (the most tokens, the widest block table) any
        rank holds when every rank is ready, else (-1, -1). The graph runner calls it once per
        step, before the model, to pick one graph for all ranks (a first capture runs the
        step's collectives eagerly once, so every rank must capture the same one together)."""
        step = [num_tokens, table_width, int(not is_ready)]
        most, widest, any_not_ready = self._most_of_any_rank(step, "graph step all_reduce")
        return (-1, -1) if any_not_ready else (most, widest)

    def _most_of_any_rank(self, values: list[int], op: str) -> list[int]:
        """Collective (all ranks, the same call; a host sync): each value's maximum over the
        ranks. `op` names the call in a CollectiveError (a timeout says which step it was)."""
        values = torch.tensor(values, device=self.device)
        with collective_guard(self.rank, op):
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return values.tolist()

    def count_served_rows(self, topk_phys_ids: torch.Tensor) -> torch.Tensor:
        """Collective (all ranks together, once per graph replay): [M, n] physical ids of this
        rank's real rows, M layers -> [M, L] int64 rows every rank sent to this rank's slots."""
        counts = count_rows_per_slot(topk_phys_ids, self.world_size * self.num_local_slots)
        with collective_guard(self.rank, "slot counts all_reduce"):
            dist.all_reduce(counts, group=self.group)
        return counts.view(-1, self.world_size, self.num_local_slots)[:, self.rank]

    def _capacity_tokens(self, x: torch.Tensor, refusal: ValueError | None) -> int:
        """The block size in tokens; raises on every rank when any refused its arguments."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            self._raise_refusal(None, refusal)  # the agreed bucket's shapes, the same on all
            return x.shape[0]  # every rank replays the same agreed bucket size
        # Eager: each rank has its own batch, so the blocks are sized by the largest. Named as
        # the dispatch's first collective: a peer that never dispatches times out here. It
        # carries the refusals too (rank + 1 of the highest refusing rank, else 0).
        step = [0, self.rank + 1] if refusal is not None else [x.shape[0], 0]
        most, refused = self._most_of_any_rank(step, "dispatch token count all_reduce")
        self._raise_refusal(refused - 1 if refused else None, refusal)
        return most

    def _all_to_all(self, send: torch.Tensor, op: str) -> torch.Tensor:
        recv = torch.empty_like(send)
        # Collective: equal splits, so the shapes are the same on every rank.
        with collective_guard(self.rank, op):
            dist.all_to_all_single(recv, send.contiguous(), group=self.group)
        return recv

    def dispatch(
        self,
        x: torch.Tensor,
        topk_phys_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        layout: DispatchLayout | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, CapacityHandle | DispatchHandle]:
        """x [T, D] -> recv_x [R*C, D] (C = T'*K, T' the agreed token count; on CPU only the
        real rows): real rows sorted by (local slot, source rank, token, slot), then padding
        rows; group sizes [L] int64 on x's device (their sum is the real row count); handle.
        In a step begun as eager: AllToAllDispatcher.dispatch's results."""
        if not self._is_graph_step:
            return self._uneven.dispatch(x, topk_phys_ids, topk_weights, layout)
        layout, refusal = self._checked_layout(x, topk_phys_ids, topk_weights, layout)
        num_tokens = self._capacity_tokens(x, refusal)  # raises when any rank refused
        r, slots, k = self.world_size, self.num_local_slots, topk_phys_ids.shape[1]
        capacity = num_tokens * k
        order, send_counts = layout.order, layout.rows_per_slot  # [R*L]: (dest rank, slot)
        # Collective (all ranks, every call, first): counts per (rank, local slot), fixed size.
        recv_counts = self._all_to_all(send_counts, "dispatch counts all_to_all").view(r, slots)
        send_pos = self._send_positions(topk_phys_ids.reshape(-1)[order], send_counts, capacity)
        send_buf = x.new_zeros(r * capacity, x.shape[1])
        # Index assignment: each row once, no arithmetic.
        send_buf[send_pos] = x[layout.token_of_row]
        # Collective (all ranks, right after the counts): one block of C rows per rank.
        recv_buf = self._all_to_all(send_buf, "dispatch all_to_all")
        recv_per_rank = recv_counts.sum(1)
        self._count_remote(send_counts.view(r, slots).sum(1))
        num_remote_back = recv_per_rank.sum() - recv_per_rank[self.rank]
        recv_order = self._expert_order(recv_counts, capacity)
        handle = CapacityHandle(order, send_pos, recv_order, num_remote_back)
        group_sizes = recv_counts.sum(0)
        rows = recv_buf[recv_order]
        if not x.is_cuda:
            # Host sync, CPU only (nothing is captured there): the CPU reference grouped GEMM
            # takes exactly the real rows, where the CUDA ones stop at the group sizes' sum.
            rows = rows[: int(group_sizes.sum())]
        return rows, group_sizes, handle

    def _send_positions(
        self, sent_ids: torch.Tensor, send_counts: torch.Tensor, capacity: int
    ) -> torch.Tensor:
        """[T*K] physical ids in send order -> each row's index in the padded send buffer:
        block dest rank, then its rank among the rows bound there."""
        per_rank = send_counts.view(self.world_size, -1).sum(1)
        first_row = per_rank.cumsum(0) - per_rank  # exclusive: first send-order row per rank
        dest = sent_ids // self.num_local_slots
        within = torch.arange(sent_ids.numel(), device=sent_ids.device) - first_row[dest]
        return dest * capacity + within

    def _expert_order(self, recv_counts: torch.Tensor, capacity: int) -> torch.Tensor:
        """recv_counts [R, L] -> [R*C] buffer indices sorted by (local slot, source rank, token,
        slot), padding rows last, with device ops only."""
        r, slots = recv_counts.shape
        # A block holds its source's rows in (slot, token, slot) order: row i of block s belongs
        # to the first local slot whose cumulative count exceeds i (L: a padding row).
        within = torch.arange(capacity, device=recv_counts.device).expand(r, capacity)
        slot_of_row = torch.searchsorted(recv_counts.cumsum(1), within.contiguous(), right=True)
        # Why this key: buffer index p = s*C + i already runs (source rank, token, slot), so
        # ordering by (local slot, p) is AllToAllDispatcher's stable sort on the local slot.
        buffer_index = torch.arange(r * capacity, device=recv_counts.device)
        keys = slot_of_row.reshape(-1) * (r * capacity) + buffer_index
        return torch.sort(keys, stable=True).indices

    def _count_remote(self, per_rank: torch.Tensor) -> None:
        self._num_remote += per_rank.sum() - per_rank[self.rank]  # in place: graphs replay it

    def combine(
        self, y: torch.Tensor, handle: CapacityHandle | DispatchHandle, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """y [N, D] in recv_x's order (N = R*C, or the real rows only on CPU) -> out [T, D]
        fp32 on the source rank. Rows past the group sizes' sum are never read. A handle of the
        uneven exchange goes home through it."""
        if isinstance(handle, DispatchHandle):
            return self._uneven.combine(y, handle, topk_weights)
        y_buf = y.new_empty(handle.recv_order.numel(), y.shape[1])
        # Index assignment back to the received buffer order (no arithmetic); padding rows go
        # home unread.
        y_buf[handle.recv_order[: y.shape[0]]] = y
        # Collective (all ranks, once per dispatch): every row goes home alone, in the blocks
        # it came in; the source's moe_combine sees all of a token's slots whatever the placement.
        back = self._all_to_all(y_buf, "combine all_to_all")
        self._num_remote += handle.num_remote_back
        # Gather the real rows into send order: AllToAllDispatcher's rows, the same sums.
        return self.moe_combine(back[handle.send_pos], handle.order, topk_weights)
