"""Bitwise invariance of chunked prefill, prefix caching, preemption and decode vs score().

Each run is compared with two references of its own kernel mode, both with prefix caching off
and a budget that fits every prompt in one step: each prompt alone, and all prompts in the one
batch the run under test takes. Invariant kernels must equal both; fast kernels, the control,
must differ from the batch that took the same prompts together, so the difference is the path
under test's (chunks, cache hits, preemption) and not the batch's. Each run also has an
engagement check that the path ran.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from moe_runtime import LLM, SamplingParams
from moe_runtime.engine.block_manager import BlockManager
from moe_runtime.model import deepseek
from moe_runtime.seeds import sample_seeds
from moe_runtime.worker import model_runner
from tests.invariance import (
    TINY_CONFIG,
    fingerprint,
    mixed_params,
    mixed_prompts,
    record_steps,
    run_in_batches,
)

NUM = 12
BUDGETS = [7, 16, 33, 100]
MODES = ["invariant", "fast"]  # fast: the negative control of each comparison


@pytest.fixture(scope="module")
def workload():
    return mixed_prompts(NUM, 20, 200, seed=5), mixed_params(NUM, 12)


WHOLE_BUDGET = 4096  # every prompt of the workload in one step (12 x <= 200 tokens)


def _plain_run(workload, mode: str, together: bool) -> dict[int, tuple]:
    """Prefix caching off, every prompt whole in one step: each prompt alone, or all together
    in one batch (asserted to have run unchunked)."""
    prompts, params = workload
    overrides = {
        "kernels.mode": mode,
        "cache.enable_prefix_caching": False,
        "scheduler.max_num_batched_tokens": WHOLE_BUDGET,
    }
    llm = LLM(TINY_CONFIG, **overrides)
    steps = record_steps(llm)
    batches = [list(range(NUM))] if together else [[i] for i in range(NUM)]
    got = run_in_batches(llm, prompts, params, batches)
    assert not any(c.start > 0 and c.num_tokens > 1 for step in steps for c in step)
    return got


@pytest.fixture(scope="module")
def reference(workload):
    """(kernel mode, together) -> that plain run, computed on first use, kept for the module."""
    runs: dict[tuple[str, bool], dict[int, tuple]] = {}

    def of(mode: str, together: bool) -> dict[int, tuple]:
        if (mode, together) not in runs:
            runs[mode, together] = _plain_run(workload, mode, together)
        return runs[mode, together]

    return of


def _check(mode: str, got, reference, what: str) -> None:
    """Invariant kernels: bitwise equal to the prompts alone and to the same batch whole. Fast
    kernels, the control: they must differ from the same batch whole, or the comparison could
    not fail."""
    if mode == "invariant":
        assert got == reference(mode, together=False)
        assert got == reference(mode, together=True)
    else:
        assert got != reference(mode, together=True), (
            f"fast kernels gave the same bits {what}: the test could not fail"
        )


def _check_pair(mode: str, got, expected, what: str) -> None:
    """_check against one reference that took the same prompts in the same batch."""
    if mode == "invariant":
        assert got == expected
    else:
        assert got != expected, f"fast kernels gave the same bits {what}: the test could not fail"


def _chunked_run(workload, mode: str, budget: int) -> dict[int, tuple]:
    """All prompts together under a token budget; asserts some prompt took several chunks."""
    prompts, params = workload
    llm = LLM(
        TINY_CONFIG,
        **{
            "kernels.mode": mode,
            "scheduler.max_num_batched_tokens": budget,
            "cache.enable_prefix_caching": False,
        },
    )
    steps = record_steps(llm)
    got = run_in_batches(llm, prompts, params, [list(range(NUM))])
    chunks = [(c.start, c.num_tokens) for step in steps for c in step]
    assert any(start > 0 and n > 1 for start, n in chunks), (
        "no prompt was prefilled in several chunks"
    )
    return got


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget", BUDGETS)
def test_chunked_prefill_is_bitwise_invariant(workload, reference, budget, mode):
    got = _chunked_run(workload, mode, budget)
    _check(mode, got, reference, f"chunked at budget {budget}")


def _cache_hit_run(workload, mode: str) -> dict[int, tuple]:
    """All prompts together, twice, with the whole-batch budget of the references; -> the
    second run's fingerprints. Asserts that every prompt of it hit cached blocks."""
    prompts, params = workload
    overrides = {"kernels.mode": mode, "scheduler.max_num_batched_tokens": WHOLE_BUDGET}
    llm = LLM(TINY_CONFIG, **overrides)
    run_in_batches(llm, prompts, params, [list(range(NUM))])  # fills the cache
    hits_before = llm.engine.stats().num_prefix_hit_blocks
    got = run_in_batches(llm, prompts, params, [list(range(NUM))])
    # Every prompt has >= 20 tokens: at least one full block of 16 cached by the first run.
    num_hits = llm.engine.stats().num_prefix_hit_blocks - hits_before
    assert num_hits >= NUM, f"the second run hit {num_hits} cached blocks for {NUM} prompts"
    return got


@pytest.mark.parametrize("mode", MODES)
def test_prefix_cache_hit_is_bitwise_equal_to_miss(workload, reference, mode):
    _check(mode, _cache_hit_run(workload, mode), reference, "from the prefix cache")


def _shared_prefix_run(workload, mode: str) -> tuple[list[tuple], list[tuple]]:
    """Four prompts sharing 100 tokens with a warm-up prompt; -> (cold, warm) fingerprints.
    Asserts the warm run served the shared blocks from the cache."""
    prompts, params = workload
    base = prompts[0]
    variants = [base[:100] + p[:30] for p in prompts[1:5]]
    # One budget for all 4 variants (520 tokens): with the default 512 the cold run chunked
    # one, so in fast mode the control differed for that reason alone.
    whole = {"kernels.mode": mode, "scheduler.max_num_batched_tokens": WHOLE_BUDGET}
    cold = LLM(TINY_CONFIG, **whole, **{"cache.enable_prefix_caching": False})
    warm = LLM(TINY_CONFIG, **whole)
    warm.generate([base[:120]], params[0])
    cold_steps, warm_steps = record_steps(cold), record_steps(warm)
    expected = [fingerprint(o) for o in cold.generate(variants, params[1:5])]
    got = [fingerprint(o) for o in warm.generate(variants, params[1:5])]
    assert not any(c.start > 0 and c.num_tokens > 1 for step in cold_steps for c in step)
    # the warm variants start past their cached blocks, in one piece each
    assert all(c.num_tokens == 130 - c.start for c in warm_steps[0])
    # 100 shared tokens = 6 full blocks of 16 per variant, served from the warm-up's cache.
    assert warm.engine.stats().num_prefix_hit_blocks >= 6 * len(variants), (
        "the variants missed the cache"
    )
    return expected, got


@pytest.mark.parametrize("mode", MODES)
def test_shared_prefix_across_requests(workload, mode):
    expected, got = _shared_prefix_run(workload, mode)
    _check_pair(mode, got, expected, "from a shared prefix")


def _preempted_run(workload, mode: str) -> dict[int, tuple]:
    """All prompts together in a cache that holds their prompts but not their outputs;
    asserts they ran as the references' one batch, then a preemption happened."""
    prompts, params = workload
    # The references' batch: every prompt whole in the first step (their 69 blocks fit; the
    # output tokens do not). With a cache that admitted only some, or the default budget of
    # 512, the fast control differed for those reasons alone.
    # No admission reserve: every prompt admitted into the last free blocks, as the batch
    # of the references, so the outputs' blocks must come from a preemption.
    small = {"cache.num_blocks": 70, "scheduler.max_model_len": 512}
    small["scheduler.admission_reserve"] = 0
    overrides = {"kernels.mode": mode, "scheduler.max_num_batched_tokens": WHOLE_BUDGET}
    llm = LLM(TINY_CONFIG, **small, **overrides)
    steps = record_steps(llm)
    got = run_in_batches(llm, prompts, params, [list(range(NUM))])
    assert sum(c.num_tokens for c in steps[0]) == sum(map(len, prompts))
    assert llm.engine.stats().num_preemptions > 0, "the small cache never forced a preemption"
    return got


@pytest.mark.parametrize("mode", MODES)
def test_preemption_loses_nothing_and_changes_no_bit(workload, reference, mode):
    _check(mode, _preempted_run(workload, mode), reference, "across preemption")


@pytest.mark.parametrize("mode", MODES)
def test_waiting_sequences_hold_no_blocks_so_a_tiny_cache_never_stalls(mode):
    """16 prompts in a cache of 12 blocks (a sequence of max_model_len needs 8): preempted
    sequences come back to hits on their own cached blocks. A waiting sequence used to keep the
    blocks it matched when it could not be admitted; a later preemption put another sequence in
    front of it, which could then never get its blocks, nothing ran, and generate never
    returned (stuck after 4 preemptions, 3 of 16 requests finished). Every request must finish,
    with the bits of a cache that fits them all (fast kernels, the control: other bits)."""
    prompts = mixed_prompts(16, 10, 90, seed=21)
    params = [SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True)] * 16
    small = {"cache.num_blocks": 12, "scheduler.max_model_len": 128, "kernels.mode": mode}
    llm = LLM(TINY_CONFIG, **small)
    requests = llm.engine.add_requests(prompts, params)
    for _ in range(2000):  # 174 steps when nothing stalls
        if not llm.engine.has_unfinished():
            break
        llm.engine.step()
    stats = llm.engine.stats()
    assert not llm.engine.has_unfinished(), f"stalled: {stats}"
    assert stats.num_preemptions > 0 and stats.num_prefix_hit_blocks > 0  # the path ran
    got = [fingerprint(llm.engine.output(r)) for r in requests]
    fits = LLM(TINY_CONFIG, **{"kernels.mode": mode})
    fits_got = [fingerprint(o) for o in fits.generate(prompts, params)]
    _check_pair(mode, got, fits_got, "in a tiny cache")


def test_a_request_waiting_for_blocks_matches_its_cached_prefix_once(monkeypatch):
    """Two long samples fill the cache; a third request, whose 6-block prefix is cached, waits
    ~50 steps for blocks. It keeps its match while it heads the queue (giving it back every
    step walked the prefix again each step: 53 matches for 3)."""
    calls = []
    match_prefix = BlockManager.match_prefix
    monkeypatch.setattr(
        BlockManager, "match_prefix", lambda self, ids: calls.append(1) or match_prefix(self, ids)
    )
    llm = LLM(TINY_CONFIG, **{"cache.num_blocks": 34, "scheduler.max_model_len": 512})
    prefix = list(range(1, 97))
    long = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    engine.add_requests([[*prefix, 200, 201], [*prefix, 202, 203]], [long, long])
    for _ in range(100):
        engine.step()
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    waiting = engine.add_request([*prefix, *range(300, 500)], short)
    num_steps = 0
    while engine.has_unfinished():
        engine.step()
        num_steps += 1
    assert num_steps > 40 and engine.output(waiting).outputs[0].finish_reason == "length"
    assert len(calls) == 3 and engine.stats().num_preemptions == 0


def _decode_vs_score(mode: str, workload) -> list[tuple]:
    """-> per prompt (decode's fingerprint, score_outputs' with the same top-k, score's
    logprobs, and the routed experts: decode's, score_outputs', and those of the whole
    sequence scored from its first token). Decode reports the raw distribution
    (logprobs_mode "raw"), sampled or greedy: what scoring reports."""
    prompts, params = workload
    params = [dataclasses.replace(p, return_routed_experts=True) for p in params]
    llm = LLM(TINY_CONFIG, **{"kernels.mode": mode})
    outputs = llm.generate(prompts, params)
    sequences = [p + o.token_ids for p, o in zip(prompts, outputs, strict=True)]
    prompt_lens = [len(p) for p in prompts]
    scored = llm.score(sequences, prompt_lens)
    num_top = params[0].logprobs
    with_top = llm.score_outputs(
        sequences, prompt_lens, logprobs=num_top, return_routed_experts=True
    )
    whole = llm.score_outputs(sequences, [1] * NUM, return_routed_experts=True)
    llm.shutdown()
    assert all(len(o.top_logprobs) == len(o.token_ids) == 12 for o in with_top)
    return [
        (fingerprint(o), fingerprint(t), s, (o.routed_experts, t.routed_experts, w.routed_experts))
        for o, t, s, w in zip(outputs, with_top, scored, whole, strict=True)
    ]


def test_decode_logprobs_equal_score(workload):
    """score's logprobs, and score_outputs' logprobs, top logprobs and routed experts, are
    decode's bits; a whole sequence scored from its first token routes its generated part as
    decode did (its prompt part: every position but the last, for a trainer to replay)."""
    prompts, _ = workload
    shifted = 0
    for prompt, (decoded, scored_top, scored, routed) in zip(
        prompts, _decode_vs_score("invariant", workload), strict=True
    ):
        assert decoded[1] == tuple(float.hex(x) for x in scored)
        assert decoded == scored_top
        decode_routed, score_routed, whole_routed = (np.asarray(r) for r in routed)
        assert decode_routed.shape == (12, *whole_routed.shape[1:]) and decode_routed.size
        assert whole_routed.shape[0] == len(prompt) + 12 - 1
        assert np.array_equal(score_routed, decode_routed)
        assert np.array_equal(whole_routed[len(prompt) - 1 :], decode_routed)
        # alignment: one position off differs (top-k ids of this fp32 model do not flip under
        # fast mode's rounding, so the control of these comparisons is the logprobs' below)
        shifted += not np.array_equal(whole_routed[len(prompt) - 2 : -1], decode_routed)
    assert shifted == NUM


def test_decode_vs_score_negative_control(workload):
    runs = _decode_vs_score("fast", workload)
    assert any(d[1] != tuple(float.hex(x) for x in s) for d, _, s, _ in runs), (
        "fast mode matched too: control cannot fail"
    )
    assert any(d[2] != t[2] for d, t, _, _ in runs), "fast mode's top logprobs matched too"


def test_n_samples_use_distinct_derived_seeds():
    llm = LLM(TINY_CONFIG)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=3, n=4, logprobs=2)
    first = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], params)[0]
    again = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], params)[0]
    samples = [tuple(o.token_ids) for o in first.outputs]
    assert len(samples) == 4 and len(set(samples)) == 4
    assert [fingerprint(o) for o in first.outputs] == [fingerprint(o) for o in again.outputs]
    # Each sample is the request run alone with its derived seed (sample_seeds), so one
    # sample of a group can be replayed by itself.
    for seed, sample in zip(sample_seeds(3, 4), first.outputs, strict=True):
        alone = dataclasses.replace(params, n=1, seed=seed)
        (replayed,) = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], alone)[0].outputs
        assert fingerprint(replayed) == fingerprint(sample)


@pytest.mark.parametrize("mode", MODES)
def test_scores_in_row_blocks_beside_sampled_rows_keep_their_bits(workload, monkeypatch, mode):
    """The runner's _score takes _SCORE_ROWS scored rows at a time and the LM head LOGIT_ROWS
    (a step of 8k scored rows held their fp32 logits three times over at once, 10 GB at
    V2-Lite's vocabulary: out of memory on an H100 with the cache sized from free memory). In
    blocks of 5 and 7 rows, cut inside and across sequences, with sampled rows in the same
    steps (scored rows then not consecutive: copied, not viewed), the logprobs and top
    logprobs are the bits of the sequences scored alone. Control: fast kernels differ from
    the same scorings alone under fast kernels (a reference in the other mode differed by
    its kernels alone, so that control could not fail)."""
    prompts, params = workload
    sequences = [p[:40] for p in prompts[:6]]
    prompt_lens = [len(s) // 2 for s in sequences]
    alone_llm = LLM(TINY_CONFIG, **{"kernels.mode": mode})
    alone = [
        fingerprint(alone_llm.score_outputs([s], [n], logprobs=3)[0])
        for s, n in zip(sequences, prompt_lens, strict=True)
    ]
    alone_llm.shutdown()
    blocks: list[list[int]] = []
    score_block = model_runner.ModelRunner._score_block

    def spy(self, logits, score_rows, row_owners, out):
        blocks.append(list(score_rows))
        return score_block(self, logits, score_rows, row_owners, out)

    monkeypatch.setattr(model_runner, "_SCORE_ROWS", 5)
    monkeypatch.setattr(deepseek, "LOGIT_ROWS", 7)
    monkeypatch.setattr(model_runner.ModelRunner, "_score_block", spy)
    llm = LLM(TINY_CONFIG, **{"kernels.mode": mode, "scheduler.max_num_batched_tokens": 64})
    engine = llm.engine
    head, head_rows = engine.executor.worker.runner.model.lm_head, []
    head_forward = head.forward
    head.forward = lambda x: head_rows.append(x.shape[0]) or head_forward(x)
    try:
        scored = []
        for i, (sequence, prompt_len) in enumerate(zip(sequences, prompt_lens, strict=True)):
            scored += engine.add_score_requests([sequence], [prompt_len], 3)
            # a decoding sequence's row between two scorings' rows in their steps
            engine.add_requests([prompts[6 + i][:8]], [params[6 + i]])
        while engine.has_unfinished():
            engine.step()
        got = [fingerprint(engine.output(r).outputs[0]) for r in scored]
    finally:
        llm.shutdown()
    assert any(len(b) == 5 for b in blocks) and len(blocks) > engine.num_steps  # blocks cut
    assert 7 in head_rows and max(head_rows) <= 7, head_rows
    assert any(b[-1] - b[0] + 1 != len(b) for b in blocks), "no block beside sampled rows"
    if mode == "invariant":
        assert got == alone
    else:
        assert got != alone, "fast mode matched the scorings alone: no control"


def test_a_tp_lm_head_gathers_its_vocabulary_slices_a_block_at_a_time(monkeypatch):
    """At TP > 1 the LM head ran on LOGIT_ROWS rows at a time, but the whole [R, V / tp]
    slice was then all-gathered at once: the ranks' parts (R x V fp32) and their
    concatenation (R x V again) beside the slice, 2 + 1 / tp times the fp32 logits that a
    cache sized from free memory leaves room for (worker.kv_cache_blocks): a step of 8k
    scored rows at V2-Lite's vocabulary still held 7.8 GiB at TP 2. Now each block's slice
    is gathered and copied into the one fp32 tensor; the logits keep their bits (two ranks
    simulated: each gather returns the rank's slice twice)."""
    from moe_runtime.model import tensor_parallel

    gathered: list[int] = []

    def two_ranks(x, group=None):
        gathered.append(x.shape[0])
        return [x, x]

    monkeypatch.setattr(tensor_parallel, "all_gather", two_ranks)
    llm = LLM(TINY_CONFIG, **{"kernels.mode": "invariant"})
    try:
        model = llm.engine.executor.worker.runner.model
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(20, model.config.hidden_size, generator=generator).to(model.dtype)
        model.tp = tensor_parallel.TensorParallel(size=2)
        with torch.inference_mode():
            whole = model.logits(hidden)  # 20 rows: one block
            gathered.clear()
            monkeypatch.setattr(deepseek, "LOGIT_ROWS", 7)
            blocked = model.logits(hidden)
    finally:
        llm.shutdown()
    assert whole.dtype == blocked.dtype == torch.float32
    assert whole.shape == (20, 2 * model.lm_head.weight.shape[0])
    assert gathered == [7, 7, 6], gathered
    assert torch.equal(blocked, whole)
