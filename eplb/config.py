"""EplbConfig: settings of expert-parallel load balancing (the EPLB issue implements it).

`num_redundant_experts` adds replica slots beyond the logical experts; the rest drive the
periodic rebalance while serving.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("auto", "hierarchical", "global")


@dataclass(frozen=True)
class EplbConfig:
    enabled: bool = False
    interval_steps: int = 1000
    window_steps: int = 1000
    num_redundant_experts: int = 0
    policy: str = "auto"
    balancedness_threshold: float = 0.95
    num_nodes: int = 1  # nodes the ranks span (the hierarchical policy packs groups per node)

    def __post_init__(self) -> None:
        minimums = {"interval_steps": 1, "window_steps": 1, "num_nodes": 1}
        for key, minimum in (minimums | {"num_redundant_experts": 0}).items():
            value = getattr(self, key)
            if not isinstance(value, int) or value < minimum:
                raise ValueError(f"eplb.{key} must be an int >= {minimum}, got {value!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"eplb.policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0.0 < self.balancedness_threshold <= 1.0:
            raise ValueError(
                "eplb.balancedness_threshold must be in (0, 1], "
                f"got {self.balancedness_threshold!r}"
            )
