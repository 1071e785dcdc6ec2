"""Dispatch/combine over gloo at 2, 4 and 8 ranks, bitwise against one process.

Each rank owns L physical slots; the expert function is `grouped_linear_ref` (per-row invariant),
so every layout and placement must reproduce the single-process LocalDispatcher result bit for
bit. The data holds a rank with no tokens, an unused physical slot, uneven counts, and tokens
with several slots on one rank. Negative controls: with multiple reduction (even with the
invariant combine op), or with the fast combine op (index_add_ in arrival order), the same
tokens under a permuted placement give other bits, while the invariant path still matches.
"""

from __future__ import annotations

import pytest
import torch

from comm import AllToAllDispatcher, LocalDispatcher, destroy_process_groups, init_process_groups
from comm.dispatch import dispatch_layout
from moe_kernels.combine import moe_combine_fast, moe_combine_ref
from moe_kernels.linear import grouped_linear_ref
from tests.test_comm_groups import BACKENDS, MASTER_ADDR, backend_config, run_ranks

NUM_LOCAL_SLOTS = 2
HIDDEN = 16
TOP_K = 3
TILE_ROWS = 4
# Placements: 1 keeps the order of the physical ids a token uses (only which slots share a
# rank moves); 3 wraps some of them round, so rows come home in another order too.
SHIFTS = (0, 1, 3)
# Result key -> (allow_multiple_reduction, the op table's moe_combine).
MODES = {
    False: (False, moe_combine_ref),
    True: (True, moe_combine_ref),
    "fast": (False, moe_combine_fast),
}


def num_tokens(rank: int) -> int:
    """Uneven per-rank token counts; rank 1 sends nothing."""
    return 0 if rank == 1 else 3 + (5 * rank + 2) % 7


def make_case(world_size: int) -> dict:
    """Global data every process rebuilds from one seed: tokens, routing, expert weights."""
    num_slots = world_size * NUM_LOCAL_SLOTS
    gen = torch.Generator().manual_seed(world_size)
    weight = torch.randn(num_slots, HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5
    xs, ids, topk_weights = [], [], []
    for rank in range(world_size):
        t = num_tokens(rank)
        xs.append(torch.randn(t, HIDDEN, generator=gen))
        # Distinct slots per token, never the last slot (an expert with zero tokens).
        rows = [torch.randperm(num_slots - 1, generator=gen)[:TOP_K] for _ in range(t)]
        rank_ids = torch.stack(rows) if rows else torch.empty(0, TOP_K, dtype=torch.int64)
        if t:
            # Token 0: all K slots on ranks 0 and 1, two of them on rank 0.
            rank_ids[0] = torch.tensor([1, NUM_LOCAL_SLOTS, 0])
        ids.append(rank_ids)
        topk_weights.append(torch.rand(t, TOP_K, generator=gen))
    return {"x": xs, "ids": ids, "weights": topk_weights, "expert_weight": weight}


def shifted_placement(case: dict, shift: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Move physical slot p to (p + shift) % P, weights with it: same math, other ranks."""
    num_slots = case["expert_weight"].shape[0]
    perm = (torch.arange(num_slots, device=case["expert_weight"].device) + shift) % num_slots
    weight = torch.empty_like(case["expert_weight"])
    weight[perm] = case["expert_weight"]
    return [perm[ids] for ids in case["ids"]], weight


def run_moe(dispatcher, x, ids, topk_weights, local_weight) -> tuple[torch.Tensor, list[int]]:
    recv_x, group_sizes, handle = dispatcher.dispatch(x, ids, topk_weights)
    y = grouped_linear_ref(recv_x, local_weight, group_sizes, tile_rows=TILE_ROWS)
    return dispatcher.combine(y, handle, topk_weights), group_sizes


def _dispatch_worker(rank: int, world_size: int, port: int, backend: str) -> dict:
    config = backend_config(world_size, backend)
    if config.device == "cuda":
        torch.cuda.set_device(rank)
    groups = init_process_groups(config, rank, MASTER_ADDR, port)
    case = to_device(make_case(world_size), groups.device)
    x, topk_weights = case["x"][rank], case["weights"][rank]
    local = slice(rank * NUM_LOCAL_SLOTS, (rank + 1) * NUM_LOCAL_SLOTS)
    result = {}
    # Collectives: every rank runs the same dispatch/combine sequence, rank 1 with 0 tokens.
    for mode, (allow_multiple_reduction, combine) in MODES.items():
        dispatcher = AllToAllDispatcher(
            groups.ep_group,
            rank,
            world_size,
            NUM_LOCAL_SLOTS,
            allow_multiple_reduction,
            groups.device,
            combine,
        )
        for shift in SHIFTS:
            ids, weight = shifted_placement(case, shift)
            out, group_sizes = run_moe(dispatcher, x, ids[rank], topk_weights, weight[local])
            result[mode, shift] = out
            result["group_sizes", mode, shift] = group_sizes
        result["num_rows_sent_remote", mode] = dispatcher.num_rows_sent_remote
    # The receive order itself: dispatch each token's (rank, token) tag.
    dispatcher = AllToAllDispatcher(
        groups.ep_group, rank, world_size, NUM_LOCAL_SLOTS, False, groups.device, moe_combine_ref
    )
    tags = torch.stack([torch.full((len(x),), rank), torch.arange(len(x))], dim=1)
    tags = tags.double().to(groups.device)
    result["recv_tags"], _, _ = dispatcher.dispatch(tags, case["ids"][rank], topk_weights)
    destroy_process_groups()
    return to_device(result, torch.device("cpu"))


def to_device(tree, device: torch.device):
    """Every tensor inside dicts/lists moved to device; other leaves as they are."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {key: to_device(value, device) for key, value in tree.items()}
    if isinstance(tree, list):
        return [to_device(value, device) for value in tree]
    return tree


def expected_recv_tags(case: dict, rank: int) -> torch.Tensor:
    """(source rank, token) of each row rank receives, in (local slot, source rank, token, slot)."""
    tags = []
    for slot in range(rank * NUM_LOCAL_SLOTS, (rank + 1) * NUM_LOCAL_SLOTS):
        for source, ids in enumerate(case["ids"]):
            tags += [(source, token) for token in range(len(ids)) if slot in ids[token].tolist()]
    return torch.tensor(tags, dtype=torch.float64).reshape(-1, 2)


def reference(case: dict, device: str) -> list[torch.Tensor]:
    """Single process: every token of every rank through LocalDispatcher with all P slots."""
    case = to_device(case, torch.device(device))
    num_slots = case["expert_weight"].shape[0]
    dispatcher = LocalDispatcher(num_slots, moe_combine_ref)
    x, ids, w = (torch.cat(case[key]) for key in ("x", "ids", "weights"))
    out, _ = run_moe(dispatcher, x, ids, w, case["expert_weight"])
    assert dispatcher.num_rows_sent_remote == 0
    return list(out.cpu().split([len(t) for t in case["x"]]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_dispatch_combine_bitwise_equal_to_one_process(tmp_path, world_size, backend):
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA devices")
    case = make_case(world_size)
    results = run_ranks(_dispatch_worker, world_size, tmp_path, backend)
    # The reference runs on rank 0's device kind: GPU bits are compared with GPU bits.
    device = "cpu" if backend == "gloo" else "cuda:0"
    expected = reference(case, device)
    num_differ = {True: 0, "fast": 0}
    for rank, res in enumerate(results):
        assert res[False, 0].dtype == torch.float32
        assert res[False, 0].shape == (num_tokens(rank), HIDDEN)
        # Invariant path: every placement gives the single-process bits.
        for shift in SHIFTS:
            assert torch.equal(res[False, shift], expected[rank])
        # Multiple reduction, fast combine: the same sums, in a placement-dependent order.
        for mode in num_differ:
            for shift in SHIFTS:
                torch.testing.assert_close(res[mode, shift], expected[rank])
                num_differ[mode] += int((res[mode, 0] != res[mode, shift]).any(dim=1).sum())
        assert torch.equal(res["recv_tags"], expected_recv_tags(case, rank))
        # Engagement: rows crossed ranks in both modes, never more with pre-reduction.
        assert res["num_rows_sent_remote", False] >= res["num_rows_sent_remote", True] > 0
    # Negative controls: some token's bits moved with the placement in both modes.
    assert num_differ[True] > 0 and num_differ["fast"] > 0, num_differ
    sent = {mode: sum(res["num_rows_sent_remote", mode] for res in results) for mode in (0, 1)}
    assert sent[False] > sent[True], "pre-reduction never merged two slots of a token"
    # The last physical slot is never routed to: its expert ran with zero rows.
    last_rank = results[world_size - 1]
    assert last_rank["group_sizes", False, 0][-1] == 0


def test_local_dispatcher_groups_rows_by_slot(generator):
    x = torch.randn(4, HIDDEN, generator=generator)
    ids = torch.tensor([[2, 0], [1, 2], [0, 1], [2, 1]])
    w = torch.rand(4, 2, generator=generator)
    recv_x, group_sizes, handle = LocalDispatcher(4, moe_combine_ref).dispatch(x, ids, w)
    assert group_sizes.tolist() == [2, 3, 3, 0]
    # Rows by slot, then token: slot 0 <- tokens 0, 2; slot 1 <- 1, 2, 3; slot 2 <- 0, 1, 3.
    assert torch.equal(recv_x, x[[0, 2, 1, 2, 3, 0, 1, 3]])
    out = LocalDispatcher(4, moe_combine_ref).combine(recv_x, handle, w)
    assert torch.equal(out, w[:, 0:1] * x + w[:, 1:2] * x)


def test_dispatch_rejects_bad_routing():
    dispatcher = LocalDispatcher(2, moe_combine_ref)
    x = torch.zeros(2, HIDDEN)
    with pytest.raises(ValueError, match=r"lie in \[0, 2\)"):
        dispatcher.dispatch(x, torch.tensor([[0], [2]]), torch.ones(2, 1))
    with pytest.raises(ValueError, match="int64"):
        dispatcher.dispatch(x, torch.tensor([[0], [1]], dtype=torch.int32), torch.ones(2, 1))


def test_precomputed_layout_gives_the_same_dispatch(generator):
    # The DeepEP-shaped seam: layout first, then dispatch with it, then combine.
    dispatcher = LocalDispatcher(6, moe_combine_ref)
    x = torch.randn(9, 5, generator=generator)
    ids = torch.randint(0, 6, (9, 3), generator=generator)
    weights = torch.rand(9, 3, generator=generator)
    layout = dispatcher.layout(ids)
    assert layout.rows_per_slot.tolist() == torch.bincount(ids.reshape(-1), minlength=6).tolist()
    rows_a, sizes_a, handle_a = dispatcher.dispatch(x, ids, weights, layout)
    rows_b, sizes_b, handle_b = dispatcher.dispatch(x, ids, weights)
    assert torch.equal(rows_a, rows_b) and torch.equal(sizes_a, sizes_b)
    # Engagement: dispatch reads the layout it is given (one recomputed from the ids would
    # make the comparison above hold whatever the seam did): another routing's layout moves
    # the rows.
    moved, _, _ = dispatcher.dispatch(x, ids, weights, dispatcher.layout(ids.flip(0)))
    assert not torch.equal(moved, rows_a)
    out_a = dispatcher.combine(rows_a * 2, handle_a, weights)
    assert torch.equal(out_a, dispatcher.combine(rows_b * 2, handle_b, weights))


@pytest.mark.parametrize("num_tokens", (0, 1, 37, 300))
def test_layout_is_the_stable_sort_order_with_counts(num_tokens):
    """The layout lists rows by expert, then by row (the stable sort's order), with the rows
    per expert; the CUDA one-program layout is checked against the same sort in
    tests/test_triton_kernels.py and tests/test_gpu_kernels.py."""
    gen = torch.Generator().manual_seed(num_tokens)
    rows = [torch.randperm(16, generator=gen)[:4] for _ in range(num_tokens)]
    ids = torch.stack(rows) if rows else torch.zeros(0, 4, dtype=torch.int64)
    layout = dispatch_layout(ids, 16)
    assert torch.equal(layout.order, torch.sort(ids.reshape(-1), stable=True).indices)
    assert layout.rows_per_slot.tolist() == torch.bincount(ids.reshape(-1), minlength=16).tolist()


def test_dispatch_layout_refuses_ids_out_of_range_naming_them_as_ints():
    """An expert id outside [0, num_physical) is refused with the ids' range as plain ints
    (it printed tensor(-1)..tensor(3)); ids in range give a layout."""
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\), got -1\.\.3$"):
        dispatch_layout(torch.tensor([[0, 3], [-1, 2]]), 4)
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\), got 0\.\.4$"):
        dispatch_layout(torch.tensor([[0, 4]]), 4)
    assert dispatch_layout(torch.tensor([[0, 3], [1, 2]]), 4).rows_per_slot.tolist() == [1] * 4
