"""The rebalancing algorithm: from per-expert load to a placement of replicas on ranks.

DeepSeek EPLB semantics. Hierarchical policy (expert groups divide evenly over nodes): pack
groups onto nodes, replicate experts within each node, pack the replicas onto the node's
ranks. Global policy otherwise: one node, one group. Unlike DeepSeek's reference, an expert
gets at most one copy per rank of its node and never two on one rank: our dispatch sends each
source rank's rows for an expert to one copy, its own first (ExpertPlacement.replica_table),
so at most R copies ever serve, and a rank's second copy serves no row of its own rank, only
rows of ranks without a copy (see `replicate_experts`, `balanced_packing`). Replicas are packed
a second time with the shares that dispatch gives them (`_pack_replicas`), kept where that
lightens a domain's heaviest rank. The plans equal the reference's wherever the reference makes
no such copy and the second packing is no lighter (its README example among them).
`load_per_rank` models that dispatch, not an even split over replicas.
Pure CPU tensor math, deterministic (stable sorts, ties go to the lower index), vectorized
over layers; it neither reads runtime state nor moves weights.
Shapes: L_ rows (MoE layers, or layer x node), E logical experts, P physical slots, R ranks.
"""

from __future__ import annotations

import torch

from eplb.config import POLICIES
from eplb.placement import ExpertPlacement, build_logical_to_physical


def balanced_packing(
    weight: torch.Tensor, num_packs: int, labels: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split N items into num_packs packs of exactly N / num_packs items, balancing load.

    weight: [X, N] float, one independent problem per row. labels: None, or [X, N] int64 (the
    expert an item is a copy of), each label on at most num_packs items of a row: then no pack
    gets two items of one label (a rank's second copy of an expert would serve none of its own
    rank's rows). An item goes to the lightest open pack without its label; where every open
    pack has it (copies of one expert sorted apart by ties), `_swap_into` trades it for an item
    of a full pack.
    Returns (pack_index [X, N] int64, rank_in_pack [X, N] int64: the item's position in its
    pack, in the order items were placed). With one item per pack, item i goes to pack i.
    """
    num_rows, num_items = weight.shape
    items_per_pack = num_items // num_packs
    if items_per_pack == 1:
        pack_index = torch.arange(num_items).expand(num_rows, -1).clone()
        return pack_index, torch.zeros_like(pack_index)
    rows = torch.arange(num_rows)
    if labels is None:
        labels = torch.arange(num_items).expand(num_rows, -1)  # all distinct: no constraint
    pack_index = torch.full((num_rows, num_items), -1, dtype=torch.int64)  # -1: not yet placed
    rank_in_pack = torch.empty_like(pack_index)
    pack_load = torch.zeros(num_rows, num_packs, dtype=weight.dtype)
    pack_size = torch.zeros(num_rows, num_packs, dtype=torch.int64)
    num_labels = int(labels.max()) + 1 if labels.numel() else 0
    has_label = torch.zeros(num_rows, num_packs, num_labels, dtype=torch.bool)
    # 1. Items heaviest first; the stable sort puts the lower item id first among equals.
    order = torch.sort(weight, dim=1, descending=True, stable=True).indices
    for j in range(num_items):
        item = order[:, j]
        label = labels[rows, item]
        # 2. The lightest open pack without the label (argmin: first, i.e. lowest id, on ties);
        # where none is, the lightest open pack, and a swap below.
        is_open = pack_size < items_per_pack
        is_free = is_open & ~has_label[rows, :, label]
        is_stuck = ~is_free.any(dim=1)
        allowed = torch.where(is_stuck.unsqueeze(1), is_open, is_free)
        pack = pack_load.masked_fill(~allowed, float("inf")).argmin(dim=1)
        # 3. Place the item and update that pack, for every row at once.
        pack_index[rows, item] = pack
        rank_in_pack[rows, item] = pack_size[rows, pack]
        pack_load[rows, pack] += weight[rows, item]
        pack_size[rows, pack] += 1
        has_label[rows, pack, label] = True
        for row in is_stuck.nonzero().flatten().tolist():
            args = (weight, labels, pack_index, rank_in_pack, pack_load, has_label)
            _swap_into(row, int(item[row]), *args)
    return pack_index, rank_in_pack


def _swap_into(row, item, weight, labels, pack_index, rank_in_pack, pack_load, has_label) -> None:
    """Item `item` was just placed in an open pack p that already held its label. Swap it with
    the placed item y of a full pack q such that q lacks the label and p lacks y's label, y's
    weight the closest to the item's (the least change of load; lowest (q, position) on ties).

    Such a y exists: fewer than num_packs copies of the label were placed before, so some pack
    q lacks it, and q is full (else it was open and free); p held at most items_per_pack - 2
    other labels and q holds items_per_pack distinct ones, so two of q's labels are not in p."""
    packs, positions = pack_index[row].tolist(), rank_in_pack[row].tolist()
    item_labels, w = labels[row].tolist(), weight[row].tolist()
    p, label = packs[item], item_labels[item]
    candidates = [
        (abs(w[y] - w[item]), packs[y], positions[y], y)
        for y in range(len(packs))
        if packs[y] >= 0
        and packs[y] != p
        and not has_label[row, p, item_labels[y]]
        and not has_label[row, packs[y], label]
    ]
    *_, y = min(candidates)
    q = packs[y]
    pack_index[row, item], pack_index[row, y] = q, p
    rank_in_pack[row, item], rank_in_pack[row, y] = positions[y], positions[item]
    pack_load[row, p] += w[y] - w[item]
    pack_load[row, q] += w[item] - w[y]
    has_label[row, p, item_labels[y]] = True  # p keeps the label: it held a copy before
    has_label[row, q, item_labels[y]] = False  # q's labels are distinct
    has_label[row, q, label] = True


def replicate_experts(
    weight: torch.Tensor, num_physical: int, max_replicas: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Give num_physical slots to E experts, minimizing the largest load per replica.

    weight: [X, E] float. max_replicas: the copies an expert can use (the ranks it may sit
    on); an expert that has them gets no more while another can still take one, so a slot the
    reference would give the hottest expert goes to the next in line. Only when every expert
    has max_replicas (more slots than E x max_replicas: world size 1, where a rank holds every
    expert and no second copy ever serves) do the extra slots go on as in the reference.
    Returns (physical_to_logical [X, num_physical] int64: slot e holds expert e for e < E,
    later slots the extra replicas in creation order; replica_count [X, E] int64).
    """
    num_rows, num_logical = weight.shape
    rows = torch.arange(num_rows)
    physical_to_logical = torch.arange(num_physical).expand(num_rows, -1).clone()
    replica_count = torch.ones(num_rows, num_logical, dtype=torch.int64)
    cap = num_physical if max_replicas is None else max_replicas
    # 1. Each extra slot goes to the expert with the largest load per replica (first on ties)
    # among those below the cap (all of them, once every one has reached it).
    for slot in range(num_logical, num_physical):
        per_replica = weight / replica_count
        is_capped = replica_count >= cap
        is_capped &= ~is_capped.all(dim=1, keepdim=True)
        expert = per_replica.masked_fill(is_capped, -1.0).argmax(dim=1)
        physical_to_logical[:, slot] = expert
        replica_count[rows, expert] += 1
    return physical_to_logical, replica_count


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of permutations perm [X, N]."""
    inverse = torch.empty_like(perm)
    inverse.scatter_(1, perm, torch.arange(perm.shape[1]).expand_as(perm))
    return inverse


def _rebalance_hierarchical(
    weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> torch.Tensor:
    """weight: [L, E] float64 -> physical_to_logical [L, P] int64.

    "Node-logical" ids number experts node-major: node n owns ids [n*E/N, (n+1)*E/N).
    """
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    logical_per_node = num_logical // num_nodes
    slots_per_node = num_physical // num_nodes
    slots_per_gpu = num_physical // num_gpus
    # 1. Pack expert groups onto nodes; a group keeps its experts together on one node.
    group_load = weight.view(num_layers, num_groups, group_size).sum(dim=2)
    node_of_group, rank_in_node = balanced_packing(group_load, num_nodes)
    group_base = (node_of_group * groups_per_node + rank_in_node) * group_size
    log_to_nodelog = (group_base.unsqueeze(2) + torch.arange(group_size)).flatten(1)
    nodelog_to_log = _inverse(log_to_nodelog)  # [L, E]
    # 2. Replicate experts within each node, one copy per GPU of the node at most: rows are
    # (layer, node) pairs.
    gpus_per_node = num_gpus // num_nodes
    nodelog_load = weight.gather(1, nodelog_to_log).view(-1, logical_per_node)
    phy_to_nodelog, nodelog_count = replicate_experts(nodelog_load, slots_per_node, gpus_per_node)
    # 3. Pack each node's replicas onto its GPUs, a replica carrying load / replica_count, no
    # GPU two copies of one expert; or, with more slots on a GPU than experts on its node,
    # every GPU holds every one of them and the rest (rebalance_experts allows it on one node).
    if slots_per_gpu > logical_per_node:
        slot_to_nodelog = _every_gpu_holds_every_expert(
            phy_to_nodelog, logical_per_node, gpus_per_node
        )
    else:
        gpu_of_phy, rank_in_gpu = _pack_replicas(
            nodelog_load, nodelog_count, phy_to_nodelog, gpus_per_node, num_gpus
        )
        slot_to_phy = _inverse(gpu_of_phy * slots_per_gpu + rank_in_gpu)
        slot_to_nodelog = phy_to_nodelog.gather(1, slot_to_phy)
    slot_to_nodelog = slot_to_nodelog.view(num_layers, num_nodes, -1)
    # 4. Back to logical ids: offset by the node's first node-logical id, then un-permute.
    node_offset = (torch.arange(num_nodes) * logical_per_node).view(1, -1, 1)
    return nodelog_to_log.gather(1, (slot_to_nodelog + node_offset).flatten(1))


def _pack_replicas(
    load: torch.Tensor,
    replica_count: torch.Tensor,
    physical_to_logical: torch.Tensor,
    num_packs: int,
    num_ranks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack replicas onto a domain's num_packs GPUs, no GPU two copies of one expert.

    load, replica_count: [X, E]; physical_to_logical: [X, P] -> balanced_packing's
    (pack_index, rank_in_pack) [X, P]. First pass: each replica carries load / replica_count,
    DeepSeek's model. The dispatch splits an expert's rows in steps of 1 / num_ranks, and the
    copies on lower ranks take the spare shares (`_dispatch_share`), so a second pass packs
    again with the shares the first pass's holders would get; a row keeps the second packing
    only where its heaviest pack, measured with the dispatch shares of its own holders, is
    strictly lighter. (Without it the spare shares piled up on rank 0: 0.67 mean / max where
    DeepSeek's plan gave 0.73, E=16 P=24 R=8, Zipf 1.5.)"""
    copy_load = load.gather(1, physical_to_logical)
    copy_count = replica_count.gather(1, physical_to_logical)
    first = balanced_packing(copy_load / copy_count, num_packs, physical_to_logical)
    share = _dispatch_share(first[0], physical_to_logical, copy_count, num_ranks)
    second = balanced_packing(copy_load * share, num_packs, physical_to_logical)

    def heaviest(pack_index: torch.Tensor) -> torch.Tensor:
        share = _dispatch_share(pack_index, physical_to_logical, copy_count, num_ranks)
        per_pack = torch.zeros(pack_index.shape[0], num_packs, dtype=torch.float64)
        return per_pack.scatter_add_(1, pack_index, copy_load * share).amax(dim=1)

    is_better = (heaviest(second[0]) < heaviest(first[0])).unsqueeze(1)
    return tuple(torch.where(is_better, b, a) for a, b in zip(first, second, strict=True))


def _dispatch_share(
    pack_index: torch.Tensor, labels: torch.Tensor, count: torch.Tensor, num_ranks: int
) -> torch.Tensor:
    """[X, N] float64: the share of its expert's rows a copy serves under the dispatch
    (ExpertPlacement.replica_table, every source rank sending an equal share): its own rank,
    plus the R - c ranks without a copy dealt in turn to the c copies in rank order, so the k-th
    copy (by pack) gets (1 + (R - c) // c + (k < (R - c) % c)) / R.
    pack_index, labels (expert of each item), count (copies of that expert): [X, N] int64, no
    two items of one label in one pack."""
    num_rows, num_items = pack_index.shape
    # 1. Items sorted by (label, pack); k is the position within the label's run.
    order = torch.sort(labels * num_items + pack_index, dim=1, stable=True).indices
    sorted_labels = labels.gather(1, order)
    position = torch.arange(num_items).expand(num_rows, -1)
    is_run_start = torch.ones_like(sorted_labels, dtype=torch.bool)
    is_run_start[:, 1:] = sorted_labels[:, 1:] != sorted_labels[:, :-1]
    run_start = torch.where(is_run_start, position, 0).cummax(dim=1).values
    k = torch.empty_like(order).scatter_(1, order, position - run_start)
    # 2. The share, exact integers over R.
    spare, extra = (num_ranks - count) // count, (num_ranks - count) % count
    return (1 + spare + (k < extra).long()).to(torch.float64) / num_ranks


def _every_gpu_holds_every_expert(
    physical_to_logical: torch.Tensor, num_logical: int, num_gpus: int
) -> torch.Tensor:
    """Slots for more slots per GPU than experts (world size 1 with redundant slots): every GPU
    holds experts 0..E-1 in its first E slots, then its share of the copies past num_gpus per
    expert, in creation order. No copy beyond a GPU's first of an expert serves a row, so these
    only follow the load to give a move something to do.

    physical_to_logical: [X, P] from replicate_experts with max_replicas=num_gpus (every expert
    has num_gpus copies before any gets more) -> [X, P] slot -> expert."""
    num_rows, num_physical = physical_to_logical.shape
    beyond = physical_to_logical[:, num_logical * num_gpus :].view(num_rows, num_gpus, -1)
    every = torch.arange(num_logical).expand(num_rows, num_gpus, -1)
    return torch.cat([every, beyond], dim=2).flatten(1)


def _check_args(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be [num_layers, num_logical], got {tuple(weight.shape)}")
    num_logical = weight.shape[1]
    if not torch.isfinite(weight).all() or (weight < 0).any():
        raise ValueError("weight must be finite and >= 0")
    if min(num_groups, num_nodes, num_gpus) < 1 or num_replicas < num_logical:
        raise ValueError(
            f"need num_groups, num_nodes, num_gpus >= 1 and num_replicas >= num_logical; got "
            f"num_groups={num_groups}, num_nodes={num_nodes}, num_gpus={num_gpus}, "
            f"num_replicas={num_replicas}, num_logical={num_logical}"
        )
    if num_logical % num_groups or num_gpus % num_nodes or num_replicas % num_gpus:
        raise ValueError(
            "need num_groups | num_logical, num_nodes | num_gpus, num_gpus | num_replicas; got "
            f"num_logical={num_logical}, num_groups={num_groups}, num_nodes={num_nodes}, "
            f"num_gpus={num_gpus}, num_replicas={num_replicas}"
        )


def rebalance_experts(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    policy: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plan replicas for every MoE layer from its per-expert load.

    weight: [L, E] load (float or int; any device). num_replicas = P physical slots; num_gpus
    = R ranks, num_gpus / num_nodes per node. An expert gets at most one copy per rank (of its
    node), never two on one rank, while P / R <= E (E / num_nodes in the hierarchical policy);
    past that (world size 1) every rank holds every expert once and then extra copies.
    policy "auto" is hierarchical when num_groups % num_nodes == 0 and P / R <= E / num_nodes
    (a node's ranks can hold distinct copies), else global; "global" ignores groups and nodes.
    Returns (physical_to_logical [L, P], logical_to_physical [L, E, P - E + 1] with replicas in
    increasing physical id and -1 padding, replica_count [L, E]), int64 on CPU.
    """
    weight = torch.as_tensor(weight).detach().to(device="cpu", dtype=torch.float64)
    _check_args(weight, num_replicas, num_groups, num_nodes, num_gpus)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    num_logical = weight.shape[1]
    is_hierarchical = num_groups % num_nodes == 0
    if policy == "hierarchical" and not is_hierarchical:
        raise ValueError(
            f"hierarchical policy needs num_nodes | num_groups; got num_groups={num_groups}, "
            f"num_nodes={num_nodes}"
        )
    if num_nodes > 1 and num_replicas // num_gpus > num_logical // num_nodes:
        # A rank would need two copies of one of its node's experts, and only one serves.
        if policy == "hierarchical":
            raise ValueError(
                f"hierarchical policy needs num_replicas / num_gpus <= num_logical / num_nodes "
                f"(one copy of an expert per rank of its node); got num_replicas={num_replicas}"
                f", num_gpus={num_gpus}, num_logical={num_logical}, num_nodes={num_nodes}"
            )
        is_hierarchical = False
    if policy == "global" or not is_hierarchical:
        num_groups, num_nodes = 1, 1
    p2l = _rebalance_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    return p2l, *build_logical_to_physical(p2l, weight.shape[1])


def load_per_rank(
    weight: torch.Tensor, physical_to_logical: torch.Tensor, num_ranks: int
) -> torch.Tensor:
    """[L, R] float64 rows each rank serves under the runtime's dispatch, when every source
    rank sends an equal share (1/R) of each expert's rows.

    A source rank sends all its rows for an expert to one copy: its own first, else the
    copies dealt round the ranks holding none (ExpertPlacement.replica_table). DeepSeek's
    model, each expert's load split evenly over its replicas, is not what runs: it gave a share
    to copies no source rank uses (a rank's second copy where every rank has one, copies past
    R), and c copies split an expert's rows in steps of 1/R, evenly only where c divides R
    (bench/eplb_plan.py's default global plan: 0.977 in that model, 0.851 in this one with
    the table's rule before, r % c, which could also deal the ranks without a copy unevenly).
    The source ranks' shares are unknown here; equal is the planner's assumption.
    weight: [L, E]; physical_to_logical: [L, P] with P % num_ranks == 0.
    """
    weight = torch.as_tensor(weight).to(device="cpu", dtype=torch.float64)
    p2l = physical_to_logical.to(torch.int64)
    placement = ExpertPlacement.from_physical_to_logical(p2l, weight.shape[1])
    serving = placement.replica_table(num_ranks).flatten(1)  # [L, R * E] slot of (source, e)
    num_sources = torch.zeros(p2l.shape, dtype=torch.int64).scatter_add_(
        1, serving, torch.ones_like(serving)
    )  # [L, P] source ranks each slot serves: integers, exact in any order
    slot_load = weight.gather(1, p2l) * num_sources / num_ranks
    return slot_load.view(p2l.shape[0], num_ranks, -1).sum(dim=2)


def balancedness(load_per_rank: torch.Tensor) -> torch.Tensor:
    """mean / max over the last dimension (1.0 = perfectly balanced; all-zero load counts as
    balanced). load_per_rank: [..., R] -> [...] float64."""
    load = torch.as_tensor(load_per_rank).to(torch.float64)
    peak = load.amax(dim=-1)
    ratio = load.mean(dim=-1) / peak
    return torch.where(peak > 0, ratio, torch.ones_like(ratio))
