"""The driver <-> worker wire format: what one rank receives per step, and what it answers.

Only deltas cross: a sequence's tokens, sampling settings and seed once (again after a
preemption), then per step the tokens the worker has not seen and the blocks appended to its
table; released ids drop the worker's copy; answers hold the step's results only. No field
grows with context. Plain dataclasses, cheap to pickle; the engine imports this module and
nothing else of the worker package. A rank that fails becomes a `WorkerError` on the driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moe_runtime.sampling_params import SamplingParams


@dataclass
class NewSequence:
    """A sequence the worker does not hold yet (the worker's SequenceState extends it)."""

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
    # The next step is likely the decode of these sequences (nothing waits on this rank, or
    # what waits is held back until a sequence ends), so the worker may launch it ahead
    # (scheduler.overlap_decode).
    lookahead: bool = False


class WorkerError(RuntimeError):
    """A rank died, timed out or failed a step; the message names the rank and the step."""


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
    # Their top logprobs {id: logprob}, for scorings that ask (params.logprobs): decode's.
    scored_top: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    # [L_moe, K] int32 logical experts of the sampled position; only for sequences that ask.
    # Arrays, not nested lists: one object per token on the driver, not L_moe * (K + 1).
    routed: dict[int, np.ndarray] = field(default_factory=dict)
    # [S, L_moe, K] int32 logical experts of each new scored position, in order (the position
    # whose logits scored the token); only for scorings that ask (params.return_routed_experts).
    scored_routed: dict[int, np.ndarray] = field(default_factory=dict)
    # The rank launched the next decode step of this step's samples ahead (overlap_decode).
    is_ahead: bool = False
