"""Expert parallelism on a local Ray cluster of single-CPU actors, gloo between them.

- EP=8 golden test: 64 prompts alone vs together vs shuffled sub-batches spread over the DP
  ranks, bitwise; engagement: rows crossed ranks and several DP ranks held requests; negative
  control: fast kernels find a difference.
- Layout invariance: EP = 1, 2, 4, 8, with and without redundant experts, bitwise equal;
  engagement: redundant replicas served rows; negative control: multiple reduction (with
  invariant kernels) at EP=4 finds a difference from EP=1.
- A worker killed mid-generation fails its requests with an error naming the rank, in time.
"""

from __future__ import annotations

import time

import pytest

from moe_runtime import LLM, SamplingParams
from moe_runtime.executor import WorkerError
from tests.invariance import (
    TINY_CONFIG,
    fingerprint,
    mixed_params,
    mixed_prompts,
    random_sub_batches,
    replica_rows,
    run_in_batches,
)

ray = pytest.importorskip("ray")
NUM_PROMPTS, MAX_TOKENS = 64, 32


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_local):
    yield


def _ep_llm(world_size: int, **overrides) -> LLM:
    return LLM(
        TINY_CONFIG, **{"parallel.world_size": world_size, "parallel.timeout_s": 60, **overrides}
    )


@pytest.fixture(scope="module")
def golden_workload():
    return mixed_prompts(NUM_PROMPTS, 8, 300, seed=21), mixed_params(NUM_PROMPTS, MAX_TOKENS)


def _alone_together_shuffled(llm: LLM, prompts, params, num: int) -> tuple[dict, dict, dict]:
    alone = run_in_batches(llm, prompts, params, [[i] for i in range(num)])
    together = run_in_batches(llm, prompts, params, [list(range(num))])
    shuffled = run_in_batches(llm, prompts, params, random_sub_batches(num, seed=4, max_size=12))
    return alone, together, shuffled


def test_ep8_golden_batch_invariance(golden_workload):
    prompts, params = golden_workload
    llm = _ep_llm(8, **{"cache.enable_prefix_caching": False})
    try:
        dp_ranks_used = set()
        add_requests = llm.engine.add_requests

        def spy(*args, **kwargs):
            requests = add_requests(*args, **kwargs)
            dp_ranks_used.update(s.dp_rank for r in requests for s in r.samples)
            return requests

        llm.engine.add_requests = spy
        alone, together, shuffled = _alone_together_shuffled(llm, prompts, params, NUM_PROMPTS)
        stats = llm.engine.worker_stats()
    finally:
        llm.shutdown()
    assert len(dp_ranks_used) == 8, f"requests reached only DP ranks {sorted(dp_ranks_used)}"
    assert all(s["num_rows_sent_remote"] > 0 for s in stats), "some rank never sent rows away"
    assert all(len(alone[i][0]) == MAX_TOKENS for i in range(NUM_PROMPTS))
    for i in range(NUM_PROMPTS):
        assert together[i] == alone[i], f"prompt {i}: together differs from alone at EP=8"
        assert shuffled[i] == alone[i], f"prompt {i}: shuffled sub-batches differ at EP=8"


def test_ep8_negative_control_fast_kernels(golden_workload):
    prompts, params = golden_workload
    llm = _ep_llm(8, **{"kernels.mode": "fast", "cache.enable_prefix_caching": False})
    try:
        alone, together, shuffled = _alone_together_shuffled(llm, prompts, params, 16)
    finally:
        llm.shutdown()
    assert any(together[i] != alone[i] or shuffled[i] != alone[i] for i in range(16)), (
        "fast kernels gave identical bits at EP=8: the golden test could not fail"
    )


@pytest.fixture(scope="module")
def layout_workload():
    """16 prompts run together; -> prompts, params, and their fingerprints at EP=1."""
    prompts, params = mixed_prompts(16, 8, 120, seed=8), mixed_params(16, 16)
    reference = run_in_batches(LLM(TINY_CONFIG), prompts, params, [list(range(16))])
    return prompts, params, reference


@pytest.mark.parametrize("with_redundant", [False, True], ids=["no-redundant", "redundant"])
def test_layout_invariance_across_ep_degrees(layout_workload, with_redundant):
    prompts, params, reference = layout_workload
    everything = [list(range(16))]
    for world_size in (1, 2, 4, 8):
        redundant = world_size if with_redundant else 0
        llm = _ep_llm(world_size, **{"eplb.num_redundant_experts": redundant})
        try:
            got = run_in_batches(llm, prompts, params, everything)
            stats = llm.engine.worker_stats()
        finally:
            llm.shutdown()
        assert got == reference, f"EP={world_size}, redundant={redundant} differs from EP=1"
        if world_size > 1:
            assert sum(s["num_rows_sent_remote"] for s in stats) > 0
        if redundant and world_size > 1:
            # Slots E.. hold the replicas (a rank prefers its own replica, so at EP=1 slot e
            # always wins); on several ranks the replicas must have served rows.
            num_slots = (16 + redundant) // world_size
            replica_load = replica_rows(stats, 16, num_slots)
            assert replica_load > 0, f"EP={world_size}: redundant replicas served no rows"


def test_layout_negative_control_multiple_reduction(layout_workload):
    prompts, params, reference = layout_workload
    llm = _ep_llm(4, **{"parallel.allow_multiple_reduction": True})
    try:
        got = run_in_batches(llm, prompts, params, [list(range(16))])
        stats = llm.engine.worker_stats()
    finally:
        llm.shutdown()
    assert sum(s["num_rows_sent_remote"] for s in stats) > 0, "no row crossed ranks at EP=4"
    assert got != reference, (
        "multiple reduction at EP=4 gave EP=1's exact bits: the layout test could not fail"
    )


def test_killed_worker_fails_requests_within_timeout():
    llm = _ep_llm(4, **{"parallel.timeout_s": 10})
    engine = llm.engine
    try:
        seqs = [
            engine.add_request(p, sp).samples[0] for p, sp in zip(*_small_workload(), strict=True)
        ]
        engine.step()
        engine.step()
        engine.executor.kill_worker(2)
        started = time.monotonic()
        with pytest.raises(WorkerError, match="rank 2"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - started < 10 + 30
        assert all(s.finish_reason == "error" and "rank 2" in s.error for s in seqs)
        with pytest.raises(RuntimeError, match="engine is dead"):
            engine.add_request([1, 2, 3], seqs[0].params)
    finally:
        llm.shutdown()


def _small_workload():
    return mixed_prompts(6, 8, 40, seed=2), mixed_params(6, 24)


@pytest.mark.parametrize("mode", ["invariant", "fast"])
def test_ep_matches_single_rank_on_fingerprints(mode):
    """EP=2 equals one rank bit for bit; the control: with fast kernels the same comparison
    differs. Why it differs: EP=2 is DP=2, so each rank's batch holds some of the prompts, and
    fast kernels' bits follow the batch (with one prompt, fast EP=2 gives one rank's bits: its
    combine sums a token's rows in slot order too). The placement alone is shown to matter by
    multiple reduction (test_layout_negative_control_multiple_reduction)."""
    prompts, params = _small_workload()
    single = LLM(TINY_CONFIG, **{"kernels.mode": mode}).generate(prompts, params)
    llm = _ep_llm(2, **{"kernels.mode": mode})
    try:
        got = [fingerprint(o) for o in llm.generate(prompts, params)]
        sent = [s["num_rows_sent_remote"] for s in llm.engine.worker_stats()]
    finally:
        llm.shutdown()
    assert sum(sent) > 0, "no row crossed ranks"
    if mode == "invariant":
        assert got == [fingerprint(o) for o in single]
    else:
        assert got != [fingerprint(o) for o in single], "fast EP=2 matched: no control"


@pytest.mark.parametrize("mode", ["invariant", "fast"])
def test_requests_an_idle_dp_rank_took_over_keep_their_bits(mode):
    """EP=2 is DP=2: requests are placed alternately as they arrive, the long ones (even) all
    on DP rank 0, and rank 1, its short ones done, takes rank 0's waiting requests
    (share_waiting, tests/test_share_waiting.py). They give one rank's bits; the control: with
    fast kernels the comparison differs (the batch decides their bits there)."""
    prompts = mixed_prompts(8, 8, 40, seed=5)
    params = [
        SamplingParams(max_tokens=24 if i % 2 == 0 else 2, temperature=0.9, seed=i, logprobs=3)
        for i in range(8)
    ]
    overrides = {"kernels.mode": mode, "scheduler.max_num_seqs": 2}
    single = LLM(TINY_CONFIG, **overrides).generate(prompts, params, use_tqdm=False)
    llm = _ep_llm(2, **overrides)
    try:
        got = [fingerprint(o) for o in llm.generate(prompts, params, use_tqdm=False)]
        num_shared = llm.engine.stats().num_shared
    finally:
        llm.shutdown()
    assert num_shared > 0, "no request moved to the idle DP rank"
    if mode == "invariant":
        assert got == [fingerprint(o) for o in single]
    else:
        assert got != [fingerprint(o) for o in single], "fast EP=2 matched: no control"
