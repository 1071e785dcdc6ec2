"""RayExecutor: one worker actor per rank in a Ray placement group, driven in lockstep.

Joins Ray through connect_ray (ray_connect.py). Bundles: one per rank, CPU bundles for
`device: cpu` (kernels.num_threads CPUs each), GPU bundles for `device: cuda` (one CPU and a GPU,
fractional when ranks share one; see rank_cpus). Rank r runs in bundle r; rank 0's node (at the
address Ray reaches it by) and the port its rendezvous store holds there are the rendezvous
point. Every remote call is bounded by the collective timeout
plus a margin, or by a bound its caller gives (a quick call's; an update's read of the
weights, parallel.weight_read_timeout_s); a dead or stuck worker becomes a WorkerError naming
its rank and the step. This module and ray_connect.py are the only ones besides launch/ that
import ray.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import weakref
from collections import Counter
from dataclasses import dataclass

import ray
import torch
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from comm.errors import CollectiveError, PeerRefusedError
from comm.nccl_env import worker_nccl_env
from moe_runtime.config import RuntimeConfig
from moe_runtime.executor.ray_connect import connect_ray
from moe_runtime.executor.ray_placement import (
    bundles,
    check_gpu_sharing,
    node_address,
    rank_cpus,
    wait_for_placement,
)
from moe_runtime.worker.step_input import StepInput, StepOutput, WorkerError
from moe_runtime.worker.worker import Worker

log = logging.getLogger(__name__)

_MARGIN_S = 30.0
# The driver's bound (timeout_s) as a message names it: "within 150s" named no key to raise.
_BOUND = f"parallel.timeout_s + {_MARGIN_S:.0f}s"
_STALL_GRACE_S = 3.0
# A call still running this long is logged, then again as often, with how long it has run: a
# read of a large checkpoint from slow storage takes minutes, and the log said nothing meanwhile.
_PROGRESS_EVERY_S = 30.0
# Each actor answers Worker.ping in a thread of its own (this concurrency group), so a rank busy
# in a step or a collective still answers and only a frozen process (stopped, wedged) does not.
# Its second thread holds Worker.hold, a call that never returns: the driver learns of the
# actor's death from it without asking (dead_ranks).
_LIVENESS = "liveness"


class RayExecutor:
    # No device of the driver's: each rank's is its own actor's one visible GPU (or CPU).
    device = None

    def __init__(
        self,
        config: RuntimeConfig,
        physical_to_logical: list[list[int]],
        sampled_vocab_size: int | None = None,
    ) -> None:
        """sampled_vocab_size: every Worker's (the same on every rank)."""
        parallel = config.parallel
        self.world_size = parallel.world_size
        self.timeout_s = parallel.timeout_s + _MARGIN_S
        self.num_steps = 0
        connect_ray(self.world_size * rank_cpus(config))
        check_gpu_sharing(config)
        self.workers: list = []  # filled in place: the release below holds this list
        self.num_frozen: list[int] = []  # objects each rank's process froze after its init
        self._sentinels: list = []  # each rank's Worker.hold call: done only once it died
        self._killed: dict[int, str] = {}  # rank -> why the driver killed it
        rank_bundles = bundles(parallel.device, self.world_size, rank_cpus(config))
        self.placement_group = placement_group(rank_bundles, strategy="PACK")
        # Why: a placement group outlives every handle to it until the job ends, so an
        # executor dropped without shutdown (an LLM deleted or gone out of scope) kept its
        # bundles, and the next LLM of the process waited for room that never came. Not at
        # exit: the driver's end frees its actors and groups.
        self._release = weakref.finalize(
            self, _release, os.getpid(), self.workers, self.placement_group
        )
        self._release.atexit = False
        try:
            self._start_workers(config, physical_to_logical, rank_bundles[0], sampled_vocab_size)
        except BaseException:
            # A group that failed to start (a worker died or stalled in it, the cluster lacked
            # room) must not keep its bundles and live workers: on a cluster sized to the
            # world, the next rebuild would wait for them and fail, and so the one after.
            self.shutdown()
            raise

    def _start_workers(
        self,
        config: RuntimeConfig,
        physical_to_logical: list[list[int]],
        bundle: dict,
        sampled_vocab_size: int | None,
    ) -> None:
        """The placement group ready, a worker a rank in it (each asking for its `bundle`),
        every rank joined."""
        parallel = config.parallel
        wait_for_placement(self.placement_group, self.world_size, bundle, self.timeout_s, _BOUND)
        actor_cls = ray.remote(concurrency_groups={_LIVENESS: 2})(Worker)
        # NCCL reads its settings at communicator creation: set them in the actors' environment.
        env = worker_nccl_env() if parallel.device == "cuda" else {}
        # Why the bundle's own numbers, not the cluster asked again: a cluster whose GPU count
        # changed meanwhile (an autoscaler) gave actors a share their bundles do not hold.
        self.workers[:] = [
            actor_cls.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=rank
                ),
            ).remote(config, rank, sampled_vocab_size)
            for rank in range(self.world_size)
        ]
        # The driver's threshold for the runtime's records, so a rank's loading progress shows.
        level = logging.getLogger("moe_runtime").getEffectiveLevel()
        self._get([w.configure_logging.remote(level) for w in self.workers], "configure_logging")
        # Why Ray's address for rank 0's node, not the one its hostname resolves to: that is
        # often loopback (Debian's 127.0.1.1), where ranks of other nodes wait out the timeout.
        master_addr = node_address(self.placement_group, 0)
        master_port = self._get([self.workers[0].open_rendezvous.remote()], "open_rendezvous")[0]
        # Collective: every rank joins the rendezvous, so all init calls go out together.
        p2l = ray.put(physical_to_logical)
        self._get([w.init.remote(master_addr, master_port, p2l) for w in self.workers], "init")
        # Each actor is a process of the runtime's own: its model and torch's objects leave
        # the cyclic collector's view (moe_runtime/heap.py), so no full collection stalls a step.
        self.num_frozen = self._get([w.freeze_heap.remote() for w in self.workers], "freeze_heap")
        self._sentinels = self._beside_work("hold", range(self.world_size))

    def execute(self, per_rank_inputs: list[StepInput]) -> list[StepOutput]:
        self.num_steps += 1
        # The TP ranks of a DP group get the same input object: serialized once, not per rank.
        num_uses = Counter(id(step) for step in per_rank_inputs)
        refs_of: dict[int, ray.ObjectRef] = {}
        for step in per_rank_inputs:
            if num_uses[id(step)] > 1 and id(step) not in refs_of:
                refs_of[id(step)] = ray.put(step)
        refs = [
            w.execute.remote(refs_of.get(id(step), step))
            for w, step in zip(self.workers, per_rank_inputs, strict=True)
        ]
        return self._get(refs, f"step {self.num_steps}")

    def call(
        self,
        method: str,
        per_rank_args: list[tuple],
        timeout_s: float | None = None,
        timeout_key: str | None = None,
    ) -> list:
        """Worker.<method> on every rank at once (collective methods need that), rank order;
        bounded by timeout_s where given (a call with no collective in it: a quick one a live
        rank answers at once, or one with a setting of its own, `timeout_key`, which a timeout's
        message names), else by the collective timeout plus the margin."""
        # A state dict (prepare_weights) is put once for the ranks it is for, its tensors
        # compacted (_compact), where each rank's .remote() serialized it again.
        puts: dict[int, ray.ObjectRef] = {}

        def shipped(arg):
            if not isinstance(arg, dict):
                return arg
            if id(arg) not in puts:
                puts[id(arg)] = ray.put(_compact(arg))
            return puts[id(arg)]

        refs = [
            getattr(w, method).remote(*(shipped(arg) for arg in args))
            for w, args in zip(self.workers, per_rank_args, strict=True)
        ]
        return self._get(refs, method, timeout_s, timeout_key)

    def call_all(
        self,
        method: str,
        *args,
        timeout_s: float | None = None,
        timeout_key: str | None = None,
    ) -> list:
        return self.call(method, [args] * self.world_size, timeout_s, timeout_key)

    def silent_ranks(self, timeout_s: float) -> list[int]:
        """The ranks that do not answer a ping within timeout_s (dead ones included), asked
        beside whatever they run: safe from any thread, while a step or a call is under way."""
        refs = self._beside_work("ping", range(self.world_size))
        errors, silent = _outcomes(refs, timeout_s)
        failed = {ref for ref, error in errors.items() if error is not None}
        return sorted(rank for rank, ref in enumerate(refs) if ref in failed or ref in silent)

    def _beside_work(self, method: str, ranks) -> list:
        """Worker.<method> called on each of `ranks` in the liveness group's threads."""
        return [
            getattr(self.workers[r], method).options(concurrency_group=_LIVENESS).remote()
            for r in ranks
        ]

    def dead_ranks(self) -> list[int]:
        """The ranks whose actor has died (its Worker.hold call failed), without waiting or
        asking them: safe from any thread, as often as a health probe comes."""
        if not self._sentinels:
            return []
        ended, _ = ray.wait(self._sentinels, num_returns=len(self._sentinels), timeout=0)
        ended = set(ended)
        return [rank for rank, ref in enumerate(self._sentinels) if ref in ended]

    def kill_ranks(self, ranks: list[int], why: str) -> None:
        """Kill these ranks' actors (a stalled rank that no timeout would end soon): the call
        waiting on them fails at once, naming `why`."""
        for rank in ranks:
            self._killed[rank] = why
            log.error("killing rank %d: %s", rank, why)
            self.kill_worker(rank)

    def kill_worker(self, rank: int) -> None:
        """The actor dies as if its process crashed (fault injection in tests, kill_ranks)."""
        ray.kill(self.workers[rank], no_restart=True)

    def shutdown(self) -> None:
        """Kill every worker and free the placement group, once (later calls do nothing); safe
        on a broken or half-started group (a worker already dead, the group never ready)."""
        self._release()

    def _get(
        self,
        refs: list,
        what: str,
        timeout_s: float | None = None,
        timeout_key: str | None = None,
    ) -> list:
        """ray.get bounded by the timeout; the first failure is raised at once, naming its rank.

        Why not one ray.get: when one rank dies the others block in a collective until its
        timeout, so waiting for all would hide the dead rank behind the slow ones.
        """
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        if timeout_s is None:
            timeout_s, timeout_key = self.timeout_s, _BOUND
        bound = _Bound(time.monotonic(), timeout_s, timeout_key)
        try:
            while pending:
                done, pending = bound.wait_next(pending, rank_of, what)
                rank = rank_of[done[0]]
                try:
                    ray.get(done[0])
                except RayTaskError as exc:
                    if isinstance(exc.cause, ValueError):  # bad input, identical on every rank
                        refusals = self._settle(pending, rank_of, what, bound.deadline)
                        if isinstance(exc.cause, PeerRefusedError):  # a peer's own says why
                            rank, exc = next(iter(refusals), (rank, exc))
                        raise ValueError(f"rank {rank}: {exc.cause}") from exc
                    log.error("rank %d failed during %s: %s", rank, what, exc)
                    failure = f"rank {rank} failed during {what}: {_cause(exc)}"
                    if not isinstance(exc.cause, CollectiveError):  # its own fault, not a peer's
                        raise WorkerError(failure) from exc
                    raise WorkerError(self._blame(pending, rank_of, what, failure)) from exc
                except RayActorError as exc:  # its pid, node and actor ids go to the log only
                    log.error("rank %d died during %s: %s", rank, what, exc)
                    raise WorkerError(self._death(rank, what, exc)) from exc
                except RayError as exc:
                    log.error("rank %d failed during %s: %s", rank, what, exc)
                    raise WorkerError(f"rank {rank} failed during {what}: {_cause(exc)}") from exc
        except BaseException:
            _read_when_done(pending)  # the calls not read yet (their peers' failures)
            raise
        return ray.get(refs)

    def _settle(
        self, pending: list, rank_of: dict, what: str, deadline: float
    ) -> list[tuple[int, RayTaskError]]:
        """After one rank refused bad input: the other ranks' answers, read before the refusal
        is raised. Why: the engine's next call (discarding staged weights, the next step)
        assumes every rank got past this one; a peer that died or stalled meanwhile is a
        WorkerError, and a peer's refusal read here is not logged by Ray as unhandled. ->
        (rank, error) of the peers that refused their own input (not a PeerRefusedError),
        in rank order."""
        errors, silent = _outcomes(pending, max(0.0, deadline - time.monotonic()))
        if silent:
            ranks = sorted(rank_of[ref] for ref in silent)
            raise WorkerError(f"ranks {ranks} did not finish {what} after a peer refused it")
        refusals = []
        for ref, error in sorted(errors.items(), key=lambda item: rank_of[item[0]]):
            cause = getattr(error, "cause", None)
            if isinstance(cause, ValueError) and not isinstance(cause, PeerRefusedError):
                refusals.append((rank_of[ref], error))
            if error is None or isinstance(cause, ValueError):
                continue
            log.error("rank %d failed during %s: %s", rank_of[ref], what, error)
            if isinstance(error, RayActorError):
                raise WorkerError(self._death(rank_of[ref], what, error)) from error
            raise WorkerError(f"rank {rank_of[ref]} failed during {what}: {_cause(error)}")
        return refusals

    def _blame(self, pending: list, rank_of: dict, what: str, failure: str) -> str:
        """The message for a rank's failed collective, naming the rank that caused it when a
        peer did.

        Why: a rank whose peer died or stalled fails itself in a collective (a reset
        connection, a timeout), often before the driver hears of the death, and a stalled rank
        fails nobody itself. So the others get a grace period: the ranks that died in it, else
        those still silent after it that answer no ping either (a rank waiting in a collective
        of its own answers one), are named first."""
        if not pending:
            return failure
        errors, silent = _outcomes(pending, _STALL_GRACE_S)
        # (a peer that failed otherwise fails the same way: it is no cause)
        if died := _dead_ranks(errors, rank_of):
            return f"{self._death(died[0], what)} (all died: {died}; {failure})"
        silent_ranks = sorted(rank_of[ref] for ref in silent)
        pings = self._beside_work("ping", silent_ranks)
        rank_of_ping = dict(zip(pings, silent_ranks, strict=True))
        answers, unanswered = _outcomes(pings, _STALL_GRACE_S) if pings else ({}, [])
        # A ping that fails is no answer; one failed by the rank's death (the stall watch's
        # kill of a frozen rank, landing meanwhile) names the death and why it was killed.
        if died := _dead_ranks(answers, rank_of_ping):
            return f"{self._death(died[0], what)} (all died: {died}; {failure})"
        stalled = [
            rank_of_ping[ping]
            for ping in pings
            if ping in unanswered or answers.get(ping) is not None
        ]
        grace = f"{_STALL_GRACE_S:.0f}s after a peer failed waiting for them ({failure})"
        if stalled:
            return f"ranks {stalled} stalled during {what}: no answer to the step or a ping {grace}"
        if silent_ranks:  # alive, still in the step: hung in a kernel or a call off the GIL?
            return f"ranks {silent_ranks} still in {what} (they answer pings) {grace}"
        return failure

    def _death(self, rank: int, what: str, error: RayActorError | None = None) -> str:
        """'rank r died during what', with why where the driver killed it (kill_ranks) or its
        actor failed to start (`error`, the death's)."""
        why = f": killed, {self._killed[rank]}" if rank in self._killed else ""
        if not why and error is not None and error.actor_init_failed:
            why = f": its actor failed to start: {_creation_cause(error)}"
        return f"rank {rank} died during {what}{why}"


@dataclass(frozen=True)
class _Bound:
    """A call's bound: started (monotonic) + timeout_s, `key` the setting it comes from, named
    when it runs out (None: a quick call's, QUICK_CALL_TIMEOUT_S)."""

    started: float
    timeout_s: float
    key: str | None

    @property
    def deadline(self) -> float:
        return self.started + self.timeout_s

    def wait_next(self, pending: list, rank_of: dict, what: str) -> tuple[list, list]:
        """ray.wait for the first of `pending` (ref -> rank in rank_of) to finish: ([it], the
        others). Logged every _PROGRESS_EVERY_S while none does; WorkerError past the bound."""
        bound = f"{self.timeout_s:.0f}s" + (f" ({self.key})" if self.key else "")
        num_notes = (time.monotonic() - self.started) // _PROGRESS_EVERY_S  # due before this wait
        while True:
            note_at = self.started + (num_notes + 1) * _PROGRESS_EVERY_S
            wait_s = max(0.0, min(self.deadline, note_at) - time.monotonic())
            done, others = ray.wait(pending, num_returns=1, timeout=wait_s)
            if done:
                return done, others
            now, ranks = time.monotonic(), sorted(rank_of[ref] for ref in pending)
            if now >= self.deadline:
                raise WorkerError(f"ranks {ranks} did not finish {what} within {bound}")
            if now >= note_at:
                ran_s = now - self.started
                num_notes = ran_s // _PROGRESS_EVERY_S
                log.info("%s: ranks %s still running after %.0fs of %s", what, ranks, ran_s, bound)


def _release(owner_pid: int, workers: list, group) -> None:
    """RayExecutor.shutdown's work, also run when an executor is dropped without it: every
    worker killed, the placement group removed. Nothing in a process forked from the owner:
    the workers are the owner's, still serving it. Nothing once Ray is shut down (the user's
    ray.shutdown() before the LLM went): the workers and the group went with it. A removal that
    fails is logged, not raised: it must not hide the error of a start that failed."""
    if os.getpid() != owner_pid or not ray.is_initialized():
        return
    try:
        for worker in workers:
            with contextlib.suppress(Exception):
                ray.kill(worker, no_restart=True)
    finally:  # a kill interrupted (Ctrl-C) still frees the bundles
        try:
            remove_placement_group(group)
        except Exception as exc:
            log.error(
                "could not remove placement group %s (its bundles stay held until the job "
                "ends): %s",
                group.id.hex(), exc,
            )  # fmt: skip


def _read_when_done(refs: list) -> None:
    """Have each of these calls' results read when it comes, and dropped. Why: after one
    rank's failure is raised, its peers fail too (their collective times out, parallel.timeout_s
    later), and Ray logs a failure nobody read as an "Unhandled error" with its whole traceback:
    a second report, minutes after the first, of a fault already raised and logged."""
    for ref in refs:
        ref.future()


def _compact(state: dict) -> dict:
    """A state dict whose tensors each ship alone: a view pickles its whole storage, so a
    trainer's views into one flat buffer shipped the buffer once per tensor (133 views of a
    1.3 MB model: 179 MB a rank, 20x the update's time). A view is copied; others go as they
    are. Values that are no tensors are left for the rank's checks to name."""
    return {
        name: _alone(value) if isinstance(value, torch.Tensor) else value
        for name, value in state.items()
    }


def _alone(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.detach().clone(memory_format=torch.contiguous_format)
    return tensor


def _dead_ranks(errors: dict, rank_of: dict) -> list[int]:
    """The ranks, ascending, whose call in `errors` (_outcomes') failed with their death."""
    return sorted(rank_of[ref] for ref, error in errors.items() if isinstance(error, RayActorError))


def _outcomes(refs: list, timeout_s: float) -> tuple[dict, list]:
    """Wait up to timeout_s for every ref: ({answered ref: its RayError, or None}, the refs
    still silent)."""
    answered, silent = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    errors = {}
    for ref in answered:
        try:
            ray.get(ref)
            errors[ref] = None
        except RayError as exc:
            errors[ref] = exc
    return errors, silent


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_MAX_CAUSE_CHARS = 300
# A traceback's exception line, "module.SomeError: message" (or the type alone), unindented.
_EXCEPTION_LINE = re.compile(r"(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)(?::.*)?")


def _cause(exc: RayError) -> str:
    """A worker failure for a client to read (it reaches error chunks and /health): the
    original exception's type and the first line of its message, without Ray's colours,
    traceback and ids, cut at _MAX_CAUSE_CHARS (the whole of it is logged)."""
    cause = getattr(exc, "cause", None) or exc
    text = _ANSI_ESCAPE.sub("", f"{type(cause).__name__}: {cause}").strip().splitlines()[0]
    return text if len(text) <= _MAX_CAUSE_CHARS else text[: _MAX_CAUSE_CHARS - 3] + "..."


def _creation_cause(error: RayActorError) -> str:
    """What an actor that died in its creation raised, as _cause gives an exception (its class
    failing to import on a node that lacks a package, its constructor raising). Ray keeps it
    only as text: its traceback inside the error's message, the innermost exception last
    (an import failure's "failed to import" first, then ModuleNotFoundError)."""
    lines = _ANSI_ESCAPE.sub("", str(error)).splitlines()
    found = [line for line in lines[1:] if _EXCEPTION_LINE.fullmatch(line)]
    if not found:
        return "see Ray's report in the log"
    text = found[-1].strip()
    return text if len(text) <= _MAX_CAUSE_CHARS else text[: _MAX_CAUSE_CHARS - 3] + "..."
