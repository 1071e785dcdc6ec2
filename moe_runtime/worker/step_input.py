"""The driver <-> worker wire format: what one rank receives per step, and what it answers.

Only deltas cross. A sequence's known token ids, sampling settings and seed travel once
(`NewSequence`; again after a preemption, which dropped the worker's copy); afterwards a step
carries the token ids the worker has not seen (the last sampled one, in decode) and the
blocks appended to the sequence's block table. Finished, aborted and preempted ids drop the
worker's state. The answer holds this step's results only. No field grows with a sequence's
context, so a decode step's bytes are set by the batch, not by the history.

Plain frozen dataclasses of ints, floats, lists and `SamplingParams`: cheap to pickle, and
the engine never hands a worker its own bookkeeping objects. The engine imports this module
and nothing else of the worker package.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moe_runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewSequence:
    """A sequence the worker does not hold yet."""

    seq_id: int
    token_ids: list[int]  # every token known now: the prompt, then the outputs so far
    num_prompt_tokens: int
    num_computed_tokens: int  # positions whose KV is already cached (prefix-cache hits)
    params: SamplingParams
    seed: int
    is_score: bool = False  # teacher-forced: logprobs of token_ids[num_prompt_tokens:]
    num_scored: int = 0  # score: logprobs already returned (before a preemption)


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: positions [start, start + num_tokens)."""

    seq_id: int
    start: int  # equals the worker's count of computed positions: a check, not a command
    num_tokens: int
    new_token_ids: list[int] = field(default_factory=list)  # appended since the last step
    new_block_ids: list[int] = field(default_factory=list)  # appended to the block table


@dataclass(frozen=True)
class StepInput:
    """One rank's step. Applied in field order: release, then add, then run `scheduled`."""

    released_seq_ids: list[int] = field(default_factory=list)  # finished, aborted, preempted
    new_seqs: list[NewSequence] = field(default_factory=list)
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # batch order

    @property
    def is_empty(self) -> bool:
        return not (self.released_seq_ids or self.new_seqs or self.scheduled)


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float]


@dataclass
class StepOutput:
    """What one rank returns from a step, keyed by seq_id."""

    samples: dict[int, SampleResult] = field(default_factory=dict)
    scored: dict[int, list[float]] = field(default_factory=dict)  # new teacher-forced logprobs
    # [L_moe, K] int32 logical experts of the sampled position; only for sequences that ask.
    # Arrays, not nested lists: one object per token on the driver, not L_moe * (K + 1).
    routed: dict[int, np.ndarray] = field(default_factory=dict)
