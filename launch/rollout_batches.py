"""One batch of a rollout job on the engine: every sample its own request (with its own seed),
stepped together until done, each turned into its output row (launch/rollout.py writes the
rows; launch.rollout_io defines what a row holds). `rollout_batch` generates, `score_batch`
teacher-forces rows' token ids; both add each prompt's routed experts where asked. Nothing here
reads flags or files, or retries a batch: that is launch/rollout.py's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from tqdm import tqdm

from launch import cli
from launch.rollout_io import Sample
from moe_runtime import LLM, RequestOutput
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.request import Request
from moe_runtime.llm import step_until_done


def rollout_batch(
    llm: LLM,
    batch: list[Sample],
    progress: tqdm,
    stop: Callable[[], None],
    prompt_routed: bool = False,
) -> list[dict]:
    """Generate the batch together (one request per sample); rows in batch order. `stop()`
    between two steps raises Stopped once a stop signal came. prompt_routed: each row's
    prompt routed experts too (`_queue_prompt_routing`)."""
    engine = llm.engine
    prompt_routing = _queue_prompt_routing(engine, batch) if prompt_routed else None
    requests = engine.add_requests([s.prompt for s in batch], [s.params for s in batch])
    step_until_done(engine, requests, progress, stop)
    rows = [_rollout_row(s, engine.output(r)) for s, r in zip(batch, requests, strict=True)]
    return _with_prompt_routing(rows, batch, engine, prompt_routing)


def _queue_prompt_routing(engine: LLMEngine, batch: list[Sample]) -> dict[int, Request]:
    """Queue, for each input row of the batch (its samples share the prompt), the scoring of
    its prompt from the first token with routed experts: the prompt's routing, each token's
    but the first (the position before it), which generation does not report. Queued before
    the batch: a sample admitted after it computed the prompt's full blocks hits them (one
    admitted beside it computes them again; the same bits). -> {line_no: scoring}; a one-token
    prompt has none (nothing before its only token)."""
    prompts = {}
    for sample in batch:
        if len(sample.prompt) >= 2:
            prompts.setdefault(sample.line_no, sample.prompt)
    if not prompts:
        return {}
    scorings = engine.add_score_requests(list(prompts.values()), [1] * len(prompts), None, True)
    return dict(zip(prompts, scorings, strict=True))


def _with_prompt_routing(
    rows: list[dict], batch: list[Sample], engine: LLMEngine, scorings: dict[int, Request] | None
) -> list[dict]:
    """Each row with its prompt's routed experts ([prompt - 1, MoE layers, K]) where asked."""
    if scorings is None:
        return rows
    for row, sample in zip(rows, batch, strict=True):
        scoring = scorings.get(sample.line_no)
        routed = [] if scoring is None else engine.output(scoring).outputs[0].routed_experts
        row["prompt_routed_experts"] = np.asarray(routed).tolist()
    return rows


def _rollout_row(sample: Sample, output: RequestOutput) -> dict:
    """A sample's output row; one ended with finish_reason "error" (its logits were not
    finite) also holds `error`, why, and is not written (rollout_io.append_rows)."""
    (out,) = output.outputs
    routed = out.routed_experts
    failed = {"error": out.error} if out.finish_reason == "error" else {}
    return {
        "id": sample.row_id,
        "sample_idx": sample.sample_idx,
        "prompt_token_ids": output.prompt_token_ids,
        "token_ids": out.token_ids,
        "text": out.text,  # as generate returns it (token_ids keep the stop token)
        "logprobs": out.logprobs,
        "top_logprobs": cli.json_top_logprobs(out.top_logprobs),
        "routed_experts": None if routed is None else np.asarray(routed).tolist(),
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "seed": out.seed,
        **failed,
    }


def score_batch(
    llm: LLM,
    batch: list[Sample],
    progress: tqdm,
    stop: Callable[[], None],
    num_top: int,
    routed: bool,
    prompt_routed: bool = False,
) -> list[dict]:
    """Rows of teacher-forced logprobs, with each position's `num_top` top logprobs (as a
    rollout row writes them) when num_top > 0, its routed experts when `routed`, and the
    prompt's when `prompt_routed` (as a rollout's). `stop()` between two steps, as a
    rollout's."""
    engine = llm.engine
    prompt_routing = _queue_prompt_routing(engine, batch) if prompt_routed else None
    sequences = [[*s.prompt, *s.token_ids] for s in batch]
    prompt_lens = [len(s.prompt) for s in batch]
    requests = engine.add_score_requests(sequences, prompt_lens, num_top or None, routed)
    step_until_done(engine, requests, progress, stop)
    rows = []
    for s, request in zip(batch, requests, strict=True):
        (out,) = engine.output(request).outputs
        row = {
            "id": s.row_id,
            "sample_idx": s.sample_idx,
            "prompt_token_ids": list(s.prompt),
            "token_ids": list(s.token_ids),
            "logprobs": out.logprobs,
        }
        if num_top:
            row["top_logprobs"] = cli.json_top_logprobs(out.top_logprobs)
        if routed:
            row["routed_experts"] = np.asarray(out.routed_experts).tolist()
        if out.finish_reason == "error":  # NaN logits: not written (rollout_io.append_rows)
            row.update(finish_reason="error", error=out.error)
        rows.append(row)
    return _with_prompt_routing(rows, batch, engine, prompt_routing)
