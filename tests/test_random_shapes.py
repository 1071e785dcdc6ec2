"""Invariance on model shapes drawn at random: a needle request gives the same bits alone and
inside random batches, its prompt cut into chunks by a small step budget and found in the
prefix cache, and its scoring the same bits whole and chunked.

The draws (seeded, the same every run) mix what the fixed configs test one at a time: odd
widths, no q LoRA, no or two shared experts, no dense layer, softmax or sigmoid routing with
groups, cache blocks of 5 to 64, BLAS on one or two threads, tiles of 1 to 64 rows. Fast mode
with the same draw is the control; engagement: the needle's prefill was chunked and its
blocks were hit in the cache.
"""

from __future__ import annotations

import random

import pytest

from moe_runtime import LLM, SamplingParams
from tests.invariance import TINY_CONFIG, fingerprint, mixed_prompts

DRAW_SEEDS = tuple(range(12))
NUM_BATCHES = 4


def draw_shape(seed: int) -> dict:
    """A valid model, cache and kernel shape (config overrides of the tiny CPU config)."""
    rng = random.Random(seed)
    experts = rng.choice([4, 6, 8, 9])
    shape = {
        "model.hidden_size": rng.choice([24, 30, 33, 48]),
        "model.num_attention_heads": rng.choice([1, 2, 3, 5]),
        "model.q_lora_rank": rng.choice([None, 12, 32]),
        "model.kv_lora_rank": rng.choice([9, 16, 21]),
        "model.qk_nope_head_dim": rng.choice([5, 8, 16]),
        "model.qk_rope_head_dim": rng.choice([2, 4, 6]),
        "model.v_head_dim": rng.choice([3, 7, 16]),
        "model.moe_intermediate_size": rng.choice([5, 16, 24]),
        "model.n_routed_experts": experts,
        "model.n_shared_experts": rng.choice([0, 1, 2]),
        "model.first_k_dense_replace": rng.choice([0, 1]),
        "model.intermediate_size": rng.choice([20, 34, 64]),
        "cache.block_size": rng.choice([5, 16, 64]),
        "kernels.tp_max": 1,  # a dense K of 34 or 20 cuts into no power-of-two chunks
        "kernels.num_threads": rng.choice([1, 2]),
    }
    if rng.random() < 0.5:
        groups = rng.choice([d for d in range(1, experts // 2 + 1) if experts % d == 0])
        topk_group = rng.randint(1, groups)
        routing = {
            "model.scoring_func": "sigmoid",
            "model.topk_method": "noaux_tc",
            "model.n_group": groups,
            "model.topk_group": topk_group,
            "model.num_experts_per_tok": rng.randint(1, min(3, topk_group * experts // groups)),
        }
    else:
        routing = {
            "model.scoring_func": "softmax",
            "model.topk_method": "greedy",
            "model.n_group": 1,
            "model.topk_group": 1,
            "model.num_experts_per_tok": rng.randint(1, 3),
        }
    # BLAS splits a tile's rows between threads: powers of two only with two (config says why)
    tiles = [1, 8, 16, 64] if shape["kernels.num_threads"] > 1 else [1, 8, 12, 16, 64]
    return {**shape, **routing, "kernels.tile_rows": rng.choice(tiles)}


def _needle_runs(seed: int, mode: str) -> tuple[int, bool, int, int]:
    """(batches where the needle's generation differs from it alone, whether its chunked
    scoring differs from its whole one, the needle's prompt length over the chunking budget,
    prefix-cache blocks hit) for draw `seed` in kernels.mode `mode`."""
    shape = {**draw_shape(seed), "kernels.mode": mode}
    rng = random.Random(seed)
    block = shape["cache.block_size"]
    needle = mixed_prompts(1, 2 * block + 1, 2 * block + 20, seed=seed)[0]
    others = mixed_prompts(20, 3, 40, seed=seed + 100)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True)
    whole = LLM(TINY_CONFIG, **shape)
    try:
        alone = fingerprint(whole.generate([needle], [params], use_tqdm=False)[0])
        scored = whole.score([needle], [1], use_tqdm=False)[0]
    finally:
        whole.shutdown()
    budget = rng.choice([b for b in (7, 16, 33) if b < len(needle)])  # the prompt is chunked
    chunked = {"scheduler.max_num_batched_tokens": budget, "scheduler.max_num_seqs": 8}
    llm = LLM(TINY_CONFIG, **shape, **chunked)
    try:
        mismatches = 0
        for _ in range(NUM_BATCHES):  # from the second on, the needle's blocks are cached
            batch = rng.sample(others, rng.randint(1, 7))
            pos = rng.randint(0, len(batch))
            batch.insert(pos, needle)
            outputs = llm.generate(batch, [params] * len(batch), use_tqdm=False)
            mismatches += fingerprint(outputs[pos]) != alone
        rescored = llm.score([needle], [1], use_tqdm=False)[0]
        hits = llm.engine.stats().num_prefix_hit_blocks
    finally:
        llm.shutdown()
    differs = [float.hex(x) for x in rescored] != [float.hex(x) for x in scored]
    return mismatches, differs, len(needle) // budget, hits


@pytest.mark.parametrize("seed", DRAW_SEEDS)
def test_random_shape_needle_is_bitwise_invariant(seed):
    mismatches, score_differs, chunks, hits = _needle_runs(seed, "invariant")
    assert chunks >= 1 and hits > 0, f"engagement: {chunks} budgets a prompt, {hits} blocks hit"
    assert mismatches == 0, f"draw {seed}: {draw_shape(seed)}"
    assert not score_differs, f"draw {seed}: the chunked scoring differs: {draw_shape(seed)}"


@pytest.mark.parametrize("seed", DRAW_SEEDS)
def test_random_shape_negative_control_fast(seed):
    mismatches, score_differs, _, _ = _needle_runs(seed, "fast")
    assert mismatches > 0 or score_differs, "fast kernels matched: the comparison cannot fail"
