"""ExpertPlacement: where every logical expert of every MoE layer lives among the physical slots.

One placement per model, all tensors int64 on CPU. Shapes use E logical experts, P = E +
num_redundant physical slots, R ranks (P % R == 0; rank r holds slots [r*P/R, (r+1)*P/R)),
and a layer dimension of size num_layers (the MoE layers only). The placement also fixes,
statically, which replica serves the tokens a source rank sends to a logical expert
(`replica_table`), so routing never depends on batch position or chance.
This module only describes placements; choosing one is `eplb.policy`, moving weights is not
done here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch


def build_logical_to_physical(
    physical_to_logical: torch.Tensor, num_logical: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Derive the inverse maps of a physical_to_logical map.

    physical_to_logical: [num_layers, P] int, values in [0, num_logical).
    Returns (logical_to_physical [num_layers, E, P - E + 1] int64, replicas of one logical
    expert in increasing physical id, padded with -1; replica_count [num_layers, E] int64).
    The width P - E + 1 (the most replicas any expert can have) depends on the model only,
    so the shape stays fixed across rebalances.
    """
    p2l = physical_to_logical.to(torch.int64)
    num_layers, num_physical = p2l.shape
    max_replicas = num_physical - num_logical + 1
    replica_count = torch.zeros(num_layers, num_logical, dtype=torch.int64)
    replica_count.scatter_add_(1, p2l, torch.ones_like(p2l))
    # 1. Group slots by logical expert; the stable sort keeps physical order within a group.
    physical_ids = torch.sort(p2l, dim=1, stable=True).indices
    sorted_logical = p2l.gather(1, physical_ids)
    # 2. Ordinal of each slot within its group: position minus the group's first position.
    group_start = torch.cumsum(replica_count, dim=1) - replica_count
    replica_idx = torch.arange(num_physical) - group_start.gather(1, sorted_logical)
    # 3. Scatter physical ids into the padded table.
    logical_to_physical = torch.full((num_layers, num_logical * max_replicas), -1)
    logical_to_physical.scatter_(1, sorted_logical * max_replicas + replica_idx, physical_ids)
    return logical_to_physical.view(num_layers, num_logical, max_replicas), replica_count


def keep_held_slots(old_p2l: torch.Tensor, new_p2l: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """new_p2l [L, P] with each rank's experts reordered among that rank's own slots so that an
    expert the rank held under old_p2l [L, P] stays in the slot that held it; the rest fill
    the freed slots in new_p2l's order. Every rank holds the same experts as in new_p2l (the
    same dispatch between ranks), a move copies only what a rank did not hold, and a plan
    that only reorders ranks' slots is old_p2l itself (a policy's slot order is arbitrary:
    it re-sorts experts it keeps)."""
    _check_num_ranks(new_p2l.shape[1], num_ranks)
    if old_p2l.shape != new_p2l.shape:
        raise ValueError(f"old {tuple(old_p2l.shape)} and new {tuple(new_p2l.shape)} differ")
    slots = new_p2l.shape[1] // num_ranks
    rows = []
    for old_row, new_row in zip(old_p2l.tolist(), new_p2l.tolist(), strict=True):
        row = []
        for lo in range(0, len(new_row), slots):
            old, new = old_row[lo : lo + slots], new_row[lo : lo + slots]
            row += _held_first(old, new)
        rows.append(row)
    return torch.tensor(rows, dtype=new_p2l.dtype)


def _held_first(old: list[int], new: list[int]) -> list[int]:
    """One rank's slots: new's experts, each one old held kept in old's slot (a copy per
    slot that held it), the others in new's order in the slots left."""
    left = Counter(new)
    kept: list[int | None] = []
    for expert in old:
        if left[expert] > 0:
            kept.append(expert)
            left[expert] -= 1
        else:
            kept.append(None)
    fresh = []
    for expert in new:
        if left[expert] > 0:
            fresh.append(expert)
            left[expert] -= 1
    into = iter(fresh)
    return [next(into) if expert is None else expert for expert in kept]


def _check_num_ranks(num_physical: int, num_ranks: int) -> None:
    if num_ranks < 1 or num_physical % num_ranks != 0:
        raise ValueError(
            f"num_ranks must be >= 1 and divide the number of physical experts; got "
            f"num_physical={num_physical}, num_ranks={num_ranks}"
        )


@dataclass(frozen=True, eq=False)
class ExpertPlacement:
    """physical_to_logical [num_layers, P], logical_to_physical [num_layers, E, P - E + 1]
    (-1 padded, replicas in increasing physical id), replica_count [num_layers, E].

    Built validated: construction raises ValueError on inconsistent maps.
    """

    physical_to_logical: torch.Tensor
    logical_to_physical: torch.Tensor
    replica_count: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("physical_to_logical", "logical_to_physical", "replica_count"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.dtype != torch.int64:
                raise ValueError(f"ExpertPlacement.{name} must be an int64 tensor")
            if value.device.type != "cpu":
                raise ValueError(f"ExpertPlacement.{name} must be on CPU, got {value.device}")
        self.validate()

    @classmethod
    def default(
        cls, num_layers: int, num_logical: int, num_redundant: int, num_ranks: int
    ) -> ExpertPlacement:
        """Logical expert e at slot e; redundant slot E + i holds a replica of expert i % E."""
        if num_layers < 1 or num_logical < 1 or num_redundant < 0:
            raise ValueError(
                "need num_layers >= 1, num_logical >= 1, num_redundant >= 0; got "
                f"num_layers={num_layers}, num_logical={num_logical}, "
                f"num_redundant={num_redundant}"
            )
        num_physical = num_logical + num_redundant
        _check_num_ranks(num_physical, num_ranks)
        row = torch.arange(num_physical) % num_logical
        return cls.from_physical_to_logical(row.expand(num_layers, -1).clone(), num_logical)

    @classmethod
    def from_physical_to_logical(
        cls, physical_to_logical: torch.Tensor, num_logical: int
    ) -> ExpertPlacement:
        """physical_to_logical: [num_layers, P] int, values in [0, num_logical)."""
        p2l = torch.as_tensor(physical_to_logical).to(device="cpu", dtype=torch.int64)
        if p2l.dim() != 2 or p2l.shape[1] < num_logical:
            raise ValueError(
                f"physical_to_logical must be [num_layers, P] with P >= num_logical="
                f"{num_logical}, got shape {tuple(p2l.shape)}"
            )
        if p2l.numel() and (p2l.min() < 0 or p2l.max() >= num_logical):
            raise ValueError(f"physical_to_logical values must lie in [0, {num_logical})")
        logical_to_physical, replica_count = build_logical_to_physical(p2l, num_logical)
        return cls(p2l.contiguous(), logical_to_physical, replica_count)

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical.shape[0]

    @property
    def num_logical(self) -> int:
        return self.replica_count.shape[1]

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    def validate(self) -> None:
        """Raise ValueError unless shapes agree, every logical expert has >= 1 replica and
        logical_to_physical / replica_count are exactly the maps derived from
        physical_to_logical."""
        p2l, l2p, count = self.physical_to_logical, self.logical_to_physical, self.replica_count
        if p2l.dim() != 2 or count.dim() != 2 or l2p.dim() != 3:
            raise ValueError(
                "expected physical_to_logical 2-D, logical_to_physical 3-D, replica_count 2-D"
            )
        num_layers, num_physical = p2l.shape
        num_logical = count.shape[1]
        expected_l2p_shape = (num_layers, num_logical, num_physical - num_logical + 1)
        if count.shape[0] != num_layers or tuple(l2p.shape) != expected_l2p_shape:
            raise ValueError(
                f"shape mismatch: physical_to_logical {tuple(p2l.shape)}, logical_to_physical "
                f"{tuple(l2p.shape)} (want {expected_l2p_shape}), replica_count "
                f"{tuple(count.shape)}"
            )
        if p2l.min() < 0 or p2l.max() >= num_logical:
            raise ValueError(f"physical_to_logical values must lie in [0, {num_logical})")
        if (count < 1).any():
            layer, expert = (count < 1).nonzero()[0].tolist()
            raise ValueError(f"logical expert {expert} of layer {layer} has no replica")
        expected_l2p, expected_count = build_logical_to_physical(p2l, num_logical)
        if not torch.equal(count, expected_count):
            raise ValueError("replica_count disagrees with physical_to_logical")
        if not torch.equal(l2p, expected_l2p):
            raise ValueError("logical_to_physical disagrees with physical_to_logical")

    def local_experts(self, rank: int, num_ranks: int) -> torch.Tensor:
        """[num_layers, P/R] logical ids held by the slots of `rank`, in slot order."""
        _check_num_ranks(self.num_physical, num_ranks)
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank must lie in [0, {num_ranks}), got {rank}")
        slots_per_rank = self.num_physical // num_ranks
        start = rank * slots_per_rank
        return self.physical_to_logical[:, start : start + slots_per_rank].clone()

    def replica_table(self, num_ranks: int) -> torch.Tensor:
        """[num_layers, R, E] int64: the physical slot that serves tokens sent from source rank
        r to logical expert e.

        Static rule, a function of the placement and (layer, r, e) only: the first replica (in
        physical order) held by rank r itself if there is one; otherwise replica number j %
        replica_count[layer, e] in physical order, j being r's place among the ranks holding
        no copy (r less the copies on ranks below it), so the ranks without a copy are dealt
        round the copies in turn and each copy serves its own rank and an equal share of the
        others (to one). (The rule before, r % replica_count, could deal them unevenly: copies
        on ranks 1 and 3 of 4 took ranks 0 and 2 both on the first copy, 3 source ranks against
        1; the planner's model of the dispatch, eplb.policy.load_per_rank, reads this table.)
        It never looks at the batch, so a token's result does not depend on which other
        tokens share the step (batch invariance).
        """
        _check_num_ranks(self.num_physical, num_ranks)
        slots_per_rank = self.num_physical // num_ranks
        l2p = self.logical_to_physical
        # Padding sorts last (rank R); holders are in increasing physical id, so in rank order.
        holder_rank = torch.where(l2p >= 0, l2p // slots_per_rank, num_ranks)  # [L, E, M]
        ranks = torch.arange(num_ranks).expand(self.num_layers, self.num_logical, -1)
        # Why one searchsorted, not a loop over ranks: at 64 ranks, 256 experts and 64 spare
        # slots the loop took 0.6 s of the driver's and every worker's time between two steps.
        # copies_below [L, E, R]: copies on ranks below r, and the index of r's first copy.
        copies_below = torch.searchsorted(holder_rank.contiguous(), ranks.contiguous())
        is_local = holder_rank.gather(2, copies_below.clamp(max=l2p.shape[2] - 1)) == ranks
        spread_idx = (ranks - copies_below) % self.replica_count.unsqueeze(2)
        replica_idx = torch.where(is_local, copies_below, spread_idx)
        table = l2p.gather(2, replica_idx).transpose(1, 2).contiguous()  # [L, R, E]
        return table

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExpertPlacement):
            return NotImplemented
        return torch.equal(self.physical_to_logical, other.physical_to_logical) and (
            self.num_logical == other.num_logical
        )
