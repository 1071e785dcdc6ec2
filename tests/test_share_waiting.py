"""share_waiting (engine/scheduler.py): DP ranks with nothing waiting take untouched requests
from the busiest rank's queue, in plain Python (no model, no worker), the DP ranks' Schedulers
stepped in lockstep as LLMEngine steps them and requests placed as LLMEngine._enqueue places
them (the fewest unfinished sequences, the lowest rank on ties).

- A workload whose long requests all land on one rank: without sharing the other rank idles
  while the first's queue still holds requests; with it the whole run takes fewer steps.
- Nothing that ran, holds blocks or has a sibling running moves; a taker's queue stays in
  arrival order; every sequence ends with all its tokens; no rank passes max_num_seqs.
- Random mixes (arrivals over time, n up to 3, preemptions from small caches, aborts).
The bits of a moved request are the engine's (tests/test_expert_parallel.py).
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

from bench.scheduler_sim import finish_step
from moe_runtime.config import SchedulerConfig
from moe_runtime.engine.block_manager import BlockManager
from moe_runtime.engine.request import Request, SequenceStatus
from moe_runtime.engine.scheduler import Scheduler, share_waiting
from moe_runtime.sampling_params import SamplingParams
from moe_runtime.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer(512)
BLOCK_SIZE = 4


class Ranks:
    """DP ranks' schedulers stepped in lockstep; records where each sequence first ran."""

    def __init__(self, num: int, num_blocks: int = 64, budget: int = 32, max_num_seqs: int = 4):
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=128
        )
        self.schedulers = [
            Scheduler(config, BlockManager(num_blocks, BLOCK_SIZE, True), eos_token_ids=())
            for _ in range(num)
        ]
        self.ids = itertools.count()
        self.ran_on: dict[int, int] = {}  # seq_id -> the DP rank of its first chunk
        self.requests: list[Request] = []
        self.num_steps = self.num_moved = 0

    def add(self, prompt: list[int], max_tokens: int, n: int = 1) -> Request:
        params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, temperature=0.0)
        request = Request(f"r{len(self.requests)}", prompt, params, seed=1)
        loads = [s.num_unfinished for s in self.schedulers]
        dp_rank = loads.index(min(loads))
        first = next(self.ids)
        for _ in range(n - 1):
            next(self.ids)
        for seq in request.expand_samples(first, TOKENIZER):
            seq.dp_rank = dp_rank
            self.schedulers[dp_rank].add(seq)
        self.requests.append(request)
        return request

    def add_on(self, dp_rank: int, prompt: list[int], max_tokens: int, n: int = 1) -> Request:
        """A request placed on dp_rank whatever the loads (a burst there left it so)."""
        request = self.add(prompt, max_tokens, n)
        for seq in request.samples:
            self.schedulers[seq.dp_rank].waiting.remove(seq)
            seq.dp_rank = dp_rank
            self.schedulers[dp_rank].add(seq)
        return request

    def step(self, share: bool) -> None:
        if share:
            self.num_moved += share_waiting(self.schedulers)
        self.check()
        for dp_rank, scheduler in enumerate(self.schedulers):
            chunks = scheduler.schedule()
            for chunk in chunks:
                seq = chunk.seq
                assert seq.dp_rank == dp_rank, f"seq {seq.seq_id} runs off its dp_rank"
                assert self.ran_on.setdefault(seq.seq_id, dp_rank) == dp_rank, (
                    f"seq {seq.seq_id} ran on DP rank {self.ran_on[seq.seq_id]}, then {dp_rank}"
                )
            assert len(scheduler.running) <= scheduler.config.max_num_seqs
            finish_step(scheduler, chunks)
        self.num_steps += 1

    def check(self) -> None:
        """Each unfinished sequence in one queue; a request's samples on one rank; each queue's
        sequences never run in arrival order behind the preempted ones at its head."""
        seen: set[int] = set()
        for dp_rank, scheduler in enumerate(self.schedulers):
            for seq in [*scheduler.running, *scheduler.waiting]:
                assert seq.seq_id not in seen and seq.dp_rank == dp_rank
                seen.add(seq.seq_id)
            fresh = [s.seq_id for s in scheduler.waiting if not s.is_preempted]
            assert fresh == sorted(fresh), f"DP rank {dp_rank}'s queue is out of order: {fresh}"
        for request in self.requests:
            ranks = {s.dp_rank for s in request.samples if not s.is_finished}
            assert len(ranks) <= 1, f"{request.request_id}'s samples on ranks {ranks}"

    def run(self, share: bool, max_steps: int = 2000) -> int:
        while any(s.has_unfinished() for s in self.schedulers):
            assert self.num_steps < max_steps, "no progress"
            self.step(share)
        for request in self.requests:
            for seq in request.samples:
                assert seq.finish_reason == "abort" or len(seq.output_token_ids) == (
                    request.params.max_tokens
                ), f"seq {seq.seq_id} ended with {len(seq.output_token_ids)} tokens"
        return self.num_steps


def _skewed(share: bool) -> Ranks:
    """Sixteen requests placed alternately: the even ones (DP rank 0) generate 40 tokens, the
    odd ones (DP rank 1) 2."""
    ranks = Ranks(2)
    for i in range(16):
        ranks.add([i + 1] * 6, 40 if i % 2 == 0 else 2)
    ranks.run(share)
    return ranks


def test_an_idle_rank_takes_the_busy_rank_s_waiting_requests():
    alone, shared = _skewed(share=False), _skewed(share=True)
    assert alone.num_moved == 0 and shared.num_moved > 0
    moved = [seq_id for seq_id, rank in shared.ran_on.items() if rank != alone.ran_on[seq_id]]
    assert moved and all(shared.ran_on[i] == 1 for i in moved)  # long ones went to rank 1
    # Rank 0 ran 8 requests of 40 tokens 4 at a time (2 waves, ~80 steps); shared, the two
    # ranks split them and finish in about one wave plus the short ones.
    assert shared.num_steps < 0.75 * alone.num_steps, (shared.num_steps, alone.num_steps)


def _waiting(num_requests: int, max_num_seqs: int) -> Ranks:
    """num_requests requests on DP rank 0, max_num_seqs of them admitted; rank 1 empty."""
    ranks = Ranks(2, max_num_seqs=max_num_seqs, budget=64)
    for i in range(num_requests):
        ranks.add_on(0, [i + 1] * 5, 30)
    ranks.schedulers[0].schedule()
    return ranks


def test_the_taker_takes_the_newest_in_arrival_order_and_stops_at_balance():
    ranks = _waiting(14, max_num_seqs=8)
    giver, taker = ranks.schedulers
    assert len(giver.running) == 8 and len(giver.waiting) == 6
    newest = [s.seq_id for s in giver.waiting]
    # 14 against 0: each move narrows the gap (the taker stays below the giver's count
    # before it), so all six move: 8 against 6.
    assert share_waiting(ranks.schedulers) == 6
    assert [s.seq_id for s in taker.waiting] == newest and not giver.waiting
    assert all(s.dp_rank == 1 for s in taker.waiting)
    assert share_waiting(ranks.schedulers) == 0  # the taker has a queue now


def test_no_move_that_would_not_narrow_the_gap():
    ranks = _waiting(3, max_num_seqs=2)
    assert share_waiting(ranks.schedulers) == 1  # 3 against 0 -> 2 against 1
    ranks = Ranks(2)
    ranks.add([1, 2, 3], 5)  # rank 0: one waiting; rank 1: nothing
    assert share_waiting(ranks.schedulers) == 0  # 1 against 0 would be 0 against 1


def test_the_taker_stays_within_max_num_seqs():
    ranks = _waiting(48, max_num_seqs=8)
    assert share_waiting(ranks.schedulers) == 8
    assert ranks.schedulers[1].num_unfinished == 8


@pytest.mark.parametrize("case", ["preempted", "sibling_running", "prefix_match"])
def test_what_ran_or_holds_blocks_never_moves(case):
    # 5 blocks: two prompts of 5 tokens leave one (prefix_match)
    ranks = Ranks(2, num_blocks=5 if case == "prefix_match" else 64, max_num_seqs=8, budget=64)
    giver = ranks.schedulers[0]
    if case == "preempted":
        for i in range(3):
            ranks.add_on(0, [i + 1] * 5, 30)
        giver.schedule()
        for seq in list(reversed(giver.running)):
            giver._preempt(seq)  # all back in the queue, the oldest at its head
        assert len(giver.waiting) == 3 and all(s.is_preempted for s in giver.waiting)
    elif case == "sibling_running":
        request = ranks.add_on(0, [9] * 5, 30, n=2)
        giver.schedule()  # the first sample runs; the second waits for its prompt's blocks
        first, second = request.samples
        assert first.status is SequenceStatus.RUNNING and list(giver.waiting) == [second]
    else:  # the only waiting sequence, at the head, holding the prefix match it found
        ranks.add_on(0, [1] * 5, 30)
        ranks.add_on(0, [2] * 5, 30)
        ranks.step(share=False)  # both run in 4 of the cache's 5 blocks
        late = ranks.add_on(0, [1] * 5, 30).samples[0]
        giver.schedule()  # it matches [1] * 4; a block for its last token would leave none free
        # for the two running: it waits
        assert late.block_table and list(giver.waiting) == [late]
    assert giver.untouched_tail() == []
    assert share_waiting(ranks.schedulers) == 0


def test_a_busiest_rank_whose_tail_cannot_move_holds_back_no_other_rank():
    """Rank 0, the busiest, has at its tail a sample waiting for its sibling's prompt (it
    cannot move); rank 1 queues untouched requests. Only the busiest rank gave, so rank 2, with
    nothing, took nothing; now it takes rank 1's two waiting (4 against 0 -> 2 against 2)."""
    ranks = Ranks(3, max_num_seqs=4, budget=64)
    for i in range(4):
        ranks.add_on(0, [i + 1] * 5, 30)
    request = ranks.add_on(0, [9] * 5, 30, n=2)
    ranks.schedulers[0].schedule()  # 4 run; the pair waits (no slot)
    ranks.schedulers[0].running[-1].status = SequenceStatus.FINISHED  # a slot for the first
    ranks.schedulers[0]._release(ranks.schedulers[0].running[-1])
    ranks.schedulers[0].schedule()  # the first sample runs, its sibling waits for its prompt
    assert list(ranks.schedulers[0].waiting) == [request.samples[1]]
    for i in range(2):
        ranks.add_on(1, [i + 20] * 5, 30)
    ranks.schedulers[1].schedule()  # 2 run
    newest = [ranks.add_on(1, [i + 30] * 5, 30).samples[0] for i in range(2)]
    assert ranks.schedulers[0].num_unfinished == 5 and ranks.schedulers[1].num_unfinished == 4
    assert ranks.schedulers[0].untouched_tail() == []
    assert share_waiting(ranks.schedulers) == 2
    assert list(ranks.schedulers[2].waiting) == newest and not ranks.schedulers[1].waiting


@pytest.mark.parametrize("seed", range(40))
def test_random_mixes_finish_and_keep_every_rule(seed):
    rng = random.Random(seed)
    ranks = Ranks(
        rng.choice([2, 3]),
        num_blocks=rng.randint(32, 64),
        budget=rng.choice([8, 16, 32]),
        max_num_seqs=rng.choice([1, 2, 4]),
    )
    arrivals = sorted(rng.randrange(60) for _ in range(rng.randint(4, 24)))
    step = 0
    while arrivals or any(s.has_unfinished() for s in ranks.schedulers):
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            prompt = [rng.randrange(1, 300) for _ in range(rng.randint(1, 20))]
            ranks.add(prompt, rng.randint(1, 40), n=rng.choice([1, 1, 2, 3]))
        if rng.random() < 0.02 and ranks.requests:
            request_id = rng.choice(ranks.requests).request_id
            for scheduler in ranks.schedulers:
                scheduler.abort({request_id})
        ranks.step(share=True)
        step += 1
        assert step < 3000, "no progress"
    ranks.run(share=True)


def test_the_bench_runs_and_sharing_fills_the_slots_left_free():
    """bench/dp_share.py end to end at a small size: its table row, and the free slots of
    ranks with nothing waiting while another's queue held work fall with sharing."""
    bench = Path(__file__).resolve().parent.parent / "bench" / "dp_share.py"
    args = ["--dp", "2", "--requests", "24", "--n", "4", "--max-num-seqs", "8", "--seeds", "3"]
    out = subprocess.run(
        [sys.executable, str(bench), *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("| 3 |")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    placed, shared = (int(x) for x in cells[5].split(" -> "))
    assert shared < placed and int(cells[6]) > 0, row
    assert int(cells[2]) <= int(cells[1]), row  # steps: shared <= placed on arrival


def test_a_taker_served_by_two_givers_keeps_arrival_order():
    """Each tail taken was put before those taken earlier, as if it were older: right while
    one rank gives, but the giver is the busiest again at each move, and with three DP ranks
    the two busiest took turns, so the taker's queue got rank 1's newest before rank 0's
    older one ([r7, r6]): its FCFS broken. Now what it takes is queued in arrival order."""
    ranks = Ranks(3, max_num_seqs=2, budget=64)
    for i, dp_rank in enumerate([0, 0, 1, 1, 0, 1, 0, 1]):
        ranks.add_on(dp_rank, [i + 1] * 5, 30)
    for scheduler in ranks.schedulers[:2]:
        scheduler.schedule()  # two run on each; r4, r6 wait on rank 0, r5, r7 on rank 1
    assert share_waiting(ranks.schedulers) == 2
    taken = [s.request.request_id for s in ranks.schedulers[2].waiting]
    assert taken == ["r6", "r7"], taken
    ranks.check()


def test_waiting_scorings_move_too():
    """A scoring's sequence holds the tokens it scores as its outputs from the start, and
    untouched_tail read any output as a sequence that had run: no scoring ever moved (an
    LLM.score or a rollout's score batch at DP > 1 got nothing from sharing), and one at the
    busiest rank's tail kept every request before it where it was. Now an untouched scoring
    moves as a generation does, and every one is scored whole where it lands."""
    ranks = Ranks(2, max_num_seqs=2, budget=64)
    giver, taker = ranks.schedulers
    for i in range(6):
        request = Request(f"s{i}", [i + 1] * 5, SamplingParams(), 0, [7] * 6)
        for seq in request.expand_samples(next(ranks.ids), TOKENIZER):
            giver.add(seq)
        ranks.requests.append(request)
    giver.schedule()  # two run; four wait
    assert [s.request.request_id for s in giver.untouched_tail()] == ["s5"]
    assert share_waiting(ranks.schedulers) == 2  # 6 against 0 -> 4 against 2
    assert [s.request.request_id for s in taker.waiting] == ["s4", "s5"]
    while any(s.has_unfinished() for s in ranks.schedulers):
        assert ranks.num_steps < 100, "no progress"
        ranks.step(share=True)
    assert all(r.samples[0].finish_reason == "scored" for r in ranks.requests)


class _CountingQueue(deque):
    """A waiting queue that counts its reads by index."""

    num_reads = 0

    def __getitem__(self, index):
        self.num_reads += 1
        return super().__getitem__(index)


def test_a_request_no_rank_may_take_costs_no_pass_over_its_samples():
    """A request of more samples than max_num_seqs can never move (the taker would pass it),
    but untouched_tail read every one of its samples first, for each rank with nothing
    waiting, at every step while it waited: n = 50,000 (within
    server.max_sequences_per_request) behind another request cost 185 ms a step at DP 8 on
    the development machine. Counted, not timed: the queue's reads by index in one call."""
    ranks = Ranks(8, max_num_seqs=4, budget=64)
    giver = ranks.schedulers[0]
    ranks.add_on(0, [1] * 5, 30)
    ranks.add_on(0, [2] * 5, 30, n=5000)
    giver.waiting = queue = _CountingQueue(giver.waiting)
    assert share_waiting(ranks.schedulers) == 0
    num_reads = queue.num_reads  # (not through the queue: a failure's report would print it)
    assert num_reads <= 2 * len(ranks.schedulers), num_reads
