"""Moving expert weights from one placement to another, between steps, all-or-nothing.

Every rank derives the same transfer plan from (old, new) physical_to_logical alone: a new slot
whose logical expert this rank already holds is copied locally; any other is sent by the rank
holding that expert's lowest-id old replica. Layers move one at a time (one all_to_all_single of
weight rows each, so transfer buffers stay bounded by one layer) into staging tensors. Before
each exchange, and once after the last layer, a MIN all-reduce of every rank's success flag
decides on all ranks at once whether to go on (and at the end, to commit); the old weights stay
in use until then, so a failure leaves the old placement serving. A rank whose own work fails
(out of memory while staging, say) votes no at the next vote and all ranks stop there together:
it allocates nothing more and never leaves the collectives. Staging holds one full copy of this
rank's experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from comm.errors import collective_guard


@dataclass(frozen=True)
class Transfer:
    layer: int
    src_rank: int
    src_slot: int  # local slot on src_rank in the old placement
    dst_rank: int
    dst_slot: int  # local slot on dst_rank in the new placement


@dataclass(frozen=True)
class RearrangeResult:
    ok: bool  # every rank staged every layer: the weights are to be committed
    weights: list[tuple[torch.Tensor, torch.Tensor]] | None  # per layer (gate_up, down) staged
    experts_moved: int  # (layer, slot) pairs whose logical expert changed, on this rank
    bytes_sent: int  # bytes this rank sent to other ranks
    error: str | None = None  # this rank's local failure, if it had one


def plan_transfers(old_p2l: torch.Tensor, new_p2l: torch.Tensor, num_ranks: int) -> list[Transfer]:
    """All transfers of a rebalance, in (layer, dst_rank, dst_slot) order; [L, P] int maps."""
    num_layers, num_physical = new_p2l.shape
    slots = num_physical // num_ranks
    transfers = []
    for layer in range(num_layers):
        old = old_p2l[layer].tolist()
        for physical, logical in enumerate(new_p2l[layer].tolist()):
            dst_rank, dst_slot = divmod(physical, slots)
            own = [p for p in range(dst_rank * slots, (dst_rank + 1) * slots) if old[p] == logical]
            src = own[0] if own else old.index(logical)  # lowest-id old replica otherwise
            transfers.append(Transfer(layer, src // slots, src % slots, dst_rank, dst_slot))
    return transfers


def rearrange_experts(
    experts: list[tuple[torch.Tensor, torch.Tensor]],
    old_p2l: torch.Tensor,
    new_p2l: torch.Tensor,
    rank: int,
    num_ranks: int,
    group: dist.ProcessGroup | None,
    fail_at_layer: int | None = None,
) -> RearrangeResult:
    """Stage this rank's experts under the new placement; collective over `group` when R > 1.

    experts: per MoE layer (gate_up_proj [S, 2I, D], down_proj [S, D, I]) of this rank's S slots
    under old_p2l. A local error (out of memory allocating the staging copy or a transfer
    buffer, a failed copy) does not escape: this rank drops what it staged and votes no at the
    next vote, where every rank stops (had it left, its peers would wait in the next exchange
    until the collective timeout, and the engine would die though nothing had changed); `error`
    names the failure. Only a failed collective raises (CollectiveError): then the ranks are out
    of step. fail_at_layer: fault injection, a local error at that layer.
    """
    transfers = plan_transfers(old_p2l, new_p2l, num_ranks)
    slots = new_p2l.shape[1] // num_ranks
    device = experts[0][0].device if experts else "cpu"
    error, staged, bytes_sent, is_stopped = None, [], 0, False
    for layer, (gate_up, down) in enumerate(experts):
        mine = [t for t in transfers if t.layer == layer]
        exchange = _LayerExchange.of(mine, layer, rank, num_ranks, _row_width(gate_up, down))
        new_weights = send = recv = None
        if error is None:
            try:
                if fail_at_layer == layer:
                    raise RuntimeError(f"injected failure at layer {layer}")
                new_weights = torch.empty_like(gate_up), torch.empty_like(down)
                send, recv = exchange.buffers(gate_up, down)
            except Exception as exc:  # this rank's own: it fails, the ranks stay in step
                error, staged, new_weights = _local_error(layer, exc), [], None
        # Why a vote before each exchange, not placeholders of the agreed sizes for a rank that
        # failed: a placeholder as large as the buffers that just ran out of memory could run
        # out too, and escape the collectives. Every rank derives is_collective from the same
        # plan, so all vote here together; one no and every rank stops before the exchange.
        if exchange.is_collective and not _all_ok(error is None, rank, num_ranks, group, device):
            is_stopped = True
            break
        if error is not None:  # no exchange in this layer: the next vote tells the peers
            continue
        bytes_sent += exchange.run(send, recv, group)
        try:
            exchange.unpack(gate_up, down, recv, new_weights)
            staged.append(new_weights)
        except Exception as exc:
            error, staged = _local_error(layer, exc), []
        # Why: the next layer's buffers are allocated with this layer's gone (one layer's
        # transfer rows at a time, not two).
        send = recv = new_weights = None
    ok = not is_stopped and _all_ok(error is None, rank, num_ranks, group, device)
    lo, hi = rank * slots, (rank + 1) * slots
    moved = int((old_p2l[:, lo:hi] != new_p2l[:, lo:hi]).sum())
    return RearrangeResult(ok, staged if ok else None, moved, bytes_sent, error)


def _local_error(layer: int, exc: Exception) -> str:
    return f"layer {layer}: {type(exc).__name__}: {exc}"


def _row_width(gate_up: torch.Tensor, down: torch.Tensor) -> int:
    """Elements of one slot's weights, gate_up then down, as they travel flattened."""
    return gate_up[0].numel() + down[0].numel()


@dataclass(frozen=True)
class _LayerExchange:
    """One layer's transfers as `rank` takes part in them: slots it copies locally, rows it
    sends (in (dst_rank, dst_slot) order) and receives (in (src_rank, dst_slot) order, the
    all_to_all's output order). Every rank derives them from the same plan, so the split sizes
    of the exchange agree on all ranks."""

    layer: int
    rank: int
    num_ranks: int
    width: int  # elements of one slot's flattened rows
    local: list[Transfer]
    sends: list[Transfer]
    recvs: list[Transfer]
    is_collective: bool  # some row crosses ranks: every rank joins this layer's all_to_all

    @classmethod
    def of(
        cls, transfers: list[Transfer], layer: int, rank: int, num_ranks: int, width: int
    ) -> _LayerExchange:
        """transfers: every rank's transfers of this layer, in plan_transfers order."""
        remote = [t for t in transfers if t.src_rank != t.dst_rank]
        return cls(
            layer,
            rank,
            num_ranks,
            width,
            local=[t for t in transfers if t.src_rank == t.dst_rank == rank],
            sends=[t for t in remote if t.src_rank == rank],  # already in (dst_rank, dst_slot)
            recvs=sorted(
                (t for t in remote if t.dst_rank == rank), key=lambda t: (t.src_rank, t.dst_slot)
            ),
            is_collective=num_ranks > 1 and bool(remote),
        )

    def buffers(self, gate_up, down) -> tuple[torch.Tensor, torch.Tensor]:
        """(send: the rows this rank sends, flattened; recv: room for the rows it receives)."""
        rows = [
            torch.cat([gate_up[t.src_slot].reshape(-1), down[t.src_slot].reshape(-1)])
            for t in self.sends
        ]
        send = torch.cat(rows) if rows else gate_up.new_empty(0)
        return send, gate_up.new_empty(len(self.recvs) * self.width)

    def run(self, send: torch.Tensor, recv: torch.Tensor, group) -> int:
        """The layer's all_to_all_single, unless no row crosses ranks; -> bytes sent."""
        if not self.is_collective:
            # Every rank computes the same plan, so all skip this layer's collective together.
            return 0
        send_splits = [sum(t.dst_rank == r for t in self.sends) for r in range(self.num_ranks)]
        recv_splits = [sum(t.src_rank == r for t in self.recvs) for r in range(self.num_ranks)]
        # Collective: every rank of the group exchanges this layer's weights at the same point
        # (each voted before it that it has its buffers).
        with collective_guard(self.rank, f"expert weight all_to_all (layer {self.layer})"):
            dist.all_to_all_single(
                recv,
                send,
                [n * self.width for n in recv_splits],
                [n * self.width for n in send_splits],
                group=group,
            )
        return send.numel() * send.element_size()

    def unpack(self, gate_up, down, recv, new_weights) -> None:
        """Fill this rank's new slots: local copies from gate_up / down, the rest from recv."""
        new_gate_up, new_down = new_weights
        for t in self.local:
            new_gate_up[t.dst_slot], new_down[t.dst_slot] = gate_up[t.src_slot], down[t.src_slot]
        num_gate_up = gate_up[0].numel()
        for i, t in enumerate(self.recvs):
            flat = recv[i * self.width : (i + 1) * self.width]
            new_gate_up[t.dst_slot] = flat[:num_gate_up].view_as(gate_up[0])
            new_down[t.dst_slot] = flat[num_gate_up:].view_as(down[0])


def _all_ok(ok: bool, rank: int, num_ranks: int, group, device) -> bool:
    if num_ranks == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    # Collective: a vote, before a layer's exchange or after the last layer (the commit); every
    # rank joins each at the same point of the same plan. Host sync: the ranks branch on it.
    with collective_guard(rank, "rebalance vote all_reduce"):
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
