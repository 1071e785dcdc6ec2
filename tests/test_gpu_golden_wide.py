"""Golden invariance on the GPU at DeepSeek-V3's 128 heads: the wide attention launch (64 heads a
program, the Gluon kernel on sm_90) through the engine, CUDA graphs on.

The kernel tests (tests/test_gluon_attention.py) prove the wide launch's forms give one
another's bits; this runs them where the engine picks them: a tiny model with V3's attention
shape (128 heads, latent 512, rope 64, cache blocks of 64) and prompts up to 1400 tokens, so a
query has one or two KV splits (two from 19 blocks: tail_blocks). Alone, all 64 together and
shuffled sub-batches give the same bits, as do decoded and re-scored logprobs. Engagement: the
Gluon launches are counted, both forms (the output written directly where the table holds one
split, partials and their merge over two-split tables) among them, with and without the value
split (a decode alone splits its value columns over two programs, the batch of 64 does not).
Negative control: fast mode
(cuBLAS, FlashMLA where installed) differs. Skipped without a Hopper GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import moe_kernels.triton_attention as triton_attention
from moe_kernels.attention_launch import WIDE_LAUNCH
from moe_runtime import LLM
from tests.invariance import mixed_params, mixed_prompts, random_sub_batches, run_in_batches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="needs a Hopper GPU (the Gluon kernel's warpgroup MMAs)",
    ),
]

TINY_GPU = Path(__file__).resolve().parent.parent / "launch" / "configs" / "tiny_gpu.yaml"
NUM_PROMPTS, MAX_TOKENS = 64, 16
# V3's attention shape on the tiny model: the Gluon kernel's (GLUON_SHAPE) and its head count.
WIDE_HEADS = {
    "model.num_attention_heads": 128,
    "model.kv_lora_rank": 512,
    "model.qk_rope_head_dim": 64,
    "model.max_position_embeddings": 2048,
    "cache.block_size": 64,
    "cache.num_blocks": 2048,
    "cache.enable_prefix_caching": False,
    "scheduler.max_model_len": 2048,
}
TWO_SPLITS_FROM = 19 * 64  # tokens: a 16-block split plus the 2 tail blocks hold 18 blocks


@pytest.fixture(scope="module")
def workload():
    prompts = mixed_prompts(NUM_PROMPTS, 8, 1400, seed=29)
    assert sum(len(p) > TWO_SPLITS_FROM for p in prompts) >= 8, "too few two-split prompts"
    return prompts, mixed_params(NUM_PROMPTS, MAX_TOKENS)


@pytest.fixture
def gluon_launches(monkeypatch) -> list[tuple[bool, int, int, tuple[int, int]]]:
    """(written directly, block-table width, value parts, (long_blocks, long_split_blocks))
    of every Gluon launch, eager or captured."""
    launches: list[tuple[bool, int, int, tuple[int, int]]] = []
    launch = triton_attention.launch_wide_split

    def spy(grid, q, kv_cache, seq_ids, block_tables, *args, **kwargs):
        long = (kwargs.get("long_blocks", 0), kwargs.get("long_split_blocks", 0))
        launches.append((bool(args[-1]), block_tables.shape[1], kwargs.get("v_parts", 1), long))
        return launch(grid, q, kv_cache, seq_ids, block_tables, *args, **kwargs)

    monkeypatch.setattr(triton_attention, "launch_wide_split", spy)
    return launches


def _runs(
    mode: str, workload, num_alone: int, is_alone_only: bool = False, **overrides
) -> tuple[dict, dict, dict]:
    """(the first num_alone prompts alone, all together, shuffled sub-batches; the last two
    empty with is_alone_only) under WIDE_HEADS and overrides."""
    prompts, params = workload
    llm = LLM(TINY_GPU, **{"kernels.mode": mode, **WIDE_HEADS, **overrides})
    graphs = llm.engine.executor.worker.runner.graphs
    together, shuffled = {}, {}
    try:
        alone = run_in_batches(llm, prompts, params, [[i] for i in range(num_alone)])
        if not is_alone_only:
            together = run_in_batches(llm, prompts, params, [list(range(NUM_PROMPTS))])
            sub_batches = random_sub_batches(NUM_PROMPTS, seed=7)
            shuffled = run_in_batches(llm, prompts, params, sub_batches)
    finally:
        llm.shutdown()
    # Engagement: the decode steps ran as graph replays (most of each run's steps).
    assert graphs is not None and graphs.num_replays >= num_alone * (MAX_TOKENS - 1) // 2
    return alone, together, shuffled


def test_gpu_golden_128_heads(workload, gluon_launches):
    alone, together, shuffled = _runs("invariant", workload, NUM_PROMPTS)
    forms = {(direct, width > 18) for direct, width, *_ in gluon_launches}
    assert (False, True) in forms, "no launch with partials over a two-split table ran"
    assert (True, False) in forms, "no launch writing the output directly ran"
    # The launch's own long splits, which no query here reaches (its 64 blocks are 4096).
    default = (WIDE_LAUNCH.long_blocks, WIDE_LAUNCH.long_split_blocks)
    assert {long for *_, long in gluon_launches} == {default}
    parts = {v_parts for _, _, v_parts, _ in gluon_launches}
    assert parts == {1, 2}, f"value parts {parts}: both forms must run"
    assert all(len(alone[i][0]) == MAX_TOKENS for i in alone)
    for i in range(NUM_PROMPTS):
        assert together[i] == alone[i], f"prompt {i}: batched differs from alone"
        assert shuffled[i] == alone[i], f"prompt {i}: shuffled differs from alone"


# Long splits at 128 heads: from 12 blocks of 64, splits of 18 blocks with the launch's tail
# of 2, so queries of 12 to 20 blocks are one split and longer ones two (without them, 19 and
# 20 blocks are two splits of 16: those and longer queries move; prompts 2, 7, 8 and 13 of the
# first 16 reach 19 to 22 blocks).
LONG_SPLITS = {"kernels.attention_long_blocks": 12, "kernels.attention_long_split_blocks": 18}


def test_gpu_golden_128_heads_long_splits(workload, gluon_launches):
    """Long splits on at 128 heads (the Gluon kernel's split size read per query): the first
    16 prompts alone are bitwise equal to all prompts batched and shuffled. Engagement: the
    Gluon kernel ran with them, in launches with partials (several splits) and written
    directly; some query passed 22 blocks (two long splits); control: long splits change some
    prompt's bits against the launch without them."""
    prompts, _ = workload
    alone, together, shuffled = _runs("invariant", workload, 16, **LONG_SPLITS)
    assert gluon_launches and all(long == (12, 18) for *_, long in gluon_launches)
    forms = {direct for direct, *_ in gluon_launches}
    assert forms == {False, True}, f"launch forms {forms}: both must run"
    longest = max(len(p) for p in prompts[:16]) + MAX_TOKENS
    assert longest > 20 * 64, "no query of two long splits alone"
    for i in alone:
        assert together[i] == alone[i], f"prompt {i}: batched differs from alone (long splits)"
        assert shuffled[i] == alone[i], f"prompt {i}: shuffled differs from alone (long splits)"
    without, _, _ = _runs("invariant", workload, 16, is_alone_only=True)
    assert any(without[i] != alone[i] for i in alone), "long splits moved no prompt's bits"


def test_gpu_golden_128_heads_negative_control_fast(workload):
    alone, together, shuffled = _runs("fast", workload, 16)
    differing = [i for i in alone if together[i] != alone[i] or shuffled[i] != alone[i]]
    assert differing, "fast mode gave identical bits alone and batched: the test cannot fail"


def _decode_vs_score(mode: str, workload) -> list[tuple[list[float], list[float]]]:
    prompts, params = workload
    prompts, params = prompts[:16], params[:16]
    llm = LLM(TINY_GPU, **{"kernels.mode": mode, **WIDE_HEADS})
    try:
        outputs = llm.generate(prompts, params)
        sequences = [p + o.token_ids for p, o in zip(prompts, outputs, strict=True)]
        scored = llm.score(sequences, [len(p) for p in prompts])
    finally:
        llm.shutdown()
    return [(o.logprobs, s) for o, s in zip(outputs, scored, strict=True)]


def test_gpu_128_heads_decode_logprobs_equal_score(workload):
    for decoded, scored in _decode_vs_score("invariant", workload):
        assert len(decoded) == len(scored) == MAX_TOKENS
        assert [float.hex(x) for x in decoded] == [float.hex(x) for x in scored]


def test_gpu_128_heads_decode_vs_score_negative_control(workload):
    pairs = _decode_vs_score("fast", workload)
    assert any(decoded != scored for decoded, scored in pairs), "fast mode matched too"
