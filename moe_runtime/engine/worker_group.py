"""WorkerGroup: the engine's ranks and the weights they serve.

Builds the ranks for an expert placement and counts the KV blocks every one of them holds;
rebuilds them after a fault with the weights they served (model.path's, or the last update's),
refused where those weights changed on disk or the restart bound is spent; swaps their weights
in two phases (every rank reads and checks, then every rank copies in). It owns the executor,
the weights' stamps and version and the restart history. It owns no request: the engine ends
those on a fault and calls in here between steps, under its lock.
"""

from __future__ import annotations

import collections
import contextlib
import time

from eplb.placement import ExpertPlacement
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.weights_source import WeightsChangedError, WeightsSource
from moe_runtime.executor import create_executor
from moe_runtime.heap import thawed
from moe_runtime.model.weight_checks import rank_shares, unfuse_experts


class WorkerGroup:
    def __init__(
        self,
        config: RuntimeConfig,
        placement: ExpertPlacement,
        sampled_vocab_size: int | None = None,
    ) -> None:
        """sampled_vocab_size: the tokenizer's size, every rank's bound on the ids it samples
        (a rebuild's ranks too); None: any id."""
        self.config = config
        self.sampled_vocab_size = sampled_vocab_size
        # model.path's weights as stamped before the workers read them: a rebuild checks that it
        # still holds them (and a rollout job's record names them).
        try:
            self.startup_weights = self.weights = WeightsSource.of(config.model.path)
        except OSError as exc:  # a dangling *.safetensors link, no permission
            raise ValueError(f"model.path {config.model.path!r} cannot be read: {exc}") from exc
        self.weight_version = 0  # updates committed; the served weights are `weights`
        self.num_restarts = 0  # every rebuild since start (a metric)
        self._restart_times: collections.deque[float] = collections.deque()  # monotonic
        started = time.monotonic()
        p2l = placement.physical_to_logical.tolist()
        self.executor = create_executor(config, p2l, sampled_vocab_size=sampled_vocab_size)
        try:
            self.num_kv_blocks = self._count_kv_blocks()
            # Each rank read model.path on its own, as an update's ranks read its source: a
            # checkpoint replaced meanwhile (a trainer saving over it) may have given ranks
            # different weights, each rank's the same request other bits, and no error.
            changed = self.startup_weights.changed()
            if changed is not None:
                raise ValueError(
                    f"model.path: {changed} (while the ranks read it, so they may hold "
                    "different weights); start again once it stands still"
                )
        except BaseException:
            self.executor.shutdown()  # a group this engine will not use frees its workers
            raise
        # How long the group took to start, then the last rebuild: what a client waits for
        # while the engine rebuilds (AsyncEngine's Retry-After).
        self.build_s = time.monotonic() - started

    def _count_kv_blocks(self) -> int:
        """The KV blocks every DP rank's scheduler may use: the smallest cache any worker of
        the group holds (found by the workers when cache.num_blocks is 0: sized from free GPU
        memory, so a rebuilt group may hold another count). ValueError if a sequence of
        scheduler.max_model_len does not fit."""
        num_blocks = min(self.executor.call_all("num_kv_blocks"))
        max_len, needed = self.config.scheduler.max_model_len, self.config.max_blocks_per_seq
        if needed > num_blocks:
            raise ValueError(
                f"a sequence of scheduler.max_model_len={max_len} needs {needed} KV blocks; the "
                f"cache holds {num_blocks} (cache.num_blocks)"
            )
        return num_blocks

    def can_restart(self) -> bool:
        """Whether fewer than parallel.max_restarts rebuilds fell in the last
        parallel.restart_window_s seconds."""
        window_start = time.monotonic() - self.config.parallel.restart_window_s
        while self._restart_times and self._restart_times[0] < window_start:
            self._restart_times.popleft()
        return len(self._restart_times) < self.config.parallel.max_restarts

    def restart_refusal(self, error: str | None) -> RuntimeError | None:
        """Why `rebuild` would refuse at once (its restarts spent; `error`: what killed the
        group), else None."""
        if self.can_restart():
            return None
        parallel = self.config.parallel
        return RuntimeError(
            f"gave up after parallel.max_restarts={parallel.max_restarts} restarts within "
            f"parallel.restart_window_s={parallel.restart_window_s:g}s: {error}"
        )

    def rebuild(self, placement: ExpertPlacement, error: str | None, is_counted: bool) -> None:
        """New ranks for the placement, serving the weights the old ones served, with fresh KV
        caches. `error`: what killed the old group (named in a refusal); is_counted: whether
        this rebuild counts toward (and may be refused by) parallel.max_restarts. Raises
        RuntimeError when refused, WeightsChangedError when the weights cannot be restored."""
        refusal = self.restart_refusal(error) if is_counted else None
        if refusal is not None:
            raise refusal
        changed = self.weights.changed()
        if changed is None and self.weight_version > 0:
            # The new group builds its model from model.path before the update's weights.
            changed = self.startup_weights.missing()
        if changed is not None:
            raise self._unrestorable(
                f"{changed} (other weights under the same version would give other bits)", error
            )
        self.num_restarts += 1
        started = time.monotonic()
        if is_counted:
            self._restart_times.append(started)
        # At world size 1 the old model lives in this process: a frozen heap would keep it.
        # Its rank is rebuilt on its device, not on the one this thread has current (the
        # server's loop thread: CUDA's device 0; a caller that moved to another GPU since).
        device = self.executor.device
        with thawed():
            with contextlib.suppress(Exception):  # the old group is broken; free what is left
                self.executor.shutdown()
            p2l = placement.physical_to_logical.tolist()
            self.executor = create_executor(self.config, p2l, device, self.sampled_vocab_size)
            try:
                # The new group's caches, sized afresh where cache.num_blocks is 0 (the old
                # group's memory may not all be back): the schedulers follow its count.
                num_kv_blocks = self._count_kv_blocks()
                if self.weight_version > 0:  # an update's weights, not model.path's
                    self._prepare(self.weights.source, placement)
                    self.executor.call_all("commit_weights")
                # Checked again now the new ranks have read: a change while they read could
                # have given them different weights (the check above was before). The served
                # source only: model.path's weights are replaced by an update's.
                changed = self.weights.changed()
                if changed is not None:
                    raise self._unrestorable(
                        f"{changed} while its ranks read them (they may hold different ones)",
                        error,
                    )
            except BaseException:
                self.executor.shutdown()  # its bundles and workers, free for the next one
                raise
        self.num_kv_blocks = num_kv_blocks
        self.build_s = time.monotonic() - started

    def _unrestorable(self, why: str, error: str | None) -> WeightsChangedError:
        """The error of a rebuild that cannot serve weight_version's weights again."""
        return WeightsChangedError(
            f"cannot rebuild the worker group with weight_version {self.weight_version}'s "
            f"weights: {why}; restart the server, or keep a checkpoint directory unchanged "
            f"while it is served: {error}"
        )

    def prepare_weights(self, weights: WeightsSource, placement: ExpertPlacement) -> None:
        """Phase 1 of an update: every rank reads and checks its part of `weights` (its slots'
        experts in `placement`, the one it serves), changing nothing it serves.
        ValueError: refused (the caller discards what the ranks staged)."""
        self._prepare(weights.source, placement)
        # Each rank read the source on its own: a file replaced meanwhile (a trainer saving
        # over the directory) may have given ranks different weights. Refused as a whole.
        changed = weights.changed()
        if changed is not None:
            raise ValueError(
                f"update_weights: {changed} (while the ranks read it, so they may hold "
                "different weights): nothing changed; save each update to a new directory"
            )

    def _prepare(self, source: str | dict | None, placement: ExpertPlacement) -> None:
        """Worker.prepare_weights on every rank. A directory: each rank reads its own part. A
        state dict: the part every rank reads is shipped once for all of them, and each rank
        its own experts beside it (rank_shares), where each rank was sent the whole dict (R
        copies of the model in host memory at once), then its part with the common tensors
        serialized once a rank.

        Bounded by parallel.weight_read_timeout_s, not the steps' bound: a read from slow
        storage that outlasted parallel.timeout_s was taken for a stalled rank, and the engine
        rebuilt (a restart spent) while every rank was alive and reading. A rank that dies
        meanwhile still fails the call at once, one that freezes at the watchdog's second
        check (stall_watch.py: a rank reading answers its pings)."""
        world_size, model = self.config.parallel.world_size, self.config.model
        timeout_s = self.config.parallel.weight_read_timeout_s
        key = "parallel.weight_read_timeout_s"
        if not isinstance(source, dict) or world_size == 1:
            self.executor.call_all("prepare_weights", source, timeout_s=timeout_s, timeout_key=key)
            return
        local = [
            placement.local_experts(r, world_size)[: model.num_moe_layers].tolist()
            for r in range(world_size)
        ]
        # transformers' fused expert tensors as per-expert views first, so they are cut too.
        source = unfuse_experts(source, model, "the state dict")
        common, own = rank_shares(source, local, model)
        per_rank = [(common, experts) for experts in own]
        self.executor.call("prepare_weights", per_rank, timeout_s=timeout_s, timeout_key=key)

    def commit_weights(self, weights: WeightsSource) -> int:
        """Phase 2: every rank copies its staged part in. -> the new weight_version. A failure
        part way leaves the ranks with mixed weights: the caller's engine must die."""
        self.executor.call_all("commit_weights")
        self.weights = weights
        self.weight_version += 1
        return self.weight_version
