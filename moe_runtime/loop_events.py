"""What the EngineLoop reports: per-sample token events and a snapshot of its counts.

Plain frozen values built on the loop thread and safe to hand to any other thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moe_runtime.sequence import Sequence


@dataclass(frozen=True)
class TokenEvent:
    """New output of one sample since its previous event, sent from the loop thread.

    Values are copies of what the sequence recorded, so they are bitwise the final results.
    """

    prompt_idx: int
    sample_idx: int
    num_prompt_tokens: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[dict[int, float], ...]
    finish_reason: str | None  # set on the sample's last event
    weight_version: int

    @classmethod
    def of(
        cls, seq: Sequence, prompt_idx: int, sample_idx: int, start: int, weight_version: int
    ) -> TokenEvent:
        """The event for seq's output tokens from `start` on."""
        return cls(
            prompt_idx,
            sample_idx,
            seq.num_prompt_tokens,
            tuple(seq.output_token_ids[start:]),
            tuple(seq.output_logprobs[start:]),
            tuple(seq.output_top_logprobs[start:]),
            seq.finish_reason if seq.is_finished else None,
            weight_version,
        )


TokenCallback = Callable[[TokenEvent], None]


@dataclass(frozen=True)
class LoopStats:
    """A snapshot taken on the loop thread after the last step."""

    num_running: int = 0
    num_waiting: int = 0
    num_steps: int = 0
    kv_cache_usage: tuple[float, ...] = ()  # per DP rank, fraction of KV blocks in use
    weight_version: int = 0
    num_rebalances: int = 0
    last_balancedness: float | None = None
