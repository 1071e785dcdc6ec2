"""Expert-parallel load balancing: the placement of expert replicas on ranks and the policy
that chooses it from observed load.

Imports only `moe_kernels`, `comm` and itself (plus torch); reads no environment and holds no
runtime state.
"""

from eplb.config import EplbConfig
from eplb.placement import ExpertPlacement, build_logical_to_physical, keep_held_slots
from eplb.policy import (
    balanced_packing,
    balancedness,
    load_per_rank,
    rebalance_experts,
    replicate_experts,
)

__all__ = [
    "EplbConfig",
    "ExpertPlacement",
    "balanced_packing",
    "balancedness",
    "build_logical_to_physical",
    "keep_held_slots",
    "load_per_rank",
    "rebalance_experts",
    "replicate_experts",
]
