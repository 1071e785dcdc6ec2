"""ParallelConfig: the layout the communication layer builds its process groups from.

The layout (ranks, TP degree, device, backend) is part of what a result may depend on only
through its declared invariance: every layout must give the same bits.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("cpu", "cuda")
CAPACITY_DISPATCH = ("auto", "on", "off")
EP_BACKENDS = ("auto", "all_to_all", "deepep")


@dataclass(frozen=True)
class ParallelConfig:
    world_size: int = 1
    tp_size: int = 1
    backend: str = "auto"
    device: str = "cpu"
    timeout_s: float = 120.0
    # The bound on phase 1 of a weight update (each rank reading and checking its part of the
    # new weights: no collective in it), instead of timeout_s's. Reading a large checkpoint
    # from slow storage (V3's ~700 GB from a network file system) runs for minutes while every
    # rank is alive; a rank that dies or freezes meanwhile is still found at once (its death)
    # or by the watchdog's pings (server.health_check_interval_s).
    weight_read_timeout_s: float = 1800.0
    # Worker-group rebuilds the engine may make after a rank dies or stalls, within any
    # restart_window_s seconds, before giving up: rare faults over a long life are each rebuilt,
    # a group that keeps failing is not rebuilt forever.
    max_restarts: int = 3
    restart_window_s: float = 3600.0
    # Pre-reduce a token's expert outputs per rank before sending them back: fewer bytes, but
    # the sum order then depends on the placement. Off keeps the invariance contract.
    allow_multiple_reduction: bool = False
    # The EP exchange: "on" = FixedCapacityDispatcher (equal-split blocks, capturable in a CUDA
    # graph), "off" = AllToAllDispatcher (host split sizes, eager), "auto" = on exactly when
    # CUDA graphs are on over NCCL without multiple reduction. The same bits either way.
    ep_capacity_dispatch: str | bool = "auto"  # a bool (YAML's bare on/off) becomes "on"/"off"
    # Who moves the EP rows: "all_to_all" = torch.distributed (AllToAllDispatcher or, per
    # ep_capacity_dispatch, FixedCapacityDispatcher); "deepep" = DeepEP's ElasticBuffer as
    # transport only (DeepEPDispatcher; NCCL, one GPU per rank); "auto" = all_to_all for now.
    ep_backend: str = "auto"

    def __post_init__(self) -> None:
        for key in ("world_size", "tp_size"):
            value = getattr(self, key)
            # A bool is an int to Python: `world_size: yes` must not pass as 1.
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel.{key} must be an int >= 1, got {value!r}")
        if self.world_size % self.tp_size:
            raise ValueError(
                f"parallel.world_size ({self.world_size}) must be a multiple of "
                f"parallel.tp_size ({self.tp_size})"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"parallel.backend must be one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.allow_multiple_reduction, bool):
            # Why strict: the dispatchers test it for truth, so the string "false" turned the
            # placement-dependent pre-reduction on.
            raise ValueError(
                "parallel.allow_multiple_reduction must be true or false, got "
                f"{self.allow_multiple_reduction!r}"
            )
        # YAML reads a bare on/off as a bool: true/false mean "on"/"off".
        if isinstance(self.ep_capacity_dispatch, bool):
            dispatch = "on" if self.ep_capacity_dispatch else "off"
            object.__setattr__(self, "ep_capacity_dispatch", dispatch)
        if self.ep_capacity_dispatch not in CAPACITY_DISPATCH:
            raise ValueError(
                f"parallel.ep_capacity_dispatch must be one of {CAPACITY_DISPATCH} (or true / "
                f"false), got {self.ep_capacity_dispatch!r}"
            )
        if self.ep_capacity_dispatch == "on" and self.allow_multiple_reduction:
            raise ValueError(
                "parallel.ep_capacity_dispatch: 'on' sends every (token, slot) row home alone; "
                "it can't be combined with parallel.allow_multiple_reduction: true"
            )
        if self.ep_backend not in EP_BACKENDS:
            raise ValueError(
                f"parallel.ep_backend must be one of {EP_BACKENDS}, got {self.ep_backend!r}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"parallel.device must be one of {DEVICES}, got {self.device!r}")
        if (
            not isinstance(self.max_restarts, int)
            or isinstance(self.max_restarts, bool)
            or self.max_restarts < 0
        ):
            raise ValueError(
                f"parallel.max_restarts must be an int >= 0, got {self.max_restarts!r}"
            )
        for key in ("timeout_s", "weight_read_timeout_s", "restart_window_s"):
            value = getattr(self, key)
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (is_number and 0 < value <= threading.TIMEOUT_MAX):
                # The timeouts bound collectives and calls to a worker: never unbounded
                # (and a wait longer than the platform's longest overflows at its first use).
                raise ValueError(
                    f"parallel.{key} must be a number in (0, {threading.TIMEOUT_MAX:.3g}] "
                    f"seconds, got {value!r}"
                )

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size
