"""scheduler.overlap_decode: a decode step launched ahead of the engine changes no bit.

After a step whose every sequence sampled, the worker launches the next decode step of the
samples that go on (fed the tokens just sampled) before the engine asks for it; the engine's
step uses it only when its batch and sampling inputs equal the launched ones element for
element. On the CPU the lookahead runs eagerly (no time is won), which exercises the same
bookkeeping as the CUDA-graph path (tests/test_gpu_graphs.py runs that one on the GPU).

- Generation with the lookahead on equals it off bit for bit (token ids, logprobs, top-3,
  routed experts, finish reasons) over greedy and seeded top-k / top-p sampling, n = 2,
  finishes by length, stop token and stop string, a min_tokens holding a stop id off (the
  lookahead's hold-off is at the output position the step samples), requests arriving
  mid-generation and block boundaries. Engagement: lookaheads served steps, and some were dropped.
- The same with preemptions (a cache too small), chunked prompts and a scoring request.
- Controls: a lookahead fed a wrong token is always dropped by the comparison (no hit, same
  bits), and the same lookahead compared by shape only changes the output; a lookahead kept
  across a weight update changes the output, dropped (as the worker does) it does not.
- Most lookaheads are queued before the read, fed the sampled ids on the device; where a
  sample ended with its token, the lookahead's other rows served the next step (the bits of a
  step without the ended sample). Control: fed the wrong ids on the device, the output moves.
"""

from __future__ import annotations

import pytest

from moe_runtime import LLM, SamplingParams
from moe_runtime.config import load_config
from moe_runtime.worker import lookahead
from moe_runtime.worker.lookahead import Lookahead
from moe_runtime.worker.sampler import Sampler
from tests.invariance import TINY_CONFIG, fingerprint, mixed_prompts, record_steps

# Requests arrive in three groups, at these steps (each group waits a step or more, so the
# lookahead launched before it is dropped).
ARRIVALS = {0: range(0, 5), 5: range(5, 8), 12: range(8, 10)}


def _params(stop_token: int, stop_text: str, held_token: int) -> list[SamplingParams]:
    sampled = {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "logprobs": 3}
    return [
        SamplingParams(max_tokens=20, temperature=0.0, logprobs=3, stop=(stop_text,)),
        SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(stop_token,)),
        SamplingParams(max_tokens=17, seed=7, n=2, return_routed_experts=True, **sampled),
        SamplingParams(max_tokens=9, temperature=0.0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=24, seed=3, ignore_eos=True, **sampled),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=15, seed=11, ignore_eos=True, **sampled),
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=3),
        SamplingParams(max_tokens=14, seed=5, ignore_eos=True, **sampled),
        SamplingParams(max_tokens=10, temperature=0.0, min_tokens=5, stop_token_ids=(held_token,)),
    ]


@pytest.fixture(scope="module")
def workload():
    """Prompts and params; request 0 stops at a string and request 1 at a token, both taken
    from their greedy output without stops (so the stops really end them early); request 9's
    min_tokens holds off its own greedy token 1 (so the hold-off changes its tokens)."""
    prompts = mixed_prompts(10, 5, 40, seed=11)
    llm = LLM(TINY_CONFIG)
    plain = llm.generate(prompts[:2], SamplingParams(max_tokens=20, temperature=0.0))
    stop_text = plain[0].outputs[0].text[2]
    stop_token = plain[1].outputs[0].token_ids[3]
    free = llm.generate(prompts[9], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    return prompts, _params(stop_token, stop_text, free[0].outputs[0].token_ids[1])


def _run(workload, overlap: bool, llm: LLM | None = None) -> tuple[dict, dict]:
    """Step the engine with the arrivals above; -> ({request: samples' results}, rank stats)."""
    prompts, params = workload
    llm = llm or LLM(TINY_CONFIG, **{"scheduler.overlap_decode": overlap})
    engine, requests, step = llm.engine, {}, 0
    while step == 0 or engine.has_unfinished():
        for i in ARRIVALS.get(step, ()):
            requests[i] = engine.add_request(prompts[i], params[i])
        engine.step()
        step += 1
    results = {}
    for i, request in requests.items():
        outputs = engine.output(request).outputs
        results[i] = [(*fingerprint(o), o.finish_reason, _bytes(o.routed_experts)) for o in outputs]
    return results, engine.worker_stats()[0]


def _bytes(array) -> bytes | None:
    return None if array is None else array.tobytes()


def test_overlap_decode_bitwise_equals_off(workload):
    off, off_stats = _run(workload, overlap=False)
    on, stats = _run(workload, overlap=True)
    assert on == off
    assert off_stats["num_lookahead_hits"] == off_stats["num_lookahead_misses"] == 0
    # Engagement: most decode steps came from a lookahead; arrivals and the stop string
    # dropped some.
    assert stats["num_lookahead_hits"] >= 10, stats
    assert stats["num_lookahead_misses"] >= 2, stats
    reasons = {r[3] for samples in off.values() for r in samples}
    assert reasons == {"stop", "length"}, reasons
    assert off[0][0][3] == off[1][0][3] == "stop"
    assert len(off[0][0][0]) < 20 and len(off[1][0][0]) < 20
    # min_tokens engaged: request 9's greedy token 1 without it is its stop id, held off.
    prompts, params = workload
    llm = LLM(TINY_CONFIG)
    try:
        free = llm.generate(prompts[9], SamplingParams(max_tokens=10, temperature=0.0))
    finally:
        llm.shutdown()
    (held,) = params[9].stop_token_ids
    assert free[0].outputs[0].token_ids[1] == held != off[9][0][0][1]


def _wrong_token_lookahead(monkeypatch) -> None:
    """Lookaheads fed token + 1 instead of the sampled token."""
    launch, vocab = Lookahead.launch, load_config(TINY_CONFIG).model.vocab_size

    def wrong(self, chunks, token_ids, prepared=None):
        wrong_ids = {k: (t + 1) % vocab for k, t in token_ids.items()}
        return launch(self, chunks, wrong_ids, prepared)

    monkeypatch.setattr(Lookahead, "launch", wrong)


def test_wrong_lookahead_is_dropped_and_would_change_bits(workload, monkeypatch):
    off, _ = _run(workload, overlap=False)
    _wrong_token_lookahead(monkeypatch)
    # The host-side launch only: one queued before the read is compared with the tokens it
    # was fed by construction (test_unread_lookaheads_feed_the_sampled_ids_on_the_device).
    monkeypatch.setattr(Lookahead, "launch_unread", lambda *args: None)
    checked, stats = _run(workload, overlap=True)
    assert checked == off
    assert stats["num_lookahead_hits"] == 0 and stats["num_lookahead_misses"] >= 10, stats

    # Control: compared by shape only, the same lookaheads are used and change the output.
    def same_shapes(a, b) -> bool:
        return all(getattr(a, k).shape == getattr(b, k).shape for k in vars(a))

    monkeypatch.setattr(lookahead, "same_batch", same_shapes)
    unchecked, stats = _run(workload, overlap=True)
    assert stats["num_lookahead_hits"] >= 10, stats
    assert unchecked != off, "a lookahead with wrong tokens left the output unchanged"


def test_weight_update_drops_the_lookahead(monkeypatch):
    pytest.importorskip("transformers")
    import tempfile

    from tests.checkpoints import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as first, tempfile.TemporaryDirectory() as second:
        write_tiny_checkpoint(first, "v3", seed=1, q_lora_rank=None)
        write_tiny_checkpoint(second, "v3", seed=2, q_lora_rank=None)
        prompts = mixed_prompts(3, 5, 30, seed=4)
        params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)

        def run(overlap: bool) -> tuple[list, dict]:
            llm = LLM(
                {"model": {"path": first}, "scheduler": {"max_model_len": 256}},
                **{"scheduler.overlap_decode": overlap},
            )
            requests = llm.engine.add_requests(prompts, [params] * len(prompts))
            for _ in range(4):
                llm.engine.step()
            llm.update_weights(second)
            while llm.engine.has_unfinished():
                llm.engine.step()
            got = [fingerprint(llm.engine.output(r).outputs[0]) for r in requests]
            return got, llm.engine.worker_stats()[0]

        off, _ = run(overlap=False)
        on, stats = run(overlap=True)
        assert on == off
        assert stats["num_lookahead_hits"] >= 3 and stats["num_lookahead_misses"] >= 1, stats
        # Control: a lookahead kept across the update serves a step with the old weights.
        monkeypatch.setattr(Lookahead, "drop", lambda self: None)
        kept, _ = run(overlap=True)
        assert kept != off, "a lookahead of the old weights left the output unchanged"


def test_overlap_decode_config():
    assert load_config(TINY_CONFIG).scheduler.overlap_decode is False  # no graphs on the CPU
    on = load_config(TINY_CONFIG, {"scheduler.overlap_decode": True})
    assert on.scheduler.overlap_decode is True
    with pytest.raises(ValueError, match="overlap_decode: true needs parallel.world_size 1"):
        load_config(TINY_CONFIG, {"scheduler.overlap_decode": True, "parallel.world_size": 2})
    with pytest.raises(ValueError, match="overlap_decode must be true, false or null"):
        load_config(TINY_CONFIG, {"scheduler.overlap_decode": "sometimes"})


def test_overlap_decode_with_preemption_chunked_prefill_and_scoring():
    """A KV cache too small for every request (preemptions), a token budget that chunks the
    prompts, and a scoring request among the generations: equal bits on and off."""
    prompts = mixed_prompts(6, 20, 60, seed=8)
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=25, seed=4, temperature=0.8, top_p=0.9, ignore_eos=True),
    ] * 3
    overrides = {
        "cache.num_blocks": 14,
        "scheduler.max_model_len": 200,
        "scheduler.max_num_batched_tokens": 40,
    }

    def run(overlap: bool) -> tuple[list, list, dict]:
        llm = LLM(TINY_CONFIG, **overrides, **{"scheduler.overlap_decode": overlap})
        engine = llm.engine
        steps = record_steps(llm)
        requests = engine.add_requests(prompts, params)
        scored = engine.add_score_request(prompts[0] + prompts[1][:20], len(prompts[0]))
        while engine.has_unfinished():
            engine.step()
        got = [fingerprint(engine.output(r).outputs[0]) for r in requests]
        logprobs = [float.hex(x) for x in scored.samples[0].output_logprobs]
        stats = {**engine.worker_stats()[0], "preemptions": engine.stats().num_preemptions}
        # a prompt's prefill in pieces: a chunk of several tokens that starts past position 0
        stats["chunked"] = any(c.start > 0 and c.num_tokens > 1 for s in steps for c in s)
        return got, logprobs, stats

    off, off_scored, _ = run(overlap=False)
    on, on_scored, stats = run(overlap=True)
    assert on == off and on_scored == off_scored
    assert stats["preemptions"] > 0 and stats["chunked"], stats
    assert stats["num_lookahead_hits"] >= 5, stats


def test_most_lookaheads_launch_from_the_batch_built_before_the_read(workload, monkeypatch):
    """Engagement of Lookahead.prepare: the lookahead batches built after the read (a
    sequence ended, or none was prepared) are a minority of the lookaheads the engine used,
    and the bits are those with the lookahead off."""
    prepare, build = Lookahead.prepare, Lookahead._decode_batch
    calls = {"prepare": 0, "after_read": 0, "preparing": False}

    def counting_prepare(self, chunks):
        calls["preparing"] = True
        try:
            return prepare(self, chunks)
        finally:
            calls["preparing"] = False

    def counting_build(self, seqs, token_ids):
        calls["prepare" if calls["preparing"] else "after_read"] += 1
        return build(self, seqs, token_ids)

    monkeypatch.setattr(Lookahead, "prepare", counting_prepare)
    monkeypatch.setattr(Lookahead, "_decode_batch", counting_build)
    off, _ = _run(workload, overlap=False)
    assert calls["prepare"] == calls["after_read"] == 0
    on, stats = _run(workload, overlap=True)
    assert on == off
    assert calls["prepare"] >= stats["num_lookahead_hits"] >= 10, (calls, stats)
    assert calls["after_read"] < stats["num_lookahead_hits"] / 2, (calls, stats)


def test_unread_lookaheads_feed_the_sampled_ids_on_the_device(workload, monkeypatch):
    """Engagement: most lookaheads were queued before the read, some of them for the samples
    that go on while one ends by length, and some kept the rows of the samples that went on
    after one ended with its token; the bits are those with the lookahead off. Control: the
    same lookaheads fed token + 1 on the device change the output."""
    launch, settle = Lookahead.launch_unread, Lookahead.settle_unread
    covered, endings = [], []

    def counting_launch(self, chunks, seqs, prepared, launched):
        rows = launch(self, chunks, seqs, prepared, launched)
        covered.append((len(rows or ()), len(seqs)))
        return rows

    def counting_settle(self, seqs, tokens):
        endings.append(sum(self._ends(s, t) for s, t in zip(seqs, tokens, strict=True)))
        return settle(self, seqs, tokens)

    monkeypatch.setattr(Lookahead, "launch_unread", counting_launch)
    monkeypatch.setattr(Lookahead, "settle_unread", counting_settle)
    off, _ = _run(workload, overlap=False)
    on, stats = _run(workload, overlap=True)
    assert on == off
    assert stats["num_unread_launches"] >= 10, stats
    assert stats["num_unread_launches"] >= stats["num_lookahead_hits"] / 2, stats
    assert any(0 < rows < num_seqs for rows, num_seqs in covered), covered
    assert any(endings), "no lookahead met a sample that ended with its token"

    token_ids, vocab = Sampler.token_ids, load_config(TINY_CONFIG).model.vocab_size

    def wrong_ids(launched):
        return (token_ids(launched) + 1) % vocab

    monkeypatch.setattr(Sampler, "token_ids", staticmethod(wrong_ids))
    fed_wrong, stats = _run(workload, overlap=True)
    assert stats["num_unread_launches"] >= 10, stats
    assert fed_wrong != off, "lookaheads fed the wrong ids on the device left the output unchanged"


def test_fast_mode_drops_a_lookahead_whose_sample_ended(workload, monkeypatch):
    """Fast mode (a row's bits follow the batch) never keeps part of a lookahead whose sample
    ended with its token: it is dropped, and the bits are those with the lookahead off, where
    lookaheads still served steps."""
    settle, endings = Lookahead.settle_unread, []

    def checking_settle(self, seqs, tokens):
        ended = sum(self._ends(s, t) for s, t in zip(seqs, tokens, strict=True))
        settle(self, seqs, tokens)
        endings.append((ended, len(seqs), not self.is_launched))

    monkeypatch.setattr(Lookahead, "settle_unread", checking_settle)
    fast = {"kernels.mode": "fast"}
    off, _ = _run(workload, False, LLM(TINY_CONFIG, **fast, **{"scheduler.overlap_decode": False}))
    on, stats = _run(workload, True, LLM(TINY_CONFIG, **fast, **{"scheduler.overlap_decode": True}))
    assert on == off
    assert stats["num_unread_launches"] >= 10, stats
    partial = [dropped for ended, num_seqs, dropped in endings if 0 < ended < num_seqs]
    assert partial, endings  # engagement: a sample ended with its token while others went on
    assert all(partial), endings


def _queued_run(workload, overlap: bool, **overrides) -> tuple[dict, dict, LLM]:
    """_run with at most 3 sequences running: the later requests wait most steps."""
    settings = {"scheduler.overlap_decode": overlap, "scheduler.max_num_seqs": 3, **overrides}
    llm = LLM(TINY_CONFIG, **settings)
    results, stats = _run(workload, overlap, llm)
    return results, stats, llm


def test_lookaheads_serve_while_requests_wait(workload):
    """With more requests than scheduler.max_num_seqs the queue waits most steps. Invariant
    mode still launches lookaheads then, and holds a waiting request's admission one step
    where a sequence left (so the launched step is used); the bits equal overlap off (which
    admits at once) and the rule without lookaheads while requests wait. Controls: that rule
    served fewer steps from lookaheads; fast mode keeps it (no hold), and with the hold forced
    on, fast mode's output moves."""
    off, _, _ = _queued_run(workload, False)
    on, stats, llm = _queued_run(workload, True)
    assert on == off
    held = llm.engine.schedulers[0].num_held_admissions
    assert held >= 2, held

    without = LLM(TINY_CONFIG, **{"scheduler.overlap_decode": True, "scheduler.max_num_seqs": 3})
    without.engine.schedulers[0].can_hold_admission = False  # the rule before the hold
    old_rule, old_stats = _run(workload, True, without)
    assert old_rule == off
    assert without.engine.schedulers[0].num_held_admissions == 0
    assert stats["num_lookahead_hits"] > old_stats["num_lookahead_hits"] + 5, (stats, old_stats)

    _, _, fast = _queued_run(workload, True, **{"kernels.mode": "fast"})
    assert not fast.engine.schedulers[0].can_hold_admission
    assert fast.engine.schedulers[0].num_held_admissions == 0

    # Negative control: in fast mode (invariance off) the same holds move the bits.
    fast_settings = {"kernels.mode": "fast", "scheduler.max_num_seqs": 3}
    fast_off, _ = _run(
        workload, False, LLM(TINY_CONFIG, **fast_settings, **{"scheduler.overlap_decode": False})
    )
    forced = LLM(TINY_CONFIG, **fast_settings, **{"scheduler.overlap_decode": True})
    forced.engine.schedulers[0].can_hold_admission = True
    fast_held, _ = _run(workload, True, forced)
    assert forced.engine.schedulers[0].num_held_admissions >= 2
    assert fast_held != fast_off, "holding admissions left fast mode's output unchanged"


def test_a_sample_ending_by_length_at_a_block_boundary_keeps_the_unread_launch():
    """A sample whose last token is sampled where its next position would open a new KV block
    gets no block for it (the scheduler gives none to a sample its step's token ends by
    length), and the lookahead leaves it out: the other sample's lookahead is still queued
    before the read, so every served lookahead was. Here 10 prompt tokens + 6 outputs fill
    the first 16-token block as the 7th and last output is sampled. Bits: those with the
    lookahead off."""
    prompts = (list(range(3, 13)), list(range(20, 25)))
    params = (
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    )
    config = load_config(TINY_CONFIG)
    assert config.cache.block_size == 16, config.cache.block_size
    outputs, stats = [], None
    for overlap in (False, True):
        engine = LLM(TINY_CONFIG, **{"scheduler.overlap_decode": overlap}).engine
        requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        while engine.has_unfinished():
            engine.step()
        outputs.append([fingerprint(o) for r in requests for o in engine.output(r).outputs])
        stats = engine.worker_stats()[0]
    assert outputs[0] == outputs[1]
    assert [len(o[0]) for o in outputs[1]] == [7, 20], outputs[1]
    assert stats["num_lookahead_hits"] >= 15, stats
    assert stats["num_unread_launches"] == stats["num_lookahead_hits"], stats
