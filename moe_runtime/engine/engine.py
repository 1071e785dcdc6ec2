"""LLMEngine: requests in, per-step output deltas out, one lockstep step at a time.

The driver: one scheduler and KV block pool per data-parallel rank, the expert placement (the
balancer), every request's sequences and outputs. A step sends each rank a `StepInput` (only
what changed since its last step), runs all ranks at once, records the results, detokenizes
incrementally, ends samples at stop strings (and with "error" those whose logits were not
finite, from the logprob every step returns) and returns a `RequestOutput` delta per request
that changed. A bad request raises at `add_request` and never disturbs those in flight; a
worker failure fails every request in flight and leaves the engine dead, never hung, until
`restart` has its WorkerGroup (the ranks and the weights they serve) rebuild the ranks.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.balancer import ExpertBalancer, RebalanceError, initial_placement
from moe_runtime.engine.block_manager import BlockManager
from moe_runtime.engine.outputs import EngineStats, RequestOutput
from moe_runtime.engine.rank_faults import RankFaults, under_lock
from moe_runtime.engine.request import Request, Sequence
from moe_runtime.engine.request_checks import RequestChecks
from moe_runtime.engine.scheduler import Scheduler, share_waiting
from moe_runtime.engine.step_io import build_step_input, record_results, request_output
from moe_runtime.engine.weights_source import WeightsSource
from moe_runtime.engine.worker_group import WorkerGroup
from moe_runtime.heap import drop_frames, thawed
from moe_runtime.sampling_params import SamplingParams
from moe_runtime.seeds import resolve_seed
from moe_runtime.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class LLMEngine(RankFaults):
    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        # Held by a step, a queue change or a call to the ranks (under_lock), so each runs whole
        # before another thread's begins. Why: llm.engine stepped from a second thread while
        # llm.generate stepped it from the first ran two steps at once, which killed the engine
        # ("scheduled from position 80, but 81 are computed here") and ended generate's requests
        # silently. Not under it, so any thread can use them meanwhile: shutdown, stats and the
        # liveness calls (dead_ranks, silent_ranks, kill_ranks). `output` and `has_unfinished`
        # are under it: read beside a step, output gave a sample's new token without its
        # logprob, and has_unfinished False for a sequence the step moved from waiting to
        # running (generate returned it unfinished). Reentrant: add_request -> add_requests.
        self._lock = threading.RLock()
        self.tokenizer = load_tokenizer(config.model)
        self.checks = RequestChecks(config, self.tokenizer)
        placement = initial_placement(config)
        # The ids the tokenizer has: ids past them (model.vocab_size's padding) are never
        # sampled, the same bound on every rank.
        self.group = WorkerGroup(config, placement, self.tokenizer.vocab_size)
        self._reset_queues()
        self.balancer = ExpertBalancer(config, self.executor, placement)
        self.error: str | None = None
        self._is_interrupted = False  # whether error is a Ctrl-C's (its rebuild is not a fault's)
        self.num_steps = 0
        self._num_steps_checked = 0  # the step count the periodic rebalance last looked at
        self.num_shared = 0  # waiting sequences moved between DP ranks
        self._next_seq_id = 0
        self._request_ids = itertools.count()
        self._owner_pid = os.getpid()  # a forked child cannot reach the Ray workers

    def _reset_queues(self) -> None:
        cache = self.config.cache
        self.block_managers = [
            BlockManager(self.num_kv_blocks, cache.block_size, cache.enable_prefix_caching)
            for _ in range(self.config.parallel.dp_size)
        ]
        # Why invariant mode only: holding the waiting sequences a step moves them to another
        # batch, which changes no bit of theirs only there (Scheduler.schedule).
        can_hold = self.config.kernels.is_invariant and bool(self.config.scheduler.overlap_decode)
        self.schedulers = [
            Scheduler(self.config.scheduler, blocks, self.config.model.eos_token_ids, can_hold)
            for blocks in self.block_managers
        ]

    @property
    def executor(self):
        """The ranks' executor (the group's; a rebuild replaces it)."""
        return self.group.executor

    @property
    def num_kv_blocks(self) -> int:
        return self.group.num_kv_blocks

    @property
    def build_s(self) -> float:
        """How long the worker group took to start, then the last rebuild: what a client waits
        for while the engine rebuilds (AsyncEngine's Retry-After)."""
        return self.group.build_s

    @property
    def weight_version(self) -> int:
        return self.group.weight_version

    @property
    def num_restarts(self) -> int:
        return self.group.num_restarts

    @property
    def startup_weights(self) -> WeightsSource:
        return self.group.startup_weights

    def restart_refusal(self) -> RuntimeError | None:
        """Why `restart` would refuse at once (its restarts spent), else None."""
        return self.group.restart_refusal(self.error)

    @under_lock
    def restart(self) -> None:
        """Rebuild a dead engine's worker group: new workers with the current expert placement
        and weights (the last update_weights source), fresh KV caches and queues. Requests in
        flight were failed already. Raises RuntimeError once parallel.max_restarts rebuilds
        fell within parallel.restart_window_s. A rebuild after a Ctrl-C (or SystemExit) inside
        a step neither counts nor is refused: the bound stops a crash loop, and an interrupt is
        the user's, not a fault (a notebook's fourth Ctrl-C in an hour left the LLM unusable)."""
        self._check_process()
        try:
            self.group.rebuild(
                self.balancer.placement, self.error, is_counted=not self._is_interrupted
            )
        finally:
            self.balancer.executor = self.group.executor
        self._reset_queues()
        self.error, self._is_interrupted = None, False

    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Request:
        """Queue one request (n samples); raises ValueError naming the problem if it is bad."""
        return self.add_requests([prompt], [params])[0]

    @under_lock
    def add_requests(
        self, prompts: list[str | list[int]], params: list[SamplingParams]
    ) -> list[Request]:
        """Queue several requests all or none: a bad prompt raises ValueError naming its index
        (when there are several) before any is queued."""
        token_ids = self.check_requests(prompts, params)
        self._check_alive()
        return self._enqueue_all(
            Request(f"req-{next(self._request_ids)}", ids, p, resolve_seed(p.seed))
            for ids, p in zip(token_ids, params, strict=True)
        )

    def check_requests(
        self, prompts: list[str | list[int]], params: list[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Each prompt's token ids, checked as add_requests checks them (with params, their
        max_tokens and logprobs too; without, the prompts alone); a ValueError names the bad
        prompt's index when there are several. Queues nothing."""
        return self.checks.requests(prompts, params)

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """A request's prompt token ids, or ValueError naming what the engine cannot run
        (RequestChecks.request). Queues nothing: a job can check its requests ahead."""
        return self.checks.request(prompt, params)

    def check_score_request(
        self, token_ids: list[int], prompt_len: int
    ) -> tuple[list[int], list[int]]:
        """A scoring's (prompt ids, ids to score), or ValueError naming what the engine cannot
        run (RequestChecks.score). Queues nothing: a job can check its scorings ahead."""
        return self.checks.score(token_ids, prompt_len)

    def add_score_request(
        self,
        token_ids: list[int],
        prompt_len: int,
        logprobs: int | None = None,
        return_routed_experts: bool = False,
    ) -> Request:
        """Queue a teacher-forced scoring of token_ids[prompt_len:] given everything before;
        `logprobs`: also each position's top logprobs, as a decode step reports them;
        `return_routed_experts`: each scored token's routed experts, as a decode step's."""
        (request,) = self.add_score_requests(
            [token_ids], [prompt_len], logprobs, return_routed_experts
        )
        return request

    @under_lock
    def add_score_requests(
        self,
        sequences: list[list[int]],
        prompt_lens: list[int],
        logprobs: int | None = None,
        return_routed_experts: bool = False,
    ) -> list[Request]:
        """Queue several scorings all or none: a bad one raises ValueError naming its index
        (when there are several) before any is queued."""
        params = SamplingParams(logprobs=logprobs, return_routed_experts=return_routed_experts)
        self.checks.num_top(logprobs)
        checked = self.checks.scores(sequences, prompt_lens)
        self._check_alive()
        return self._enqueue_all(
            Request(f"score-{next(self._request_ids)}", p, params, 0, s) for p, s in checked
        )

    def _enqueue_all(self, requests: Iterable[Request]) -> list[Request]:
        """Queue checked requests all or none: an exception part way, a KeyboardInterrupt
        above all (queueing 50k prompts of n = 4 takes seconds), aborts the ones already
        queued before it propagates, so the next call does not run the interrupted call's
        prompts first."""
        queued: list[Request] = []
        try:
            for request in requests:
                queued.append(request)  # first: one cut inside its samples is dropped too
                self._enqueue(request)
        except BaseException:
            self.abort(*(request.request_id for request in queued))
            raise
        return queued

    def _enqueue(self, request: Request) -> Request:
        """All of a request's samples go to the DP rank with the fewest unfinished sequences
        (lowest rank on ties), until a rank with nothing waiting takes it over while it waits
        (share_waiting); which rank serves it changes no bit of its result."""
        loads = [s.num_unfinished for s in self.schedulers]
        dp_rank = loads.index(min(loads))
        for seq in request.expand_samples(self._next_seq_id, self.tokenizer):
            seq.dp_rank = dp_rank
            self.schedulers[dp_rank].add(seq)
        self._next_seq_id += len(request.samples)
        return request

    @under_lock
    def step(self) -> list[RequestOutput]:
        """Run one lockstep step on every rank; -> a delta per generation request that got new
        tokens or finished in it (scoring requests are read whole with `output`)."""
        self._check_alive()
        with self._dead_if_interrupted("a step"):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        self._rebalance_if_due()
        if len(self.schedulers) > 1:
            self.num_shared += share_waiting(self.schedulers)  # an idle DP rank takes work
        per_dp_rank = [scheduler.schedule() for scheduler in self.schedulers]
        for chunks in per_dp_rank:
            for chunk in chunks:
                chunk.seq.note_step(self.weight_version)
        inputs = [
            build_step_input(scheduler.collect_released(), chunks, scheduler.is_lookahead)
            for scheduler, chunks in zip(self.schedulers, per_dp_rank, strict=True)
        ]
        tp_size = self.config.parallel.tp_size
        # Worker rank w serves DP rank w // tp_size; all TP ranks of a group get the same input.
        per_worker = [step for step in inputs for _ in range(tp_size)]
        with self._fatal_on_error():
            results = self.executor.execute(per_worker)[::tp_size]  # TP rank 0 of each group
        # Per request that got tokens, the samples that did: its delta reads those alone.
        changed: dict[int, tuple[Request, list[Sequence]]] = {}
        for scheduler, chunks, result in zip(self.schedulers, per_dp_rank, results, strict=True):
            record_results(scheduler, chunks, result)
            for chunk in chunks:
                seq = chunk.seq
                if seq.seq_id in result.samples and not seq.is_score:
                    changed.setdefault(id(seq.request), (seq.request, []))[1].append(seq)
        self.num_steps += 1
        version, width = self.weight_version, self.config.model.routed_width
        return [
            request_output(r, version, True, width, sorted(seqs, key=lambda s: s.sample_idx))
            for r, seqs in changed.values()
        ]

    def _rebalance_if_due(self) -> None:
        """The periodic rebalance due after the last step (eplb.interval_steps), between it and
        the next one. Why here, not at the end of the last step: a rank dying in the move
        raised out of that step, failing the requests it had just finished, their outputs
        never returned; now the move's fault fails only requests still to run. Once a count."""
        if self.num_steps == self._num_steps_checked:
            return
        self._num_steps_checked = self.num_steps
        # A refused move is logged; the old placement keeps serving, nothing in flight changed.
        with contextlib.suppress(RebalanceError), self._fatal_on_error():
            self.balancer.maybe_rebalance(self.num_steps)

    @under_lock
    def output(self, request: Request) -> RequestOutput:
        """The request's whole result so far (every sample, every token), as of the last step:
        from another thread it waits for the step under way (which appends a token, its
        logprobs and its text one after another)."""
        return request_output(request, self.weight_version, False, self.config.model.routed_width)

    @under_lock
    def rebalance(self, force: bool = True, inject_failure: tuple[int, int] | None = None) -> dict:
        """Re-place the experts from the recent load, between steps; see ExpertBalancer."""
        self._check_alive()
        with self._fatal_on_error():
            return self.balancer.rebalance(force=force, inject_failure=inject_failure)

    @under_lock
    def update_weights(self, source: str | Path | dict) -> int:
        """Swap every rank's weights (HF checkpoint dir or HF-named state dict) between steps;
        requests in flight go on with them, cached prefixes are dropped. -> the new version."""
        self._check_alive()
        started, weights = time.monotonic(), WeightsSource.for_update(source)
        # Two phases: every rank reads and checks its part; only when all have, every rank
        # copies it in. A refusal in phase 1 changes nothing anywhere.
        try:
            self.group.prepare_weights(weights, self.balancer.placement)
        except ValueError:
            with self._fatal_on_error():
                self.executor.call_all("discard_weights")
            raise
        except BaseException as exc:  # a rank died or stalled, or Ctrl-C: out of step
            drop_frames(exc)
            # A Ctrl-C (or SystemExit) is the user's, not a fault: its rebuild is not counted
            # against parallel.max_restarts, as one inside a step is not (_dead_if_interrupted).
            interrupted = not isinstance(exc, Exception)
            self._fail_all(f"update_weights: {type(exc).__name__}: {exc}", interrupted)
            raise
        with self._fatal_on_error():  # failing mid-copy leaves mixed weights: the engine dies
            version = self.group.commit_weights(weights)
        for blocks, scheduler in zip(self.block_managers, self.schedulers, strict=True):
            scheduler.release_head_match()  # old weights' KV; it matches again when it runs
            blocks.clear_cache()
        log.info(
            "weights updated to version %d from %s in %.1fs",
            version, weights.name(), time.monotonic() - started,
        )  # fmt: skip
        return version

    @under_lock
    def abort(self, *request_ids: str) -> None:
        """End the requests now (finish_reason "abort"), freeing their blocks; an unknown or
        finished id is ignored. Many at once cost one pass over the queues."""
        ids = set(request_ids)
        for scheduler in self.schedulers:
            scheduler.abort(ids)

    @under_lock
    def has_unfinished(self) -> bool:
        """Whether any sequence waits or runs, as of the last step (from another thread it
        waits for the step under way, which moves sequences between the two queues)."""
        return any(s.has_unfinished() for s in self.schedulers)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=sum(len(s.running) for s in self.schedulers),
            num_waiting=sum(len(s.waiting) for s in self.schedulers),
            num_steps=self.num_steps,
            kv_cache_usage=tuple(b.usage for b in self.block_managers),
            weight_version=self.weight_version,
            num_rebalances=self.balancer.num_rebalances,
            num_failed_rebalances=self.balancer.num_failed,
            last_balancedness=self.balancer.last_balancedness,
            num_preemptions=sum(s.num_preemptions for s in self.schedulers),
            num_prefix_hit_blocks=sum(b.num_hit_blocks for b in self.block_managers),
            num_restarts=self.num_restarts,
            num_shared=self.num_shared,
        )

    def shutdown(self) -> None:
        with thawed():  # a rank in this process: its model is freed even from a frozen heap
            self.executor.shutdown()
