"""Request and Sequence: what the driver knows of one request and of each of its samples.

`Request.expand_samples()` is the only place a request becomes its n sequences, each with its
own seed (moe_runtime.seeds), so `LLM`, HTTP and rollouts fan out the same way. A `Sequence`
holds what the scheduler, the block manager and the outputs need, and how much of it its
worker already holds, from which the engine builds the wire format's deltas. Workers never
see these objects.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from moe_runtime.engine.block_manager import ROOT_KEY_ID
from moe_runtime.engine.detokenizer import IncrementalDetokenizer
from moe_runtime.sampling_params import SamplingParams
from moe_runtime.seeds import sample_seeds


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: Request
    sample_idx: int
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # Per output token (when the request asks): [L_moe, K] int32 logical experts that routed it.
    routed_experts: list[np.ndarray] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prefix-cache commits so far: the next block to commit and the key id it chains from.
    num_committed_blocks: int = 0
    commit_parent: int = ROOT_KEY_ID
    status: SequenceStatus = SequenceStatus.WAITING
    is_preempted: bool = False  # preempted once at least: it resumes only once it fits whole
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    error: str | None = None  # the engine's fault that ended it ("error"), if one did
    # The output position whose logits were not finite (NaN): it ended there with "error", no
    # token kept for that position (one drawn from NaN logits is no sample). A scoring's first
    # NaN logprob (its index among the scored tokens): it runs to its end, then "error".
    non_finite_at: int | None = None
    is_end_reported: bool = False  # a delta carried its finish_reason
    dp_rank: int = 0
    # What the worker holds: 0 sent tokens means it holds nothing (new, or preempted).
    num_sent_tokens: int = 0
    num_sent_blocks: int = 0
    num_reported: int = 0  # output tokens already handed out as deltas
    detokenizer: IncrementalDetokenizer | None = None
    # The weights' versions at this sample's first and latest step (None before its first):
    # where they differ, a weight update came while it ran.
    first_weight_version: int | None = None
    last_weight_version: int | None = None

    def __post_init__(self) -> None:
        self.params: SamplingParams = self.request.params
        self.prompt_token_ids: list[int] = self.request.prompt_token_ids
        self.is_score: bool = self.request.is_score

    @property
    def token_ids(self) -> list[int]:
        """Prompt then outputs: a new list, O(length); not for per-step paths."""
        return self.prompt_token_ids + self.output_token_ids

    def tokens_from(self, start: int) -> list[int]:
        """token_ids[start:] without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt :]
        return self.prompt_token_ids[start:] + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_on_worker(self) -> bool:
        return self.num_sent_tokens > 0

    def note_step(self, weight_version: int) -> None:
        """Count a step of this sample's, run with weight_version, here and on its request."""
        if self.first_weight_version is None:
            self.first_weight_version = weight_version
            self.request.num_started += 1
            if self.request.first_weight_version is None:
                self.request.first_weight_version = weight_version
        self.last_weight_version = self.request.last_weight_version = weight_version

    def leave_worker(self) -> bool:
        """Count the worker's copy as dropped (released: the next step names it), so a
        preempted sequence is sent whole again; -> whether the worker held one."""
        was_on_worker = self.is_on_worker
        self.num_sent_tokens = self.num_sent_blocks = 0
        return was_on_worker


@dataclass(eq=False)
class Request:
    """One prompt. For a scoring request `score_token_ids` are the tokens to score after it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    score_token_ids: list[int] | None = None
    samples: list[Sequence] = field(default_factory=list)
    # Over its samples' steps (Sequence.note_step): how many samples ran a step, the weights'
    # versions at the first and the latest.
    num_started: int = 0
    first_weight_version: int | None = None
    last_weight_version: int | None = None
    _prompt_copy: list[int] | None = field(default=None, repr=False)
    _num_finished: int = field(default=0, repr=False)  # samples[:_num_finished] have finished

    def prompt_copy(self) -> list[int]:
        """The prompt's ids for deltas: one copy made once, shared by the request's deltas
        (not one a delta: O(prompt) a step), so a caller who changes a delta's list changes
        nothing the engine runs. A whole output gets a copy of its own."""
        if self._prompt_copy is None:
            self._prompt_copy = list(self.prompt_token_ids)
        return self._prompt_copy

    @property
    def is_score(self) -> bool:
        return self.score_token_ids is not None

    @property
    def is_finished(self) -> bool:
        """Whether every sample has finished. Why a pointer past the finished ones (a sample
        never runs again once finished): asked at every step (each delta, the progress bar, a
        server's submission), a pass over the finished samples cost O(n) a step."""
        samples = self.samples
        while self._num_finished < len(samples) and samples[self._num_finished].is_finished:
            self._num_finished += 1
        return self._num_finished == len(samples)

    def weight_versions(self, weight_version: int) -> tuple[int, int]:
        """(newest, oldest) weight version over its samples' steps, a sample that has run none
        counting as weight_version, the engine's now (versions only grow)."""
        if self.num_started == 0:
            return weight_version, weight_version
        newest = self.last_weight_version
        if self.num_started < len(self.samples):
            newest = weight_version
        return newest, self.first_weight_version

    def expand_samples(self, first_seq_id: int, tokenizer) -> list[Sequence]:
        """The request's n sequences, with seq ids first_seq_id.. and one seed each."""
        if self.is_score:
            self.samples = [Sequence(first_seq_id, self, 0, self.seed, list(self.score_token_ids))]
            return self.samples
        self.samples = [
            Sequence(
                first_seq_id + i,
                self,
                i,
                seed,
                detokenizer=IncrementalDetokenizer(
                    tokenizer,
                    self.params.stop,
                    self.prompt_token_ids,
                    self.params.include_stop_str_in_output,
                ),
            )
            for i, seed in enumerate(sample_seeds(self.seed, self.params.n))
        ]
        return self.samples
