"""Sequence: one sample of one request as the scheduler and runner see it.

Holds the token ids (prompt then output), how many of them are in the KV cache, the block table,
the resolved seed and what was sampled. A request with n > 1 is n sequences with derived seeds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from moe_runtime.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    sample_idx: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    is_score: bool = False  # teacher-forced scoring: logprobs of the given tokens, no sampling
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # Per output token: [MoE layer][K] logical experts that routed the position it was sampled at.
    routed_experts: list[list[list[int]]] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    dp_rank: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
