"""LLMEngine: requests in, finished sequences out, one lockstep step at a time.

The driver side of the runtime: it owns one scheduler (and KV block bookkeeping) per
data-parallel rank, assigns each request to a DP rank, and every step hands each rank its
chunks through the executor, all ranks at once. Every request is validated before it enters a
queue (token ids in the vocabulary, prompt within the context), so a bad request raises at
`add_request` and never disturbs those in flight. A worker failure fails every request in
flight with the worker's error and leaves the engine dead, never hung.
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

from moe_runtime.block_manager import BlockManager
from moe_runtime.config import RuntimeConfig
from moe_runtime.executor import WorkerError, create_executor
from moe_runtime.expert_balancer import ExpertBalancer, RebalanceError
from moe_runtime.model_runner import sample_seed
from moe_runtime.sampler import resolve_seed
from moe_runtime.sampling_params import SamplingParams
from moe_runtime.scheduler import Scheduler
from moe_runtime.sequence import Sequence, SequenceStatus
from moe_runtime.tokenizer import load_tokenizer


class LLMEngine:
    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        parallel, cache = config.parallel, config.cache
        self.tokenizer = load_tokenizer(config.model)
        self.executor = create_executor(config)
        # Found at start-up when cache.num_blocks is 0 (sized from free GPU memory): every DP
        # rank's scheduler assumes the smallest cache any worker holds.
        self.num_kv_blocks = min(self.executor.call_all("num_kv_blocks"))
        needed = -(-config.scheduler.max_model_len // cache.block_size)
        if needed > self.num_kv_blocks:
            self.executor.shutdown()
            raise ValueError(
                f"a sequence of scheduler.max_model_len={config.scheduler.max_model_len} needs "
                f"{needed} KV blocks; the cache holds {self.num_kv_blocks} (cache.num_blocks)"
            )
        self.block_managers = [
            BlockManager(self.num_kv_blocks, cache.block_size, cache.enable_prefix_caching)
            for _ in range(parallel.dp_size)
        ]
        self.schedulers = [
            Scheduler(config.scheduler, blocks, config.model.eos_token_id)
            for blocks in self.block_managers
        ]
        self.balancer = ExpertBalancer(config, self.executor)
        self.error: str | None = None
        self.num_steps = 0
        self.weight_version = 0
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()

    @property
    def num_rebalances(self) -> int:
        return self.balancer.num_rebalances

    @property
    def last_balancedness(self) -> float | None:
        return self.balancer.last_balancedness

    def rebalance(self, force: bool = True, inject_failure: tuple[int, int] | None = None) -> dict:
        """Re-place the experts from the recent load, between steps; see ExpertBalancer."""
        self._check_alive()
        with self._fatal_on_error():
            return self.balancer.rebalance(force=force, inject_failure=inject_failure)

    def update_weights(self, source: str | dict) -> int:
        """Swap every rank's weights (HF checkpoint dir or HF-named state dict) between steps.

        Requests in flight go on with the new weights; cached prefixes are dropped, since
        their KV came from the old ones. Returns the new weight version.
        """
        self._check_alive()
        if isinstance(source, str) and not Path(source).is_dir():
            raise ValueError(f"update_weights: {source!r} is not a checkpoint directory")
        try:
            self.executor.call_all("update_weights", source)
        except ValueError:
            raise  # refused on every rank before anything changed: nothing to fail
        except Exception as exc:
            self._fail_all(f"update_weights: {type(exc).__name__}: {exc}")
            raise
        for blocks in self.block_managers:
            blocks.clear_cache()
        self.weight_version += 1
        return self.weight_version

    def _check_alive(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the engine is dead: {self.error}")

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.schedulers)

    @property
    def num_prefix_hit_blocks(self) -> int:
        return sum(b.num_hit_blocks for b in self.block_managers)

    def _pick_dp_rank(self) -> int:
        """The DP rank with the fewest unfinished sequences (lowest rank on ties).

        Which rank serves a request changes no bit of its result (layout invariance).
        """
        loads = [len(s.waiting) + len(s.running) for s in self.schedulers]
        return loads.index(min(loads))

    def _enqueue(self, seqs: list[Sequence]) -> None:
        self._check_alive()
        dp_rank = self._pick_dp_rank()
        for seq in seqs:
            seq.dp_rank = dp_rank
            self.schedulers[dp_rank].add(seq)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> list[Sequence]:
        """Queue one request (n sequences); raises ValueError naming the problem if it is bad."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(token_ids)
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        seed = resolve_seed(params.seed)
        seqs = [
            Sequence(
                next(self._seq_ids),
                request_id,
                i,
                list(token_ids),
                params,
                sample_seed(seed, i, params.n),
            )
            for i in range(params.n)
        ]
        self._enqueue(seqs)
        return seqs

    def add_score_request(
        self, token_ids: list[int], prompt_len: int, request_id: str | None = None
    ) -> Sequence:
        """Queue a teacher-forced scoring of token_ids[prompt_len:] given everything before."""
        self.validate_prompt(token_ids)
        if not 1 <= prompt_len < len(token_ids):
            raise ValueError(
                f"prompt_len must be in [1, {len(token_ids) - 1}] for a sequence of "
                f"{len(token_ids)} tokens, got {prompt_len}"
            )
        request_id = request_id if request_id is not None else f"score-{next(self._request_ids)}"
        seq = Sequence(
            next(self._seq_ids),
            request_id,
            0,
            list(token_ids[:prompt_len]),
            SamplingParams(),
            0,
            is_score=True,
            output_token_ids=list(token_ids[prompt_len:]),
        )
        self._enqueue([seq])
        return seq

    def validate_prompt(self, token_ids: list[int]) -> None:
        vocab = self.config.model.vocab_size
        max_len = self.config.scheduler.max_model_len
        if not token_ids:
            raise ValueError("prompt is empty")
        bad = next(
            (
                t
                for t in token_ids
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
            ),
            None,
        )
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(token_ids) > max_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, more than scheduler.max_model_len={max_len}"
            )

    def step(self) -> list[Sequence]:
        """Run one lockstep step on every rank; returns the sequences that finished in it."""
        self._check_alive()
        per_dp_rank = [scheduler.schedule() for scheduler in self.schedulers]
        tp_size = self.config.parallel.tp_size
        # Worker rank w serves DP rank w // tp_size; all TP ranks of a group get the same chunks.
        per_worker = [chunks for chunks in per_dp_rank for _ in range(tp_size)]
        with self._fatal_on_error():
            results = self.executor.execute(per_worker)[::tp_size]  # TP rank 0 of each group
        finished = []
        for scheduler, chunks, result in zip(self.schedulers, per_dp_rank, results, strict=True):
            for chunk in chunks:
                seq = chunk.seq
                seq.output_logprobs.extend(result.scored.get(seq.seq_id, []))
                if seq.seq_id in result.routed:
                    seq.routed_experts.append(result.routed[seq.seq_id])
            finished.extend(scheduler.update(chunks, result.samples))
        self.num_steps += 1
        try:
            with self._fatal_on_error():
                self.balancer.maybe_rebalance(self.num_steps)  # between steps
        except RebalanceError:
            pass  # logged; the old placement keeps serving and nothing in flight changed
        return finished

    @contextlib.contextmanager
    def _fatal_on_error(self):
        """A worker that died, stalled or failed mid-collective leaves the ranks out of step:
        every request in flight ends with the error and the engine stays dead."""
        try:
            yield
        except RebalanceError:
            raise  # every rank agreed to keep the old placement: still in step
        except Exception as exc:
            self._fail_all(
                f"{type(exc).__name__}: {exc}" if not isinstance(exc, WorkerError) else str(exc)
            )
            raise

    def _fail_all(self, error: str) -> None:
        """Every request in flight ends with the error; nothing is left waiting forever."""
        self.error = error
        for scheduler in self.schedulers:
            for seq in (*scheduler.waiting, *scheduler.running):
                seq.status, seq.finish_reason, seq.error = SequenceStatus.FINISHED, "error", error
            scheduler.waiting.clear()
            scheduler.running.clear()

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.schedulers)

    def abort(self, request_id: str) -> None:
        for scheduler in self.schedulers:
            scheduler.abort(request_id)

    def stats(self) -> list[dict[str, int]]:
        return self.executor.stats()

    def shutdown(self) -> None:
        self.executor.shutdown()
