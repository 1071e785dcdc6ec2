"""Golden invariance tests on the GPU: the tiny model in bf16 through the Triton kernels.

- 64 prompts x 32 tokens, top-5 logprobs, greedy and seeded sampling: alone vs batched vs
  shuffled sub-batches, bitwise, at world size 1; negative control with kernels.mode fast.
- EP=8 as 8 Ray actors sharing the one GPU, gloo between them: batched and shuffled runs
  bitwise equal to the world-size-1 run alone (batch and layout invariance together).
- With two GPUs, one Ray actor per GPU over NCCL: EP=2 and TP=2 each equal to world size 1
  (the step wire format across real processes and NCCL; TP through o_proj and the MoE on
  token shares and the dense down's kernels.tp_max fixed K split, tests/test_gpu_tp_linear.py).
- Chunked prefill, prefix-cache hits and decode vs score() bitwise on the GPU.
- The KV cache sized from free GPU memory (cache.num_blocks: 0).
Skipped without CUDA; independent of launch/ (the GPU machine has no HTTP stack).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_runtime import LLM
from tests.invariance import (
    mixed_params,
    mixed_prompts,
    random_sub_batches,
    record_steps,
    run_in_batches,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TINY_GPU = Path(__file__).resolve().parent.parent / "launch" / "configs" / "tiny_gpu.yaml"
NUM_PROMPTS, MAX_TOKENS = 64, 32
NO_PREFIX_CACHE = {"cache.enable_prefix_caching": False}


@pytest.fixture(scope="module")
def workload():
    return mixed_prompts(NUM_PROMPTS, 8, 300, seed=11), mixed_params(NUM_PROMPTS, MAX_TOKENS)


def _alone(mode: str, workload, num: int = NUM_PROMPTS) -> dict:
    prompts, params = workload
    llm = LLM(TINY_GPU, **{"kernels.mode": mode, **NO_PREFIX_CACHE})
    return run_in_batches(llm, prompts, params, [[i] for i in range(num)])


@pytest.fixture(scope="module")
def alone_invariant(workload) -> dict:
    return _alone("invariant", workload)


def _batched(mode: str, workload, **overrides) -> tuple[dict, dict, int]:
    """All prompts in one batch, then shuffled sub-batches; -> (together, shuffled, max rows)."""
    prompts, params = workload
    llm = LLM(TINY_GPU, **{"kernels.mode": mode, **overrides})
    steps = record_steps(llm)
    try:
        together = run_in_batches(llm, prompts, params, [list(range(NUM_PROMPTS))])
        shuffled = run_in_batches(llm, prompts, params, random_sub_batches(NUM_PROMPTS, seed=3))
    finally:
        llm.shutdown()
    return together, shuffled, max(len(step) for step in steps)


def test_gpu_golden_batch_invariance(workload, alone_invariant):
    together, shuffled, max_rows = _batched("invariant", workload, **NO_PREFIX_CACHE)
    assert max_rows >= 32, f"the batched run never packed many sequences into a step: {max_rows}"
    assert all(len(alone_invariant[i][0]) == MAX_TOKENS for i in alone_invariant)
    for i in range(NUM_PROMPTS):
        assert together[i] == alone_invariant[i], f"prompt {i}: batched differs from alone"
        assert shuffled[i] == alone_invariant[i], f"prompt {i}: shuffled differs from alone"


@pytest.fixture(scope="module")
def alone_fast(workload) -> dict:
    return _alone("fast", workload)


def test_gpu_golden_negative_control_fast_mode(workload, alone_fast):
    alone = alone_fast
    together, shuffled, _ = _batched("fast", workload, **NO_PREFIX_CACHE)
    differing = [i for i in alone if together[i] != alone[i] or shuffled[i] != alone[i]]
    assert differing, "fast kernels gave identical bits alone and batched: the test cannot fail"


def _chunked(mode: str, workload, budget: int) -> dict:
    """The first 16 prompts batched, prefilled in chunks of at most `budget` tokens; asserts
    some prompt was prefilled in several chunks (engagement)."""
    prompts, params = workload
    overrides = {"kernels.mode": mode, "scheduler.max_num_batched_tokens": budget}
    llm = LLM(TINY_GPU, **overrides, **NO_PREFIX_CACHE)
    steps = record_steps(llm)
    try:
        got = run_in_batches(llm, prompts, params, [list(range(16))])
    finally:
        llm.shutdown()
    starts = [c.start for step in steps for c in step if c.num_tokens > 1]
    assert any(start > 0 for start in starts), "no prompt was prefilled in several chunks"
    return got


@pytest.mark.parametrize("budget", [7, 33])
def test_gpu_chunked_prefill_bitwise(workload, alone_invariant, budget):
    got = _chunked("invariant", workload, budget)
    assert got == {i: alone_invariant[i] for i in range(16)}


def test_gpu_chunked_prefill_negative_control_fast(workload, alone_fast):
    """The chunked test's comparison in fast mode finds a difference: it can fail."""
    got = _chunked("fast", workload, 7)
    assert any(got[i] != alone_fast[i] for i in range(16)), "fast mode chunked matched alone"


def _prefix_hits(mode: str, workload) -> tuple[dict, dict]:
    """The first 16 prompts batched twice on one engine of the wider model (WIDE: at the tiny
    model's sizes fast mode gave a hit run the bits of a run without hits, so the control could
    not fail there), the second run hitting the prefix cache the first filled (asserted:
    engagement); -> (the first run's outputs, the second's)."""
    prompts, params = workload
    llm = LLM(TINY_GPU, **{"kernels.mode": mode, **WIDE})
    batch = [list(range(16))]
    try:
        first = run_in_batches(llm, prompts, params, batch)  # fills the cache
        hits_before = llm.engine.stats().num_prefix_hit_blocks
        second = run_in_batches(llm, prompts, params, batch)
        hits = llm.engine.stats().num_prefix_hit_blocks - hits_before
    finally:
        llm.shutdown()
    assert hits > 0, "the second run never hit the cache"
    return first, second


def test_gpu_prefix_cache_hit_bitwise(workload):
    """Prompts whose prefill hits the cache give the bits of the same batch computed whole."""
    first, second = _prefix_hits("invariant", workload)
    assert second == first


def test_gpu_prefix_cache_hit_negative_control_fast(workload):
    """The prefix-cache test's comparison in fast mode finds a difference: it can fail."""
    first, second = _prefix_hits("fast", workload)
    assert second != first, "fast mode with hits matched the run without them"


# kernels.attention_group_splits=2: a query's splits (4 cache blocks of 16 tokens) fold in
# groups of 2, the last taking up to one split more, so queries past 192 tokens have two groups.
GROUPS = {"kernels.attention_group_splits": 2, **NO_PREFIX_CACHE}
GROUP_PROMPTS = 24


def test_gpu_golden_attention_groups(workload, alone_invariant, monkeypatch):
    """Groups on: each prompt alone (the split launch, its partials merged in two levels) is
    bitwise equal to the prompts batched and shuffled (a program a query's group, the groups'
    partials merged). Engagement: both launches ran (the split launch and a program a group)
    and some queries span two groups; control: groups on changes some prompt's bits against
    groups off."""
    from moe_kernels import triton_attention

    forms = []
    pick = triton_attention.group_launch

    def spy(launch, *args):
        forms.append(pick(launch, *args))
        return forms[-1]

    monkeypatch.setattr(triton_attention, "group_launch", spy)
    prompts, _ = workload
    moved = _alone_equals_batched(workload, alone_invariant, "groups on", **GROUPS)
    assert None in forms, f"the split launch never ran: {forms}"
    assert any(stages is not None for stages in forms), f"no program a group ran: {forms}"
    assert max(len(p) for p in prompts[:GROUP_PROMPTS]) + MAX_TOKENS > 192, "no query spans two"
    assert moved, "groups on gave every prompt the bits of groups off: the groups never folded"


def _alone_equals_batched(workload, alone_invariant, what: str, **overrides) -> list[int]:
    """The first GROUP_PROMPTS prompts alone under overrides, bitwise equal to all prompts
    batched and shuffled under them; -> the prompts whose bits differ from alone_invariant's
    (the overrides' control)."""
    prompts, params = workload
    llm = LLM(TINY_GPU, **overrides)
    try:
        alone = run_in_batches(llm, prompts, params, [[i] for i in range(GROUP_PROMPTS)])
    finally:
        llm.shutdown()
    together, shuffled, _ = _batched("invariant", workload, **overrides)
    for i in alone:
        assert together[i] == alone[i], f"prompt {i}: batched differs from alone ({what})"
        assert shuffled[i] == alone[i], f"prompt {i}: shuffled differs from alone ({what})"
    return [i for i in alone if alone[i] != alone_invariant[i]]


# kernels.attention_long_blocks=8: a query of 8 cache blocks of 16 tokens or more (128
# tokens) has KV splits of 8 blocks instead of 4 (the default's threshold, 64 blocks, is past
# every prompt here, so alone_invariant has none).
LONG_SPLITS = {"kernels.attention_long_blocks": 8, **NO_PREFIX_CACHE}


def test_gpu_golden_long_splits(workload, alone_invariant):
    """Long splits on: each prompt alone (decode in the split launch) is bitwise equal to the
    prompts batched and shuffled (prefill rows in a program a query). Engagement: some query
    is long enough; control: long splits change some prompt's bits against none."""
    prompts, _ = workload
    moved = _alone_equals_batched(workload, alone_invariant, "long splits", **LONG_SPLITS)
    assert max(len(p) for p in prompts[:GROUP_PROMPTS]) + MAX_TOKENS > 128, "no query is long"
    assert moved, "long splits gave every prompt the bits without them: they never ran"


# Decode vs score runs on a wider model: at the tiny model's K = 64 cuBLAS was seen to pick the
# same kernel for decode- and prefill-sized M, so the fast-mode control could not fail there.
WIDE = {
    "model.hidden_size": 1024,
    "model.intermediate_size": 2816,
    "model.moe_intermediate_size": 512,
    "model.kv_lora_rank": 256,
    "model.num_attention_heads": 8,
}


def _decode_vs_score(mode: str, workload) -> list[tuple[list[float], list[float]]]:
    prompts, params = workload
    prompts, params = prompts[:16], params[:16]
    llm = LLM(TINY_GPU, **{"kernels.mode": mode, **WIDE})
    outputs = llm.generate(prompts, params)
    sequences = [p + o.token_ids for p, o in zip(prompts, outputs, strict=True)]
    scored = llm.score(sequences, [len(p) for p in prompts])
    return [(o.logprobs, s) for o, s in zip(outputs, scored, strict=True)]


def test_gpu_decode_logprobs_equal_score(workload):
    for decoded, scored in _decode_vs_score("invariant", workload):
        assert len(decoded) == len(scored) == MAX_TOKENS
        assert [float.hex(x) for x in decoded] == [float.hex(x) for x in scored]


def test_gpu_decode_vs_score_negative_control(workload):
    pairs = _decode_vs_score("fast", workload)
    assert any(decoded != scored for decoded, scored in pairs), "fast mode matched too"


def test_gpu_kv_cache_sized_from_free_memory():
    llm = LLM(TINY_GPU, **{"cache.num_blocks": 0, "cache.gpu_memory_utilization": 0.05})
    assert llm.config.cache.num_blocks == 0  # the found count is returned, never written back
    free_bytes, _ = torch.cuda.mem_get_info()
    model = llm.config.model
    block_bytes = model.num_hidden_layers * llm.config.cache.block_size * model.latent_dim * 2
    assert 1000 < llm.engine.num_kv_blocks <= int(0.06 * free_bytes) // block_bytes + 1
    out = llm.generate([[1, 2, 3]], mixed_params(1, 4)[0])[0]
    assert len(out.token_ids) == 4


# The chunked scoring's chunk: in fast mode chunks of 1024 gave the whole scoring's bits on an
# H100 (every fast kernel row-independent between M = 1024 and M ~ 16k), so the control
# could not fail there; at 128 rows cuBLAS's choices for V2-Lite's long-K products differ.
FULL_BUDGET_CHUNK = 128


def _full_budget_scores(mode: str) -> tuple[list[float], list[float], int]:
    """(V2-Lite's logprobs of one sequence of max_num_batched_tokens - 192 tokens scored in one
    step with cache.num_blocks 0, the same scored in chunks of FULL_BUDGET_CHUNK tokens, its
    length), in kernels.mode `mode`. Engagement: the engines' step counts say the first
    scoring ran in one step and the second in one a chunk."""
    v2_lite = TINY_GPU.parent / "v2_lite_gpu.yaml"
    llm = LLM(v2_lite, **{"cache.num_blocks": 0, "kernels.mode": mode})
    budget = llm.config.scheduler.max_num_batched_tokens
    sequence = [(i * 7919) % 100000 + 1 for i in range(budget - 192)]
    try:
        whole = llm.score([sequence], [1], use_tqdm=False)[0]
        whole_steps = llm.engine.num_steps
    finally:
        llm.shutdown()
    chunk = {"scheduler.max_num_batched_tokens": FULL_BUDGET_CHUNK, "kernels.mode": mode}
    llm = LLM(v2_lite, **chunk)
    try:
        chunked = llm.score([sequence], [1], use_tqdm=False)[0]
        chunked_steps = llm.engine.num_steps
    finally:
        llm.shutdown()
    assert whole_steps == 1, f"the whole scoring took {whole_steps} steps"
    chunks = -(-len(sequence) // FULL_BUDGET_CHUNK)
    assert chunked_steps >= chunks, f"{chunked_steps} steps for {chunks} chunks"
    return whole, chunked, len(sequence)


def test_gpu_a_full_budget_scoring_fits_a_cache_sized_from_free_memory():
    """V2-Lite's 27 layers, cache.num_blocks 0: a score of max_num_batched_tokens - 192
    tokens (one step, every row scored) ran out of memory on an H100, its fp32 logits held
    three times over (10 GB) in the 10% a fraction of 0.9 left. Now it runs, its logprobs the
    bits of the same sequence scored in chunks of FULL_BUDGET_CHUNK tokens (scheduler budget)."""
    whole, chunked, length = _full_budget_scores("invariant")
    assert len(whole) == length - 1
    assert [float.hex(x) for x in whole] == [float.hex(x) for x in chunked]


def test_gpu_full_budget_scoring_negative_control_fast():
    """The same two scorings in fast mode: the chunking must show in the bits, or the test
    above could not fail."""
    whole, chunked, length = _full_budget_scores("fast")
    assert len(whole) == len(chunked) == length - 1
    assert [float.hex(x) for x in whole] != [float.hex(x) for x in chunked], (
        "fast mode scored the whole sequence and its chunks to the same bits"
    )


@pytest.fixture(scope="module")
def ray_on_gpu():
    ray = pytest.importorskip("ray")
    num_gpus = torch.cuda.device_count()
    ray.init(
        address="local", num_cpus=8, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False
    )
    yield
    ray.shutdown()


def _layout_run(workload, **overrides) -> tuple[dict, dict, dict, list[dict]]:
    """(the first 8 prompts alone, all together, shuffled sub-batches, worker stats)."""
    prompts, params = workload
    llm = LLM(TINY_GPU, **{"parallel.timeout_s": 120, **NO_PREFIX_CACHE, **overrides})
    try:
        alone = run_in_batches(llm, prompts, params, [[i] for i in range(8)])
        together = run_in_batches(llm, prompts, params, [list(range(NUM_PROMPTS))])
        shuffled = run_in_batches(llm, prompts, params, random_sub_batches(NUM_PROMPTS, seed=5))
        stats = llm.engine.worker_stats()
    finally:
        llm.shutdown()
    return alone, together, shuffled, stats


def _ep8(mode: str, workload) -> tuple[dict, dict, dict, list[dict]]:
    return _layout_run(
        workload, **{"kernels.mode": mode, "parallel.world_size": 8, "parallel.backend": "gloo"}
    )


def test_gpu_ep8_ray_gloo_golden(ray_on_gpu, workload, alone_invariant):
    alone, together, shuffled, stats = _ep8("invariant", workload)
    assert all(s["num_rows_sent_remote"] > 0 for s in stats), "some rank never sent rows away"
    for i in range(8):
        assert alone[i] == alone_invariant[i], f"prompt {i}: EP=8 alone differs from EP=1 alone"
    for i in range(NUM_PROMPTS):
        assert together[i] == alone_invariant[i], f"prompt {i}: EP=8 batched differs"
        assert shuffled[i] == alone_invariant[i], f"prompt {i}: EP=8 shuffled differs"


def test_gpu_ep8_negative_control_fast(ray_on_gpu, workload):
    alone, together, shuffled, _ = _ep8("fast", workload)
    assert any(together[i] != alone[i] or shuffled[i] != alone[i] for i in range(8)), (
        "fast kernels gave identical bits at EP=8: the golden test could not fail"
    )


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("tp_size", [1, 2], ids=["ep2", "tp2"])
def test_gpu_two_ranks_nccl(ray_on_gpu, workload, alone_invariant, tp_size):
    overrides = {"parallel.world_size": 2, "parallel.tp_size": tp_size, "parallel.backend": "nccl"}
    alone, together, shuffled, stats = _layout_run(workload, **overrides)
    if tp_size == 1:
        assert all(s["num_rows_sent_remote"] > 0 for s in stats), "no rows crossed the GPUs"
        reference = alone_invariant  # EP=2 over NCCL is bitwise the world-size-1 run
    else:
        assert [(s["tp_size"], s["tp_rank"]) for s in stats] == [(2, 0), (2, 1)]
        assert all(s["num_tp_all_reduces"] > 0 for s in stats), "no TP reduction ran"
        assert all(s["num_tp_fp32_gathers"] > 0 for s in stats), "no fp32 subtree sums gathered"
        assert all(s["num_tp_head_exchanges"] > 0 for s in stats), "o_proj ran on no share"
        # The dense down's tp_max split, o_proj and the MoE on token shares: TP=2 is bitwise
        # the TP=1 run.
        reference = alone_invariant
    for i in range(8):
        assert alone[i] == reference[i], f"prompt {i}: alone differs"
    for i in range(NUM_PROMPTS):
        assert together[i] == reference.get(i, together[i]) == shuffled[i], f"prompt {i} differs"
