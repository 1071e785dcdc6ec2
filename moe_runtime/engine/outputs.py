"""RequestOutput and CompletionOutput: the one output type of `LLM`, HTTP and rollouts.

A step's delta and a whole result are the same type: a delta holds only the samples that
changed and only their new tokens and text. Values are copies of what the engine recorded (a
delta's floats are the final result's bits): plain frozen values, safe for any thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CompletionOutput:
    index: int  # the sample's index among the request's n
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    text: str  # cut before a stop string (after it with include_stop_str_in_output)
    # None while the sample runs; stop | length | abort | error: its logits were not finite
    # (NaN) at the step after its last token, which ended it there; or the engine failed.
    finish_reason: str | None
    seed: int  # the seed this sample drew its noise from
    # What ended a "stop": the stop string (str) or stop token id (int); None for EOS, for
    # any other finish_reason and while the sample runs (vLLM's field).
    stop_reason: int | str | None = None
    # When the request asks: int32 [T, L_moe, K], the logical experts (top-k in slot order,
    # per MoE layer) that routed the position whose logits sampled token t.
    routed_experts: np.ndarray | None = None
    # The weights' versions at this sample's latest and first step (both the engine's version
    # before it ran): they differ where a weight update came while it ran, and its tokens then
    # came from both versions, equal to neither's alone.
    weight_version: int = 0
    first_weight_version: int = 0
    # Why finish_reason is "error" (non_finite_error's or non_finite_score_error's words, or the
    # engine's fault); else None.
    error: str | None = None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]  # a copy: a whole output's own, a request's deltas' shared
    outputs: list[CompletionOutput]  # a delta: the samples that changed; else all n
    is_finished: bool
    # Over all the request's samples (not only a delta's): the newest version any step of
    # theirs ran with, and the oldest (CompletionOutput's, per sample).
    weight_version: int = 0
    first_weight_version: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[float]:
        return self.outputs[0].logprobs

    @property
    def top_logprobs(self) -> list[dict[int, float]]:
        return self.outputs[0].top_logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def error(self) -> str | None:
        return self.outputs[0].error

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def routed_experts(self) -> np.ndarray | None:
        return self.outputs[0].routed_experts


def non_finite_score_error(position: int) -> str:
    """CompletionOutput.error of a scoring whose logits were not finite at scored token
    `position` (its index among the scored tokens)."""
    return (
        f"non-finite logits (NaN) at scored token {position}: the model's output was not a "
        "number there, so that token's logprob is NaN (finish_reason 'error'; the scoring ran "
        "to its end, later logprobs as the model gave them)"
    )


def non_finite_error(sample_idx: int, position: int) -> str:
    """CompletionOutput.error of a sample whose logits were not finite at output `position`."""
    return (
        f"non-finite logits (NaN) for sample {sample_idx} at output token {position}: the "
        "model's output was not a number there, so the sample ended (finish_reason 'error') "
        "with the tokens before it"
    )


@dataclass(frozen=True)
class EngineStats:
    """Counts and state of the engine after its last step."""

    num_running: int = 0
    num_waiting: int = 0
    num_steps: int = 0
    kv_cache_usage: tuple[float, ...] = ()  # per DP rank, fraction of KV blocks in use
    weight_version: int = 0
    num_rebalances: int = 0
    num_failed_rebalances: int = 0  # moves a rank refused, the old placement kept serving
    last_balancedness: float | None = None
    num_preemptions: int = 0
    num_prefix_hit_blocks: int = 0
    num_restarts: int = 0  # worker-group rebuilds after a rank died or stalled
    num_shared: int = 0  # waiting sequences moved to an idler DP rank (share_waiting)
