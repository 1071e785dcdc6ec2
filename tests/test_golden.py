"""Golden batch-invariance test: 64 prompts alone, all together and in shuffled sub-batches.

Bitwise equal token ids, chosen logprobs and top-5 logprobs, greedy and seeded sampling; the
negative control (kernels.mode: fast) must find a difference; the engagement check proves the
batched runs really put many sequences into one step.
"""

from __future__ import annotations

import pytest

from moe_runtime import LLM
from tests.invariance import (
    TINY_CONFIG,
    mixed_params,
    mixed_prompts,
    random_sub_batches,
    record_steps,
    run_in_batches,
)

NUM_PROMPTS, MAX_TOKENS = 64, 32


@pytest.fixture(scope="module")
def workload():
    return mixed_prompts(NUM_PROMPTS, 8, 300, seed=11), mixed_params(NUM_PROMPTS, MAX_TOKENS)


def _alone_vs_together(mode: str, workload) -> tuple[dict, dict, dict, list[int]]:
    prompts, params = workload
    alone_llm = LLM(TINY_CONFIG, **{"kernels.mode": mode, "cache.enable_prefix_caching": False})
    alone = run_in_batches(alone_llm, prompts, params, [[i] for i in range(NUM_PROMPTS)])
    llm = LLM(TINY_CONFIG, **{"kernels.mode": mode})
    steps = record_steps(llm)
    together = run_in_batches(llm, prompts, params, [list(range(NUM_PROMPTS))])
    shuffled = {}
    for seed in (1, 2):
        shuffled_llm = LLM(
            TINY_CONFIG, **{"kernels.mode": mode, "scheduler.max_num_batched_tokens": 97}
        )
        part = run_in_batches(shuffled_llm, prompts, params, random_sub_batches(NUM_PROMPTS, seed))
        shuffled.update({(seed, i): v for i, v in part.items()})
    return alone, together, shuffled, [len(step) for step in steps]


def test_golden_batch_invariance(workload):
    alone, together, shuffled, sizes = _alone_vs_together("invariant", workload)
    assert max(sizes) >= 32, (
        f"the batched run never packed many sequences into a step: {max(sizes)}"
    )
    assert all(len(alone[i][0]) == MAX_TOKENS for i in alone)
    sampled = [alone[i][0] for i in range(1, NUM_PROMPTS, 2)]
    assert len(set(sampled)) == len(sampled), "seeded samples should differ between requests"
    for i in range(NUM_PROMPTS):
        assert together[i] == alone[i], f"prompt {i}: batched differs from alone"
        for seed in (1, 2):
            assert shuffled[(seed, i)] == alone[i], (
                f"prompt {i}: shuffled sub-batches (seed {seed}) differ"
            )


def test_golden_negative_control_fast_mode(workload):
    alone, together, shuffled, _ = _alone_vs_together("fast", workload)
    differing = [i for i in range(NUM_PROMPTS) if together[i] != alone[i]]
    assert differing, (
        "fast kernels gave identical bits alone and batched: the golden test could not fail"
    )
