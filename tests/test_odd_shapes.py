"""End-to-end invariance at widths that are not multiples of 16 (issue 12, item 4).

Odd hidden size, odd expert width, a router narrower than a SIMD register, and an odd latent
width in long cache blocks: a needle prompt must give the same bits alone and inside random
batches, at any position. The fast-mode control shows the comparison can fail (the odd latent's
kernel-level control, the same products unpadded, is in tests/test_kernels_shapes.py).
"""

from __future__ import annotations

import random

import pytest

from moe_runtime import LLM, SamplingParams
from tests.invariance import TINY_CONFIG, fingerprint, mixed_prompts

ODD_SHAPES = [
    {"model.hidden_size": 30, "model.n_routed_experts": 8, "model.num_experts_per_tok": 2,
     "model.n_group": 2, "model.topk_group": 1},
    # tp_max 1: the dense down_proj's K of 34 cuts into no power-of-two chunks (config says so)
    {"model.hidden_size": 30, "model.moe_intermediate_size": 7, "model.intermediate_size": 34,
     "model.n_routed_experts": 3, "model.num_experts_per_tok": 2, "model.n_group": 1,
     "model.topk_group": 1, "kernels.tp_max": 1},
    # a latent of 11 + 6 in blocks of 64, one head: unpadded, the attention's per-head products
    # rounded by the query's row in its tile (a decode's top-k logprobs followed the batch)
    {"model.kv_lora_rank": 11, "model.qk_rope_head_dim": 6, "cache.block_size": 64,
     "model.num_attention_heads": 1},
]  # fmt: skip
NUM_BATCHES = 8


def _needle_mismatches(overrides: dict, mode: str) -> int:
    """In how many random batches the needle's fingerprint differs from the needle alone."""
    llm = LLM(TINY_CONFIG, **{"kernels.mode": mode, **overrides})
    needle, *others = mixed_prompts(30, 3, 40, seed=7)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True)
    alone = fingerprint(llm.generate([needle], [params])[0])
    rng = random.Random(1)
    mismatches = 0
    for _ in range(NUM_BATCHES):
        batch = rng.sample(others, rng.randint(1, 12))
        pos = rng.randint(0, len(batch))
        batch.insert(pos, needle)
        outputs = llm.generate(batch, [params] * len(batch))
        mismatches += fingerprint(outputs[pos]) != alone
    return mismatches


@pytest.mark.parametrize("overrides", ODD_SHAPES)
def test_odd_widths_needle_is_bitwise_invariant(overrides):
    assert _needle_mismatches(overrides, "invariant") == 0


@pytest.mark.parametrize("overrides", ODD_SHAPES)
def test_odd_widths_negative_control(overrides):
    assert _needle_mismatches(overrides, "fast") > 0, "fast kernels matched: cannot fail"
