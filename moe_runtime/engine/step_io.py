"""The driver's side of one step: each DP rank's wire message out (`build_step_input`), its
results onto the sequences (`record_results`: tokens, logprobs, routed experts, stop strings),
and a request's output, whole or as a delta (`request_output`).
"""

from __future__ import annotations

import math

import numpy as np

from moe_runtime.engine.outputs import (
    CompletionOutput,
    RequestOutput,
    non_finite_error,
    non_finite_score_error,
)
from moe_runtime.engine.request import Request, Sequence
from moe_runtime.engine.scheduler import ScheduledChunk, Scheduler, is_non_finite
from moe_runtime.worker.step_input import NewSequence, ScheduledSeq, StepInput, StepOutput


def record_results(scheduler: Scheduler, chunks: list[ScheduledChunk], result: StepOutput) -> None:
    """Outputs of one DP rank's step onto its sequences; ends samples at stop strings, and
    with "error" those whose logits were not finite (Scheduler.update; a scoring at its end,
    its first NaN logprob's place kept)."""
    for chunk in chunks:
        seq = chunk.seq
        sample = result.samples.get(seq.seq_id)
        if sample is not None and is_non_finite(sample):
            continue  # no token kept for it (Scheduler.update ends it): nor its routing
        scored = result.scored.get(seq.seq_id, ())
        first_nan = next((i for i, x in enumerate(scored) if math.isnan(x)), None)
        if seq.non_finite_at is None and first_nan is not None:
            seq.non_finite_at = len(seq.output_logprobs) + first_nan
        seq.output_logprobs.extend(scored)
        # A top a scored token, empty when none was asked for, as decode reports them.
        seq.output_top_logprobs.extend(result.scored_top.get(seq.seq_id) or [{} for _ in scored])
        if seq.seq_id in result.routed:
            seq.routed_experts.append(result.routed[seq.seq_id])
        if seq.seq_id in result.scored_routed:  # one [L_moe, K] a scored token
            seq.routed_experts.extend(result.scored_routed[seq.seq_id])
    scheduler.update(chunks, result.samples)
    scheduler.is_ahead = result.is_ahead
    for chunk in chunks:
        seq = chunk.seq
        if seq.detokenizer is None or seq.seq_id not in result.samples:
            continue
        # A sample ended by a stop token id or EOS this step (finish_reason's "stop"; stop
        # strings are found below) keeps the id in token_ids and leaves its text out, as vLLM
        # does (without include_stop_str_in_output): a stop on a newline id gives no trailing
        # newline, the text a stop string on the same character gives.
        is_id_stop = seq.is_finished and seq.finish_reason == "stop"
        is_id_stop = is_id_stop and not seq.params.include_stop_str_in_output
        token_ids = seq.output_token_ids[:-1] if is_id_stop else seq.output_token_ids
        may_stop = seq.params.may_stop(seq.num_output_tokens)
        stopped = seq.detokenizer.update(token_ids, seq.is_finished, may_stop)
        if stopped and not seq.is_finished:
            scheduler.finish(seq, "stop", seq.detokenizer.stop_string)
        elif stopped and seq.finish_reason in ("length", "stop"):
            # Its last allowed token, or the stop id or EOS whose text was read (with
            # include_stop_str_in_output), completed a stop string: the string cut the text, so
            # it is the reason (vLLM's rule).
            seq.finish_reason, seq.stop_reason = "stop", seq.detokenizer.stop_string


def request_output(
    request: Request,
    weight_version: int,
    is_delta: bool,
    routed_width: tuple[int, int],
    samples: list[Sequence] | None = None,
) -> RequestOutput:
    """The whole result, or (is_delta) what changed since the last delta: the samples with
    new tokens, only their new tokens and text. Values are copies. routed_width: (MoE layers,
    K) of a routed-experts row, so a sample with no tokens has [0, L_moe, K]. samples: a
    delta's candidates in sample order (the step's: none other has new tokens), not all n.
    Why: a pass over every sample each step cost O(n) a step (15 ms at n = 50,000)."""
    outputs = []
    for seq in request.samples if samples is None else samples:
        last, first = _versions(seq, weight_version)
        start = seq.num_reported if is_delta else 0
        # A sample ended with no new token (its logits not finite) still reports its end.
        is_end_news = seq.is_finished and not seq.is_end_reported
        if is_delta and seq.num_output_tokens == start and not is_end_news:
            continue
        if is_delta:
            seq.num_reported = seq.num_output_tokens
            seq.is_end_reported = seq.is_finished
            text = seq.detokenizer.delta(seq.is_finished)
        else:
            text = seq.detokenizer.text if seq.detokenizer else ""
        routed = None
        if seq.params.return_routed_experts:
            rows = seq.routed_experts[start:]
            routed = np.array(rows, dtype=np.int32).reshape(len(rows), *routed_width)
        outputs.append(
            CompletionOutput(
                index=seq.sample_idx,
                token_ids=seq.output_token_ids[start:],
                logprobs=seq.output_logprobs[start:],
                top_logprobs=[dict(top) for top in seq.output_top_logprobs[start:]],
                text=text,
                finish_reason=seq.finish_reason if seq.is_finished else None,
                seed=seq.seed,
                stop_reason=seq.stop_reason if seq.is_finished else None,
                error=_error(seq),
                routed_experts=routed,
                weight_version=last,
                first_weight_version=first,
            )
        )
    return RequestOutput(
        request.request_id,
        request.prompt_copy() if is_delta else list(request.prompt_token_ids),
        outputs,
        request.is_finished,
        *request.weight_versions(weight_version),
    )


def _error(seq: Sequence) -> str | None:
    """What ended a sample with "error": the engine's fault, or logits that were not finite."""
    if seq.non_finite_at is not None and seq.is_score:
        return non_finite_score_error(seq.non_finite_at)
    if seq.non_finite_at is not None:
        return non_finite_error(seq.sample_idx, seq.non_finite_at)
    return seq.error


def _versions(seq: Sequence, weight_version: int) -> tuple[int, int]:
    """(latest, first) weight version of a sample's steps; the engine's now before its first."""
    if seq.first_weight_version is None:
        return weight_version, weight_version
    return seq.last_weight_version, seq.first_weight_version


def build_step_input(
    released_ids: list[int], chunks: list[ScheduledChunk], lookahead: bool = False
) -> StepInput:
    """One DP rank's wire message: drop the released sequences' copies (Scheduler.released),
    send new ones whole and running ones only the tokens and blocks their worker has not seen;
    lookahead: the next step is likely the decode of these sequences (Scheduler.is_lookahead)."""
    new_seqs, scheduled = [], []
    for chunk in chunks:
        seq = chunk.seq
        new_token_ids: list[int] = []
        if not seq.is_on_worker:
            new_seqs.append(
                NewSequence(
                    seq.seq_id,
                    seq.token_ids,
                    len(seq.prompt_token_ids),
                    chunk.start,
                    seq.params,
                    seq.seed,
                    seq.is_score,
                    len(seq.output_logprobs) if seq.is_score else 0,
                )
            )
        else:
            new_token_ids = seq.tokens_from(seq.num_sent_tokens)
        seq.num_sent_tokens = seq.num_tokens
        new_block_ids = seq.block_table[seq.num_sent_blocks :]
        seq.num_sent_blocks = len(seq.block_table)
        scheduled.append(
            ScheduledSeq(seq.seq_id, chunk.start, chunk.num_tokens, new_token_ids, new_block_ids)
        )
    return StepInput(released_ids, new_seqs, scheduled, lookahead)
