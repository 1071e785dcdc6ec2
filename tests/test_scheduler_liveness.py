"""Liveness and order of the Scheduler over random request mixes, in plain Python.

Each mix draws a cache of a few blocks (a sequence of max_model_len always fits: the engine
refuses a smaller cache at start), a budget, chunked prefill on or off, prefix caching,
overlap_decode with held admissions, admission reserves of 0-2 blocks, arrivals over time
(prompts sharing prefixes, n up to 3, scorings, max_tokens to the context's end), aborts and
weight updates (the cache cleared).
After every step:
- each block's reference count is the number of block tables holding it, and only the queue's
  head holds blocks while it waits (its prefix match);
- running then waiting is in arrival order: FCFS, a preempted sequence ahead of newer ones;
- the step's chunks fit the budget and at most max_num_seqs run.
At the end every sequence finished within a bound of steps with all its tokens (none lost to
preemption), first admissions came in arrival order, and every block is free.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from moe_runtime.config import SchedulerConfig
from moe_runtime.engine.block_manager import BlockManager
from moe_runtime.engine.request import Request
from moe_runtime.engine.scheduler import Scheduler
from moe_runtime.engine.step_io import build_step_input
from moe_runtime.sampling_params import SamplingParams
from moe_runtime.tokenizer import ByteTokenizer
from moe_runtime.worker.step_input import SampleResult

TOKENIZER = ByteTokenizer(512)
MAX_STEPS = 3000


def _scheduler(rng: random.Random) -> Scheduler:
    block_size, max_model_len = rng.choice([1, 2, 4]), rng.choice([8, 16, 32])
    num_blocks = -(-max_model_len // block_size) + rng.randint(0, 6)
    is_chunked, overlap = rng.random() < 0.7, rng.random() < 0.3
    config = SchedulerConfig(
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.randint(1 if is_chunked else max_model_len, 2 * max_model_len),
        max_model_len=max_model_len,
        enable_chunked_prefill=is_chunked,
        overlap_decode=overlap,
        admission_reserve=rng.choice([0, 1, 1, 2]),
    )
    blocks = BlockManager(num_blocks, block_size, rng.random() < 0.6)
    return Scheduler(config, blocks, (), can_hold_admission=overlap and rng.random() < 0.5)


def _request(rng: random.Random, index: int, max_model_len: int, prefixes) -> Request:
    num_prompt = rng.randint(1, max_model_len - 1)
    prompt = rng.choice(prefixes)[:num_prompt] if rng.random() < 0.5 else None
    prompt = prompt or [rng.randrange(256) for _ in range(num_prompt)]
    if rng.random() < 0.15 and num_prompt >= 2:
        return Request(f"s{index}", prompt[:1], SamplingParams(), 0, score_token_ids=prompt[1:])
    max_tokens = rng.choice([None, rng.randint(1, max_model_len - num_prompt)])
    params = SamplingParams(
        max_tokens=max_tokens, n=rng.choice([1, 1, 2, 3]), ignore_eos=True, temperature=0.0
    )
    return Request(f"r{index}", prompt, params, seed=1)


def _check_blocks(scheduler: Scheduler) -> None:
    held = Counter()
    for seq in scheduler.running + list(scheduler.waiting):
        held.update(seq.block_table)
    assert not any(seq.block_table for seq in list(scheduler.waiting)[1:])
    blocks = scheduler.blocks
    assert [blocks._ref_counts[b] for b in range(blocks.num_blocks)] == [
        held[b] for b in range(blocks.num_blocks)
    ]


@pytest.mark.parametrize("seed", range(60))
def test_every_mix_finishes_in_arrival_order_and_frees_every_block(seed):
    rng = random.Random(seed)
    scheduler = _scheduler(rng)
    max_model_len = scheduler.config.max_model_len
    prefixes = [[rng.randrange(256) for _ in range(max_model_len)] for _ in range(3)]
    num_requests, requests, next_seq_id = rng.randint(1, 25), [], 0
    first_admissions: dict[int, None] = {}  # seq ids in the order of their first chunk
    num_steps = 0
    while len(requests) < num_requests or scheduler.has_unfinished():
        if len(requests) < num_requests and rng.random() < 0.5:
            requests.append(_request(rng, len(requests), max_model_len, prefixes))
            for seq in requests[-1].expand_samples(next_seq_id, TOKENIZER):
                scheduler.add(seq)
            next_seq_id += len(requests[-1].samples)
        if rng.random() < 0.03:  # a weight update
            scheduler.release_head_match()
            scheduler.blocks.clear_cache()
        if requests and rng.random() < 0.05:
            scheduler.abort({rng.choice(requests).request_id})
        _check_blocks(scheduler)
        order = [seq.seq_id for seq in scheduler.running + list(scheduler.waiting)]
        assert order == sorted(order), order
        chunks = scheduler.schedule()
        build_step_input(scheduler.collect_released(), chunks, scheduler.is_lookahead)
        assert sum(c.num_tokens for c in chunks) <= scheduler.config.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        first_admissions.update((c.seq.seq_id, None) for c in chunks)
        samples = {
            c.seq.seq_id: SampleResult(7, 0.0, {})
            for c in chunks
            if not c.seq.is_score and c.start + c.num_tokens == c.seq.num_tokens
        }
        scheduler.update(chunks, samples)
        scheduler.is_ahead = scheduler.is_lookahead and rng.random() < 0.8
        num_steps += 1
        assert num_steps < MAX_STEPS, "no progress"
    _check_blocks(scheduler)
    assert scheduler.blocks.num_free_blocks == scheduler.blocks.num_blocks
    assert list(first_admissions) == sorted(first_admissions)
    for seq in (seq for request in requests for seq in request.samples):
        assert seq.finish_reason in ("abort", "scored" if seq.is_score else "length")
        if seq.finish_reason == "length":
            max_tokens = seq.params.max_tokens or max_model_len - len(seq.prompt_token_ids)
            assert seq.num_output_tokens == max_tokens
