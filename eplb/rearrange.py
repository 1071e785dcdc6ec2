"""Moving expert weights from one placement to another, between steps, all-or-nothing.

Every rank derives the same transfer plan from (old, new) physical_to_logical alone: a new slot
whose logical expert this rank already holds is copied locally; any other is sent by the rank
holding that expert's lowest-id old replica. Layers move one at a time (one all_to_all_single of
weight rows each, so transfer buffers stay bounded by one layer) into staging tensors; a final
MIN all-reduce of every rank's success flag decides, on all ranks at once, whether the staged
weights are committed or dropped. The old weights stay in use until then, so a failure leaves
the old placement serving. Staging holds one full copy of this rank's experts.
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
    ok: bool
    weights: list[tuple[torch.Tensor, torch.Tensor]] | None  # per layer (gate_up, down) staged
    experts_moved: int  # (layer, slot) pairs whose logical expert changed, on this rank
    bytes_sent: int  # bytes this rank sent to other ranks


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
    under old_p2l. fail_at_layer: fault injection — this rank marks itself failed at that layer
    (it keeps joining every collective, as a rank with a real local error must).
    """
    transfers = plan_transfers(old_p2l, new_p2l, num_ranks)
    slots = new_p2l.shape[1] // num_ranks
    ok, staged, bytes_sent = True, [], 0
    for layer, (gate_up, down) in enumerate(experts):
        mine = [t for t in transfers if t.layer == layer]
        new_gate_up, new_down = torch.empty_like(gate_up), torch.empty_like(down)
        received, sent = _exchange_layer(gate_up, down, mine, rank, num_ranks, group)
        bytes_sent += sent
        for t in mine:
            if t.dst_rank != rank:
                continue
            is_local = t.src_rank == rank
            rows = (gate_up[t.src_slot], down[t.src_slot]) if is_local else received.pop(0)
            new_gate_up[t.dst_slot], new_down[t.dst_slot] = rows
        if fail_at_layer == layer:
            ok = False
        staged.append((new_gate_up, new_down))
    ok = _all_ok(ok, rank, num_ranks, group, experts[0][0].device if experts else "cpu")
    lo, hi = rank * slots, (rank + 1) * slots
    moved = int((old_p2l[:, lo:hi] != new_p2l[:, lo:hi]).sum())
    return RearrangeResult(ok, staged if ok else None, moved, bytes_sent)


def _exchange_layer(
    gate_up, down, transfers, rank, num_ranks, group
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """One all_to_all_single of flattened expert weights for one layer's remote transfers.
    Returns the received (gate_up, down) rows in `transfers` order and the bytes sent."""
    remote = [t for t in transfers if t.src_rank != t.dst_rank]
    if num_ranks == 1 or not remote:
        # Every rank computes the same plan, so all skip this layer's collective together.
        return [], 0
    width = gate_up[0].numel() + down[0].numel()
    sends = [t for t in remote if t.src_rank == rank]  # already in (dst_rank, dst_slot) order
    recvs = sorted(
        (t for t in remote if t.dst_rank == rank), key=lambda t: (t.src_rank, t.dst_slot)
    )
    rows = [
        torch.cat([gate_up[t.src_slot].reshape(-1), down[t.src_slot].reshape(-1)]) for t in sends
    ]
    send = torch.cat(rows) if rows else gate_up.new_empty(0)
    recv = gate_up.new_empty(len(recvs) * width)
    send_splits = [width * sum(t.dst_rank == r for t in sends) for r in range(num_ranks)]
    recv_splits = [width * sum(t.src_rank == r for t in recvs) for r in range(num_ranks)]
    # Collective: every rank of the group exchanges this layer's weights at the same point.
    with collective_guard(
        rank, f"expert weight all_to_all (layer {len(transfers) and transfers[0].layer})"
    ):
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    rows_by_slot = {}
    for i, t in enumerate(recvs):
        flat = recv[i * width : (i + 1) * width]
        rows_by_slot[t.dst_slot] = (
            flat[: gate_up[0].numel()].view_as(gate_up[0]),
            flat[gate_up[0].numel() :].view_as(down[0]),
        )
    ordered = [
        rows_by_slot[t.dst_slot] for t in transfers if t.dst_rank == rank and t.src_rank != rank
    ]
    return ordered, send.numel() * send.element_size()


def _all_ok(ok: bool, rank: int, num_ranks: int, group, device) -> bool:
    if num_ranks == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    # Collective: the commit decision; every rank joins after its last layer.
    with collective_guard(rank, "rebalance commit all_reduce"):
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
