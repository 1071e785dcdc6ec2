"""ExpertBalancer: the driver side of EPLB, and the one owner of the expert placement.

Every `eplb.interval_steps` steps (when enabled), or on demand, it sums each rank's per-slot row
counts over the window (integers: exact everywhere) into per-logical-expert load and, unless
balancedness (mean / max per-rank load) is above the threshold, plans a placement with
`eplb.policy` that all ranks move to between two steps. The reduction order never depends on the
placement (multiple reduction off), so a rebalance changes no output bit; a failed move leaves
the old placement serving. Workers get the placement at start-up and with each move.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from eplb.placement import ExpertPlacement, keep_held_slots
from eplb.policy import balancedness, load_per_rank, rebalance_experts
from moe_runtime.config import RuntimeConfig
from moe_runtime.executor import QUICK_CALL_TIMEOUT_S

log = logging.getLogger("moe_runtime.eplb")
# Rebalance reports kept (the newest). Why a bound: every eplb.interval_steps steps adds one,
# skipped ones too, so a server under load for days grew the list without end.
HISTORY_LEN = 1000


def initial_placement(config: RuntimeConfig) -> ExpertPlacement:
    """The placement every run starts from. A placement needs one layer at least; an
    all-dense model uses none of its rows."""
    model = config.model
    return ExpertPlacement.default(
        max(model.num_moe_layers, 1),
        model.n_routed_experts,
        config.eplb.num_redundant_experts,
        config.parallel.world_size,
    )


class RebalanceError(RuntimeError):
    """The new placement could not be moved into place; the old one is still serving."""


class ExpertBalancer:
    def __init__(self, config: RuntimeConfig, executor, placement: ExpertPlacement) -> None:
        """placement: the one the workers were started with (initial_placement)."""
        self.config, self.executor = config, executor
        self.num_moe_layers = config.model.num_moe_layers
        self.placement = placement
        self.num_rebalances = 0
        self.num_failed = 0  # moves refused by a rank (RebalanceError), the old placement kept
        self.last_balancedness: float | None = None
        # The last HISTORY_LEN reports, skipped and failed ones too; oldest first.
        self.history: deque[dict] = deque(maxlen=HISTORY_LEN)

    def maybe_rebalance(self, step: int) -> dict | None:
        eplb = self.config.eplb
        if not eplb.enabled or self.num_moe_layers == 0 or step % eplb.interval_steps:
            return None
        return self.rebalance(force=False)

    def rebalance(self, force: bool = True, inject_failure: tuple[int, int] | None = None) -> dict:
        """Plan and move; `force` skips the balancedness check. inject_failure=(rank, layer) is
        fault injection for tests: that rank fails while staging that layer."""
        started = time.perf_counter()
        report = {
            "balancedness_before": None,
            "balancedness_after": None,
            "experts_moved": 0,
            "bytes_moved": 0,
            "seconds": 0.0,
            "skipped": False,
        }
        if self.num_moe_layers == 0:  # an all-dense model: no experts to place
            return self._skipped(report, started, "the model has no MoE layers")
        p2l = self.placement.physical_to_logical[: self.num_moe_layers]
        logical_load, before = self._measure(p2l)
        report.update(balancedness_before=before, balancedness_after=before)
        # No rows since the last move (each move starts the window afresh): a plan from zero
        # load is the start-up placement, so even a forced rebalance would undo the last one.
        if not logical_load.any():
            no_load = "no expert load recorded since the last rebalance or worker start"
            return self._skipped(report, started, no_load)
        if not force and before >= self.config.eplb.balancedness_threshold:
            self.last_balancedness = before
            return self._skipped(report, started)
        # Each rank's kept experts stay in their slots: only what a rank newly holds moves,
        # and a plan that only reorders ranks' slots is the current placement (skipped below).
        new_p2l = keep_held_slots(p2l, self._plan(logical_load), self.config.parallel.world_size)
        planned, reason = self._judge(logical_load, p2l, new_p2l, force)
        if reason is not None:  # the window goes on
            self.last_balancedness = before
            return self._skipped(report, started, reason)
        self._move(new_p2l, inject_failure, report, started)
        report["balancedness_after"] = planned
        self.num_rebalances += 1
        self.last_balancedness = report["balancedness_after"]
        self.history.append(report)
        log.info(
            "rebalance %d: balancedness %.3f -> %.3f (planned), %d experts moved, %d bytes, %.3fs",
            self.num_rebalances,
            before,
            report["balancedness_after"],
            report["experts_moved"],
            report["bytes_moved"],
            report["seconds"],
        )
        return report

    def _measure(self, p2l: torch.Tensor) -> tuple[torch.Tensor, float]:
        """p2l [L, P], the placement now -> ([L, E] int64 rows each logical expert served over
        the window, the mean balancedness of the rows each rank's slots served)."""
        slot_load = self._slot_load()
        logical_load = torch.zeros(
            self.num_moe_layers, self.config.model.n_routed_experts, dtype=torch.int64
        ).scatter_add_(1, p2l, slot_load)  # integers: exact in any order
        # Measured: the rows each rank's slots served. (An estimate that split each expert's
        # load evenly over its replicas said 1.0 where one rank served every row: ranks send
        # an expert's rows to one replica, their own first.)
        world = self.config.parallel.world_size
        per_rank = slot_load.view(self.num_moe_layers, world, -1).sum(dim=2)
        return logical_load, float(balancedness(per_rank).mean())

    def _judge(
        self, logical_load: torch.Tensor, p2l: torch.Tensor, new_p2l: torch.Tensor, force: bool
    ) -> tuple[float, str | None]:
        """(the plan's mean balancedness as the planner models it, why not to move to it or
        None)."""
        # The planner's model (load_per_rank) is the dispatch with every source rank sending
        # an equal share of each expert's rows to the copy its replica table names; a plan
        # that does not raise that figure would move experts for nothing (where replicas are
        # local to every rank, the measured imbalance is the ranks' own tokens' and no
        # placement changes it). A forced rebalance moves all the same, unless nothing moves.
        world = self.config.parallel.world_size
        planned = _mean_balancedness(logical_load, new_p2l, world)
        modelled = _mean_balancedness(logical_load, p2l, world)  # the placement now, so
        if new_p2l.equal(p2l):
            return planned, "the plan is the current placement"
        threshold = self.config.eplb.balancedness_threshold
        if not force and (planned <= modelled or modelled >= threshold):
            return planned, (
                "as the planner models it (every rank sending an equal share of each "
                "expert's rows to the copy it uses) the placement is balanced enough, or the "
                "plan would not raise its balancedness"
            )
        return planned, None

    def _move(
        self,
        new_p2l: torch.Tensor,
        inject_failure: tuple[int, int] | None,
        report: dict,
        started: float,
    ) -> None:
        """Collective: every rank moves its experts to new_p2l [L, P] (Worker.rearrange),
        committed on all ranks or on none; `report` gets what moved and the time since
        `started`. A failed move is kept in the history and raised as RebalanceError, the old
        placement still serving; else new_p2l is this balancer's placement."""
        world = self.config.parallel.world_size
        per_rank_args = [
            (
                new_p2l.tolist(),
                inject_failure[1] if inject_failure and inject_failure[0] == r else None,
            )
            for r in range(world)
        ]
        results = self.executor.call("rearrange", per_rank_args)
        seconds = time.perf_counter() - started
        report.update(
            experts_moved=sum(r["experts_moved"] for r in results),
            bytes_moved=sum(r["bytes_sent"] for r in results),
            seconds=seconds,
        )
        if not all(r["ok"] for r in results):
            # Each rank that failed on its own says why (out of memory while staging, say);
            # the others only voted against the commit with it.
            causes = "; ".join(
                f"rank {rank}: {r['error']}" for rank, r in enumerate(results) if r.get("error")
            )
            self.history.append({**report, "failed": True, "error": causes or None})
            self.num_failed += 1
            log.warning(
                "rebalance failed after %.3fs (%s); the old placement stays in use",
                seconds, causes or "no rank named a cause",
            )  # fmt: skip
            raise RebalanceError(
                "a rank failed while moving experts"
                + (f" ({causes})" if causes else "")
                + "; the old placement is in use"
            )
        full = self.placement.physical_to_logical.clone()
        full[: self.num_moe_layers] = new_p2l
        self.placement = ExpertPlacement.from_physical_to_logical(
            full, self.config.model.n_routed_experts
        )

    def _skipped(self, report: dict, started: float, reason: str | None = None) -> dict:
        """The report of a rebalance that moved nothing, kept in the history; `reason` where
        it was skipped for a reason other than balance."""
        report.update(skipped=True, seconds=time.perf_counter() - started)
        if reason is not None:
            report["reason"] = reason
        self.history.append(report)
        return report

    def _slot_load(self) -> torch.Tensor:
        """[L, P] int64 rows each physical slot served over the window (slots in rank order)."""
        per_rank = self.executor.call_all("window_load", timeout_s=QUICK_CALL_TIMEOUT_S)
        physical = torch.tensor(
            [sum(col, []) for col in zip(*per_rank, strict=True)], dtype=torch.int64
        )
        return physical.view(self.num_moe_layers, -1)

    def _plan(self, logical_load: torch.Tensor) -> torch.Tensor:
        eplb, model = self.config.eplb, self.config.model
        p2l, _, _ = rebalance_experts(
            logical_load,
            self.placement.num_physical,
            model.n_group,
            eplb.num_nodes,
            self.config.parallel.world_size,
            policy=eplb.policy,
        )
        return p2l


def _mean_balancedness(logical_load: torch.Tensor, p2l: torch.Tensor, num_ranks: int) -> float:
    return float(balancedness(load_per_rank(logical_load, p2l, num_ranks)).mean())
