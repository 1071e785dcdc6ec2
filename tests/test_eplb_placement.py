"""ExpertPlacement: the default layout, derived maps, the static replica table, per-rank slots
and validation errors."""

from __future__ import annotations

import itertools

import pytest
import torch

from eplb import ExpertPlacement, keep_held_slots, rebalance_experts


def test_default_without_redundancy():
    placement = ExpertPlacement.default(num_layers=3, num_logical=8, num_redundant=0, num_ranks=4)
    assert placement.physical_to_logical.tolist() == [list(range(8))] * 3
    assert placement.logical_to_physical.shape == (3, 8, 1)
    assert placement.logical_to_physical[:, :, 0].tolist() == [list(range(8))] * 3
    assert (placement.replica_count == 1).all()
    assert (placement.num_layers, placement.num_logical, placement.num_physical) == (3, 8, 8)


def test_default_redundant_slots_round_robin():
    placement = ExpertPlacement.default(num_layers=1, num_logical=3, num_redundant=5, num_ranks=2)
    assert placement.physical_to_logical.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]]
    assert placement.replica_count.tolist() == [[3, 3, 2]]
    assert placement.logical_to_physical.tolist() == [
        [[0, 3, 6, -1, -1, -1], [1, 4, 7, -1, -1, -1], [2, 5, -1, -1, -1, -1]]
    ]
    assert placement.num_redundant == 5


def test_default_rejects_uneven_ranks():
    with pytest.raises(ValueError, match="num_physical=10, num_ranks=4"):
        ExpertPlacement.default(num_layers=2, num_logical=8, num_redundant=2, num_ranks=4)
    with pytest.raises(ValueError, match="num_redundant=-1"):
        ExpertPlacement.default(num_layers=2, num_logical=8, num_redundant=-1, num_ranks=1)


def test_from_physical_to_logical_round_trip(generator):
    weight = torch.randint(0, 1000, (4, 64), generator=generator)
    plan = rebalance_experts(weight, num_replicas=80, num_groups=8, num_nodes=4, num_gpus=16)
    placement = ExpertPlacement.from_physical_to_logical(plan[0], num_logical=64)
    assert torch.equal(placement.physical_to_logical, plan[0])
    assert torch.equal(placement.logical_to_physical, plan[1])
    assert torch.equal(placement.replica_count, plan[2])
    assert placement == ExpertPlacement(*plan)
    # Replicas listed in increasing physical id, each slot exactly once.
    l2p = placement.logical_to_physical
    padded = torch.where(l2p >= 0, l2p, torch.iinfo(torch.int64).max)
    assert torch.equal(padded, padded.sort(dim=2).values)
    for layer in range(4):
        assert sorted(l2p[layer][l2p[layer] >= 0].tolist()) == list(range(80))


def test_replica_table_rule():
    # 4 ranks x 2 slots. Expert 0: slots 0,1 (rank 0). Expert 1: 2 (rank 1), 6 (rank 3).
    # Expert 2: 3 (rank 1), 7 (rank 3). Expert 3: 4,5 (rank 2).
    placement = ExpertPlacement.from_physical_to_logical(
        torch.tensor([[0, 0, 1, 2, 3, 3, 1, 2]]), num_logical=4
    )
    table = placement.replica_table(num_ranks=4)
    assert table.shape == (1, 4, 4)
    # Rows: source rank; columns: logical expert. Local replica first (lowest slot), else
    # replica number j % replica_count in physical order, j the rank's place among the ranks
    # holding no copy: experts 1 and 2 (copies on ranks 1 and 3) deal ranks 0 and 2 one to
    # each copy (rank % replica_count sent both to the first: 3 source ranks against 1).
    assert table[0].tolist() == [
        [0, 2, 3, 4],
        [1, 2, 3, 5],
        [0, 6, 7, 4],
        [1, 6, 7, 5],
    ]


@pytest.mark.parametrize("num_ranks", [1, 4, 16])
def test_replica_table_properties(num_ranks, generator):
    weight = torch.randint(0, 1000, (3, 64), generator=generator)
    placement = ExpertPlacement(*rebalance_experts(weight, 80, 8, 4, 16))
    table = placement.replica_table(num_ranks)
    slots_per_rank = placement.num_physical // num_ranks
    num_layers, num_logical = 3, 64
    served = placement.physical_to_logical.gather(1, table.view(num_layers, -1))
    assert torch.equal(
        served.view(num_layers, num_ranks, num_logical),
        torch.arange(num_logical).expand(num_layers, num_ranks, -1),
    )
    holder = placement.physical_to_logical.view(num_layers, num_ranks, slots_per_rank)
    for rank in range(num_ranks):
        has_local = (holder[:, rank].unsqueeze(2) == torch.arange(num_logical)).any(dim=1)
        is_local = table[:, rank] // slots_per_rank == rank
        assert torch.equal(has_local, is_local)
    assert torch.equal(table, placement.replica_table(num_ranks))


def test_replica_table_without_redundancy_is_the_only_replica():
    placement = ExpertPlacement.default(num_layers=2, num_logical=8, num_redundant=0, num_ranks=4)
    table = placement.replica_table(num_ranks=4)
    assert torch.equal(table, torch.arange(8).expand(2, 4, 8))


def test_local_experts():
    placement = ExpertPlacement.default(num_layers=2, num_logical=6, num_redundant=2, num_ranks=4)
    assert placement.local_experts(rank=3, num_ranks=4).tolist() == [[0, 1], [0, 1]]
    parts = [placement.local_experts(r, num_ranks=2) for r in range(2)]
    assert torch.equal(torch.cat(parts, dim=1), placement.physical_to_logical)
    with pytest.raises(ValueError, match="rank"):
        placement.local_experts(rank=4, num_ranks=4)
    with pytest.raises(ValueError, match="num_ranks=3"):
        placement.local_experts(rank=0, num_ranks=3)


def _maps():
    return ExpertPlacement.default(num_layers=2, num_logical=4, num_redundant=2, num_ranks=2)


def test_validate_accepts_consistent_maps():
    placement = _maps()
    placement.validate()
    ExpertPlacement(
        placement.physical_to_logical.clone(),
        placement.logical_to_physical.clone(),
        placement.replica_count.clone(),
    )


def test_validate_missing_expert():
    with pytest.raises(ValueError, match="logical expert 3 of layer 1 has no replica"):
        ExpertPlacement.from_physical_to_logical(
            torch.tensor([[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]), num_logical=4
        )


def test_validate_inconsistent_maps():
    good = _maps()
    p2l, l2p, count = good.physical_to_logical, good.logical_to_physical, good.replica_count
    swapped = l2p.clone()
    swapped[0, 0, :2] = swapped[0, 0, :2].flip(0)
    with pytest.raises(ValueError, match="logical_to_physical disagrees"):
        ExpertPlacement(p2l, swapped, count)
    moved = p2l.clone()
    moved[1, 5] = 3
    with pytest.raises(ValueError, match="replica_count disagrees"):
        ExpertPlacement(moved, l2p, count)
    with pytest.raises(ValueError, match="shape mismatch"):
        ExpertPlacement(p2l, l2p[:, :, :2], count)
    with pytest.raises(ValueError, match="int64"):
        ExpertPlacement(p2l.int(), l2p, count)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        ExpertPlacement.from_physical_to_logical(p2l + 1, num_logical=4)


@pytest.mark.parametrize(
    "num_logical,num_physical,num_ranks", [(8, 16, 4), (6, 12, 1), (12, 20, 5)]
)
def test_replica_table_matches_its_rule_written_per_entry(
    num_logical, num_physical, num_ranks, generator
):
    """The vectorized table against its docstring's rule, one (layer, rank, expert) at a time,
    on random placements (several copies of an expert on one rank among them)."""
    extra = torch.randint(0, num_logical, (4, num_physical - num_logical), generator=generator)
    p2l = torch.cat([torch.arange(num_logical).expand(4, -1), extra], dim=1)
    p2l = p2l.gather(
        1, torch.stack([torch.randperm(num_physical, generator=generator) for _ in range(4)])
    )
    placement = ExpertPlacement.from_physical_to_logical(p2l, num_logical)
    slots = num_physical // num_ranks
    table = placement.replica_table(num_ranks)
    for layer, rank, expert in itertools.product(range(4), range(num_ranks), range(num_logical)):
        copies = [p for p in range(num_physical) if p2l[layer, p] == expert]
        own = [p for p in copies if p // slots == rank]
        below = sum(p // slots < rank for p in copies)
        expected = own[0] if own else copies[(rank - below) % len(copies)]
        assert table[layer, rank, expert] == expected


def test_keep_held_slots_leaves_what_a_rank_keeps_in_its_slot():
    old = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    # A plan that only reorders each rank's slots is the old placement itself.
    assert keep_held_slots(old, torch.tensor([[3, 2, 1, 0, 7, 6, 5, 4]]), 2).equal(old)
    # Rank 0 keeps 0, 2, 3 and gains 9 in the slot 1 left; rank 1 keeps 5, 6, 7, gains 1.
    new = torch.tensor([[3, 2, 9, 0, 7, 6, 5, 1]])
    assert keep_held_slots(old, new, 2).tolist() == [[0, 9, 2, 3, 1, 5, 6, 7]]
    # Copies of one expert on one rank (world size 1's extra copies) are kept a slot each.
    assert keep_held_slots(
        torch.tensor([[0, 0, 1, 2]]), torch.tensor([[2, 0, 3, 0]]), 1
    ).tolist() == [[0, 0, 3, 2]]


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_keep_held_slots_keeps_each_ranks_experts_and_moves_no_more_than_the_plan(
    num_ranks, generator
):
    """Random plans from rebalance_experts: every rank holds the plan's experts (as a
    multiset), and no more slots change than in the plan as it came."""
    old = ExpertPlacement.default(2, 16, 8, num_ranks).physical_to_logical
    for _ in range(20):
        load = torch.randint(0, 100, (2, 16), generator=generator)
        plan, _, _ = rebalance_experts(load, 24, 4, 1, num_ranks)
        kept = keep_held_slots(old, plan, num_ranks)
        slots = 24 // num_ranks
        for layer in range(2):
            for lo in range(0, 24, slots):
                assert sorted(kept[layer, lo : lo + slots].tolist()) == sorted(
                    plan[layer, lo : lo + slots].tolist()
                )
        assert (kept != old).sum() <= (plan != old).sum()
        ExpertPlacement.from_physical_to_logical(kept, 16)  # validates
        old = kept
