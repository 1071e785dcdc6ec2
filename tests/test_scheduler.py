"""The Scheduler in plain Python (no model, no worker): each step's chunks are checked against
its budget and limits, and a fake worker hands back one token for every chunk that ends a
generating sequence's known tokens, as the engine's step does.

- Chunked prefill: chunks of a prompt are contiguous and fit the step's token budget; running
  sequences are served before waiting ones; at most max_num_seqs run.
- Preemption: with too few KV blocks the newest running sequence goes back to the head of the
  queue with its blocks freed, and is recomputed from position 0; every sequence still ends
  with all its tokens.
- Prefix caching: a prompt whose full blocks are cached starts past them; a scoring sequence
  matches its prompt only (it must compute every position it scores); a request's second
  sample waits for the first to compute the prompt's full blocks, then starts past them.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from moe_runtime.config import SchedulerConfig
from moe_runtime.engine.block_manager import BlockManager
from moe_runtime.engine.request import Request, Sequence, SequenceStatus
from moe_runtime.engine.scheduler import ScheduledChunk, Scheduler
from moe_runtime.sampling_params import SamplingParams
from moe_runtime.tokenizer import ByteTokenizer
from moe_runtime.worker.step_input import SampleResult
from tests.counting import CountingSamples

BLOCK_SIZE = 4
TOKENIZER = ByteTokenizer(512)
_seq_ids = itertools.count()


def _scheduler(
    num_blocks: int = 64, budget: int = 16, max_num_seqs: int = 8, caching: bool = True
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=256
    )
    return Scheduler(config, BlockManager(num_blocks, BLOCK_SIZE, caching), eos_token_ids=())


def _add(scheduler: Scheduler, prompt: list[int], max_tokens: int = 3, n: int = 1) -> Request:
    params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, temperature=0.0)
    request = Request(f"r{next(_seq_ids)}", prompt, params, seed=1)
    for seq in request.expand_samples(next(_seq_ids) * 100, TOKENIZER):
        scheduler.add(seq)
    return request


def _add_score(scheduler: Scheduler, prompt: list[int], scored: list[int]) -> Sequence:
    request = Request(
        f"s{next(_seq_ids)}", prompt, SamplingParams(), seed=0, score_token_ids=scored
    )
    (seq,) = request.expand_samples(next(_seq_ids) * 100, TOKENIZER)
    scheduler.add(seq)
    return seq


def _step(scheduler: Scheduler) -> list[ScheduledChunk]:
    """One step: schedule, then a token (7) for each chunk that ends its sequence's known
    tokens, as a worker samples them."""
    chunks = scheduler.schedule()
    samples = {
        c.seq.seq_id: SampleResult(7, 0.0, {})
        for c in chunks
        if not c.seq.is_score and c.start + c.num_tokens == c.seq.num_tokens
    }
    scheduler.update(chunks, samples)
    return chunks


def _run(scheduler: Scheduler, max_steps: int = 500) -> list[list[ScheduledChunk]]:
    steps = []
    while scheduler.has_unfinished():
        assert len(steps) < max_steps, "the scheduler made no progress"
        steps.append(_step(scheduler))
    return steps


def test_chunks_fit_the_budget_and_a_prompt_s_chunks_are_contiguous():
    scheduler = _scheduler(budget=16)
    long, short = _add(scheduler, list(range(50))), _add(scheduler, [1, 2, 3])
    steps = _run(scheduler)
    for chunks in steps:
        assert sum(c.num_tokens for c in chunks) <= 16
        assert len({c.seq.seq_id for c in chunks}) == len(chunks)  # one chunk a sequence
    first = [c for chunks in steps for c in chunks if c.seq is long.samples[0]]
    prefill = [(c.start, c.num_tokens) for c in first if c.start < 50]
    assert prefill == [(0, 16), (16, 16), (32, 16), (48, 2)]  # engagement: chunked
    for request in (long, short):
        (seq,) = request.samples
        assert seq.output_token_ids == [7, 7, 7] and seq.finish_reason == "length"


def test_running_sequences_are_served_before_waiting_ones():
    scheduler = _scheduler(budget=16)
    first = _add(scheduler, list(range(40)))
    _step(scheduler)  # the first takes the whole budget
    second = _add(scheduler, list(range(100, 110)))
    chunks = _step(scheduler)
    assert chunks[0].seq is first.samples[0] and chunks[0].start == 16
    assert [c.seq for c in chunks[1:]] == []  # the budget went to the running one first
    assert second.samples[0].status is SequenceStatus.WAITING


def test_at_most_max_num_seqs_run():
    scheduler = _scheduler(budget=64, max_num_seqs=2)
    requests = [_add(scheduler, [i, i + 1, i + 2], max_tokens=4) for i in range(5)]
    for chunks in _run(scheduler):
        assert len(chunks) <= 2
        assert len(scheduler.running) <= 2
    assert all(r.samples[0].output_token_ids == [7] * 4 for r in requests)


def test_preemption_recomputes_the_newest_and_loses_nothing():
    # 7 blocks of 4: both admitted (3 blocks each, one left free for the running one), but
    # at 10 + 8 tokens each they cannot both hold their 5 blocks.
    scheduler = _scheduler(num_blocks=7, budget=32, caching=False)
    a, b = _add(scheduler, list(range(10)), max_tokens=8), _add(scheduler, list(range(20, 30)), 8)
    steps = _run(scheduler)
    assert scheduler.num_preemptions > 0  # engagement
    restarts = [c for chunks in steps for c in chunks if c.seq is b.samples[0] and c.start == 0]
    assert len(restarts) >= 2, "the newest was not preempted and recomputed from 0"
    for request in (a, b):
        (seq,) = request.samples
        assert seq.output_token_ids == [7] * 8 and seq.finish_reason == "length"
    assert scheduler.blocks.num_free_blocks == 7  # everything freed at the end


@pytest.mark.parametrize("reserve", [0, 1])
def test_an_admission_leaves_a_free_block_for_each_running_sequence(reserve):
    """4 blocks of 4; the older sequence (5 tokens, 2 blocks) grows to 11 (3 blocks). Admitted
    into the last 2 free blocks (admission_reserve 0, the rule before), the newer took the one
    the older grows into and was preempted at the older's next block, its prompt computed
    again. With the default reserve of one block a running sequence it waits, and nothing is
    preempted; both end with all their tokens either way."""
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, admission_reserve=reserve
    )
    scheduler = Scheduler(config, BlockManager(4, BLOCK_SIZE, False), eos_token_ids=())
    older = _add(scheduler, list(range(5)), max_tokens=6)
    newer = _add(scheduler, list(range(50, 55)), max_tokens=6)
    steps = _run(scheduler)
    restarts = [c for chunks in steps for c in chunks if c.seq is newer.samples[0] and c.start == 0]
    assert scheduler.num_preemptions == (1 if reserve == 0 else 0)
    assert len(restarts) == (2 if reserve == 0 else 1)
    for request in (older, newer):
        assert request.samples[0].output_token_ids == [7] * 6
    assert scheduler.blocks.num_free_blocks == 4


def test_a_preempted_sequence_waits_until_all_its_tokens_fit():
    """A preempted sequence was readmitted as soon as its first chunk fit, the same step, and
    preempted again at the next chunk, step after step while the older one grew: each time its
    recompute was thrown away (5 preemptions here). It now waits until every token it has fits
    the free blocks, which only a sequence's end brings."""
    # 8 blocks of 4: the older grows to 30 tokens (8 blocks); the newer needs 4 more.
    scheduler = _scheduler(num_blocks=8, budget=8, caching=False)
    older = _add(scheduler, list(range(20)), max_tokens=11)
    _step(scheduler)
    newer = _add(scheduler, list(range(50, 62)), max_tokens=2)
    steps = _run(scheduler)
    (seq,) = newer.samples
    restarts = [c for chunks in steps for c in chunks if c.seq is seq and c.start == 0]
    assert scheduler.num_preemptions == 1, scheduler.num_preemptions
    assert len(restarts) == 2  # its first admission, and one after its preemption
    assert older.samples[0].output_token_ids == [7] * 11
    assert seq.output_token_ids == [7, 7] and scheduler.blocks.num_free_blocks == 8


@pytest.mark.parametrize("older_max_tokens", [4, 5], ids=["older ends", "newer ends"])
def test_a_lookahead_slot_never_costs_a_preemption(older_max_tokens):
    """With overlap_decode a chunk that ends a sequence's known tokens also takes the block of
    its next position when one is free. The older sequence took the last free block for it
    before the newer one's chunk was served, which then found none and was preempted and
    recomputed: in the step that sampled the older one's last token (max_tokens, known before
    the step: a block nobody writes), or the newer one's (which then freed all of its own)."""
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=6, max_model_len=32, overlap_decode=True
    )
    scheduler = Scheduler(config, BlockManager(8, BLOCK_SIZE, False), eos_token_ids=())
    older = _add(scheduler, list(range(9)), max_tokens=older_max_tokens)
    newer = _add(scheduler, list(range(100, 117)), max_tokens=1)  # 17: all 5 other blocks
    steps = _run(scheduler)
    assert scheduler.num_preemptions == 0
    newer_chunks = [c.num_tokens for chunks in steps for c in chunks if c.seq is newer.samples[0]]
    assert newer_chunks == [3, 5, 5, 4]  # its prompt once, nothing recomputed
    assert older.samples[0].output_token_ids == [7] * older_max_tokens
    assert newer.samples[0].output_token_ids == [7]
    assert scheduler.blocks.num_free_blocks == 8


@pytest.mark.parametrize("max_tokens", [1, None], ids=["max_tokens", "context end"])
def test_no_lookahead_slot_for_a_sample_its_step_ends(max_tokens):
    """A sample whose step's token ends it by length (max_tokens, or the context's end) has no
    next decode position: the lookahead leaves it out, so no block is taken for its slot."""
    for max_model_len, expected_blocks in ((9, 2), (10, 3)):  # control: one that goes on
        config = SchedulerConfig(
            max_num_batched_tokens=16, max_model_len=max_model_len, overlap_decode=True
        )
        scheduler = Scheduler(config, BlockManager(8, BLOCK_SIZE, False), eos_token_ids=())
        limit = max_tokens if max_model_len == 9 else None
        (seq,) = _add(scheduler, list(range(8)), max_tokens=limit).samples
        (chunk,) = scheduler.schedule()
        assert (chunk.start, chunk.num_tokens) == (0, 8)
        assert len(seq.block_table) == expected_blocks, max_model_len


def test_a_cached_prompt_starts_past_its_full_blocks():
    scheduler = _scheduler(budget=64)
    prompt = list(range(30, 43))  # 13 tokens: 3 full blocks
    _run_one = _add(scheduler, prompt)
    _run(scheduler)
    again = _add(scheduler, prompt)
    (chunk,) = _step(scheduler)
    assert chunk.seq is again.samples[0] and (chunk.start, chunk.num_tokens) == (12, 1)
    assert _run_one.samples[0].output_token_ids == [7, 7, 7]


def test_a_scoring_matches_its_prompt_only():
    """The scored tokens' positions are computed even where the whole sequence is cached."""
    scheduler = _scheduler(budget=64)
    tokens = list(range(60, 77))  # 17 tokens: 4 full blocks
    _add(scheduler, tokens)
    _run(scheduler)
    seq = _add_score(scheduler, tokens[:5], tokens[5:])
    (chunk,) = _step(scheduler)
    assert chunk.seq is seq and chunk.start == 4  # the prompt's one full block, no more
    _run(scheduler)
    assert seq.finish_reason == "scored"


def test_a_second_sample_waits_for_the_prompt_then_starts_past_it():
    """A budget that fits both: admitted beside the first, the second computed the prompt."""
    scheduler = _scheduler(budget=64)
    request = _add(scheduler, list(range(200, 217)), n=2)  # 17 tokens: 4 full blocks
    first, second = request.samples
    steps = _run(scheduler)
    assert [c.seq for c in steps[0]] == [first]  # the second waited
    second_chunks = [c for chunks in steps for c in chunks if c.seq is second]
    assert (second_chunks[0].start, second_chunks[0].num_tokens) == (16, 1)
    assert first.output_token_ids == second.output_token_ids == [7, 7, 7]


def test_a_decode_step_commits_no_more_than_a_block_of_tokens(monkeypatch):
    """Each decode step hands the block manager only the tokens from its first open block on,
    with prefix caching off and after the cache was cleared under a running sequence (a weight
    update) too: there the first open block stood still, and every step copied the whole
    sequence from it (O(context) a token). The cleared case still caches none of its blocks."""
    taken: list[int] = []
    tokens_from = Sequence.tokens_from

    def spy(seq, start):
        tokens = tokens_from(seq, start)
        taken.append(len(tokens))
        return tokens

    monkeypatch.setattr(Sequence, "tokens_from", spy)
    for caching, clears in ((False, False), (True, True)):
        scheduler = _scheduler(num_blocks=128, caching=caching)
        (seq,) = _add(scheduler, list(range(200, 206)), max_tokens=200).samples
        _step(scheduler)  # the prompt
        if clears:
            scheduler.blocks.clear_cache()  # its blocks so far now hold the old weights' KV
        taken.clear()
        _run(scheduler)
        assert taken and max(taken) <= BLOCK_SIZE, (caching, max(taken))
        # Nothing it computed after the old weights' blocks is cached: its KV attended to them.
        assert scheduler.blocks.match_prefix(seq.token_ids) == []


def test_the_admission_bench_runs_and_the_reserve_cuts_the_recompute():
    """bench/admission.py end to end at a small size: its rows, and fewer tokens computed
    again with a reserve of one block a running sequence than with none."""
    bench = Path(__file__).resolve().parent.parent / "bench" / "admission.py"
    args = ["--blocks", "300", "--requests", "60", "--max-num-seqs", "16", "--seeds", "0"]
    out = subprocess.run(
        [sys.executable, str(bench), *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 300 |")]
    waste = [float(row.split("|")[3].split("%")[0]) for row in rows]
    assert len(waste) == 3 and waste[1] < waste[0], out.stdout


def test_admitting_many_samples_reads_no_list_of_siblings():
    """The samples of a request of n wait for the first to compute the prompt, then are let in
    64 at once. Each one let in read every sibling to learn whether one still computed the
    prompt: n = 50,000 with 256 let in cost 1.2 s of one step. Counted, not timed: the
    siblings read in that step stay within max_num_seqs whatever n is."""
    scheduler = _scheduler(num_blocks=4096, budget=4096, max_num_seqs=64)
    request = _add(scheduler, list(range(1, 18)), max_tokens=5, n=2000)  # 4 full blocks
    request.samples = CountingSamples(request.samples)
    assert [c.seq for c in _step(scheduler)] == [request.samples[0]]  # the others wait
    chunks = _step(scheduler)
    assert len(chunks) == 64 and all(c.start == 16 for c in chunks[1:])  # past the prompt
    num_reads = request.samples.num_reads  # (not in the assert: its report would print it)
    assert num_reads <= 64, num_reads


def test_a_nan_logprob_ends_its_sequence_at_once_with_error():
    """A sampled token whose logprob is NaN (its logits were not finite) ends the sequence at
    that step with "error", keeping no token for it, its blocks freed; one with a -inf logprob
    (a token of no probability) and a finite one go on."""
    scheduler = _scheduler()
    bad_seq, odd_seq, other = (
        _add(scheduler, [1, 2, 3, 4, 5], max_tokens=4).samples[0] for _ in range(3)
    )
    _step(scheduler)  # the prompts, a token each
    chunks = scheduler.schedule()
    logprobs = {bad_seq.seq_id: float("nan"), odd_seq.seq_id: float("-inf"), other.seq_id: -0.5}
    scheduler.update(
        chunks, {c.seq.seq_id: SampleResult(9, logprobs[c.seq.seq_id], {}) for c in chunks}
    )
    assert (bad_seq.finish_reason, bad_seq.non_finite_at) == ("error", 1)
    assert bad_seq.output_token_ids == [7] and bad_seq.output_logprobs == [0.0]
    assert bad_seq.block_table == [] and bad_seq not in scheduler.running
    assert not (odd_seq.is_finished or other.is_finished)
    assert odd_seq.output_token_ids == other.output_token_ids == [7, 9]
    _run(scheduler)
    assert [s.finish_reason for s in (odd_seq, other)] == ["length", "length"]
    assert scheduler.blocks.num_free_blocks == scheduler.blocks.num_blocks
