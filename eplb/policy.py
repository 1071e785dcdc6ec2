"""The rebalancing algorithm: from per-expert load to a placement of replicas on ranks.

DeepSeek EPLB semantics. Hierarchical policy (expert groups divide evenly over nodes): pack
groups onto nodes, replicate experts within each node, pack the replicas onto the node's
ranks. Global policy otherwise: one node, one group. Pure CPU tensor math, deterministic
(stable sorts, ties go to the lower index), vectorized over layers; it neither reads
runtime state nor moves weights.
Shapes: L_ rows (MoE layers, or layer x node), E logical experts, P physical slots, R ranks.
"""

from __future__ import annotations

import torch

from eplb.config import POLICIES
from eplb.placement import build_logical_to_physical


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split N items into num_packs packs of exactly N / num_packs items, balancing load.

    weight: [X, N] float, one independent problem per row.
    Returns (pack_index [X, N] int64, rank_in_pack [X, N] int64: the item's position in its
    pack, in the order items were placed). With one item per pack, item i goes to pack i.
    """
    num_rows, num_items = weight.shape
    items_per_pack = num_items // num_packs
    if items_per_pack == 1:
        pack_index = torch.arange(num_items).expand(num_rows, -1).clone()
        return pack_index, torch.zeros_like(pack_index)
    rows = torch.arange(num_rows)
    pack_index = torch.empty(num_rows, num_items, dtype=torch.int64)
    rank_in_pack = torch.empty_like(pack_index)
    pack_load = torch.zeros(num_rows, num_packs, dtype=weight.dtype)
    pack_size = torch.zeros(num_rows, num_packs, dtype=torch.int64)
    # 1. Items heaviest first; the stable sort puts the lower item id first among equals.
    order = torch.sort(weight, dim=1, descending=True, stable=True).indices
    for j in range(num_items):
        item = order[:, j]
        # 2. The lightest pack that still has room (argmin: first, i.e. lowest id, on ties).
        open_load = pack_load.masked_fill(pack_size == items_per_pack, float("inf"))
        pack = open_load.argmin(dim=1)
        # 3. Place the item and update that pack, for every row at once.
        pack_index[rows, item] = pack
        rank_in_pack[rows, item] = pack_size[rows, pack]
        pack_load[rows, pack] += weight[rows, item]
        pack_size[rows, pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Give num_physical slots to E experts, minimizing the largest load per replica.

    weight: [X, E] float. Returns (physical_to_logical [X, num_physical] int64: slot e holds
    expert e for e < E, later slots the extra replicas in creation order; replica_count
    [X, E] int64).
    """
    num_rows, num_logical = weight.shape
    rows = torch.arange(num_rows)
    physical_to_logical = torch.arange(num_physical).expand(num_rows, -1).clone()
    replica_count = torch.ones(num_rows, num_logical, dtype=torch.int64)
    # 1. Each extra slot goes to the expert with the largest load per replica (first on ties).
    for slot in range(num_logical, num_physical):
        expert = (weight / replica_count).argmax(dim=1)
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
    # 2. Replicate experts within each node: rows are (layer, node) pairs.
    nodelog_load = weight.gather(1, nodelog_to_log).view(-1, logical_per_node)
    phy_to_nodelog, nodelog_count = replicate_experts(nodelog_load, slots_per_node)
    # 3. Pack each node's replicas onto its GPUs, a replica carrying load / replica_count.
    replica_load = (nodelog_load / nodelog_count).gather(1, phy_to_nodelog)
    gpu_of_phy, rank_in_gpu = balanced_packing(replica_load, num_gpus // num_nodes)
    slot_to_phy = _inverse(gpu_of_phy * slots_per_gpu + rank_in_gpu)
    slot_to_nodelog = phy_to_nodelog.gather(1, slot_to_phy).view(num_layers, num_nodes, -1)
    # 4. Back to logical ids: offset by the node's first node-logical id, then un-permute.
    node_offset = (torch.arange(num_nodes) * logical_per_node).view(1, -1, 1)
    return nodelog_to_log.gather(1, (slot_to_nodelog + node_offset).flatten(1))


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
    = R ranks, num_gpus / num_nodes per node. policy "auto" is hierarchical when
    num_groups % num_nodes == 0, else global; "global" ignores groups and nodes.
    Returns (physical_to_logical [L, P], logical_to_physical [L, E, P - E + 1] with replicas in
    increasing physical id and -1 padding, replica_count [L, E]), int64 on CPU.
    """
    weight = torch.as_tensor(weight).detach().to(device="cpu", dtype=torch.float64)
    _check_args(weight, num_replicas, num_groups, num_nodes, num_gpus)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    is_hierarchical = num_groups % num_nodes == 0
    if policy == "hierarchical" and not is_hierarchical:
        raise ValueError(
            f"hierarchical policy needs num_nodes | num_groups; got num_groups={num_groups}, "
            f"num_nodes={num_nodes}"
        )
    if policy == "global" or not is_hierarchical:
        num_groups, num_nodes = 1, 1
    p2l = _rebalance_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    return p2l, *build_logical_to_physical(p2l, weight.shape[1])


def load_per_rank(
    weight: torch.Tensor, physical_to_logical: torch.Tensor, num_ranks: int
) -> torch.Tensor:
    """[L, R] float64 load of each rank when each expert's load splits evenly over its replicas.

    weight: [L, E]; physical_to_logical: [L, P] with P % num_ranks == 0.
    """
    weight = torch.as_tensor(weight).to(device="cpu", dtype=torch.float64)
    p2l = physical_to_logical.to(torch.int64)
    replica_count = torch.zeros_like(weight).scatter_add_(
        1, p2l, torch.ones(p2l.shape, dtype=torch.float64)
    )
    slot_load = (weight / replica_count).gather(1, p2l)
    return slot_load.view(p2l.shape[0], num_ranks, -1).sum(dim=2)


def balancedness(load_per_rank: torch.Tensor) -> torch.Tensor:
    """mean / max over the last dimension (1.0 = perfectly balanced; all-zero load counts as
    balanced). load_per_rank: [..., R] -> [...] float64."""
    load = torch.as_tensor(load_per_rank).to(torch.float64)
    peak = load.amax(dim=-1)
    ratio = load.mean(dim=-1) / peak
    return torch.where(peak > 0, ratio, torch.ones_like(ratio))
