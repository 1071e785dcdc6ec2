"""Scheduler: continuous batching with chunked prefill, prefix caching and lossless preemption.

Each step packs up to `max_num_batched_tokens` tokens from at most `max_num_seqs` sequences:
running sequences first (a decode token, or the next chunk of their prefill), then waiting ones
in arrival order. When KV blocks run out, the newest running sequence is preempted: its blocks
are freed and it goes back to the front of the queue with every token it has, to be recomputed
once blocks for all of them are free (which gives the same bits, since every kernel is
batch-invariant). Nothing is dropped.
Every sequence that leaves the running set (finished, aborted, preempted) has its id listed in
`released` until the engine collects it, so the worker can drop its copy. `is_lookahead` tells
the worker the next step is likely the decode of this one's sequences (overlap_decode); with
`can_hold_admission` a waiting sequence is then held back one step where admitting it would
waste the step launched ahead.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from moe_runtime.config import SchedulerConfig
from moe_runtime.engine.block_manager import ROOT_KEY_ID, BlockManager
from moe_runtime.engine.request import Sequence, SequenceStatus
from moe_runtime.sampling_params import ends_by_length, finish_reason, stop_token_reason
from moe_runtime.worker.step_input import SampleResult


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        eos_token_ids: tuple[int, ...],
        can_hold_admission: bool = False,
    ) -> None:
        """eos_token_ids: the ids that end a sample as EOS (ModelConfig.eos_token_ids).
        can_hold_admission: with overlap_decode, a decode lookahead may be asked for while
        sequences wait, and their admission then held a step where it would waste it (only
        where a request's bits ignore its batch: invariant mode)."""
        self.config = config
        self.blocks = block_manager
        self.eos_token_ids = eos_token_ids
        self.can_hold_admission = can_hold_admission
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Ids, not sequences: an idle engine collects none, and a finished request's whole
        # output (its tokens, logprobs, routed experts) would live on until the next step.
        self.released: list[int] = []
        self.num_preemptions = 0
        self.num_held_admissions = 0  # steps that held the waiting sequences back
        # Whether the last step's worker may launch the next decode step ahead (its input's
        # `lookahead`): nothing waits, or what waits cannot be admitted before a sequence ends.
        self.is_lookahead = False
        # Whether it did (its output's `is_ahead`, set by the engine after the step).
        self.is_ahead = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        # Why hold: the last step's worker launched the next decode of its sequences ahead,
        # used only if this step is exactly that one, and the sequences released since then
        # freed room a waiting one would take. Held one step (the launched step is used and
        # none is launched from it), the waiting ones join the next. Invariant mode only: a
        # request's bits ignore its batch, so the step's delay moves none.
        is_held = self.can_hold_admission and self.is_ahead
        is_held = is_held and bool(self.released and self.waiting and self.running)
        self.num_held_admissions += is_held
        chunks = self._schedule_running()
        # Why after every running chunk has its blocks: a lookahead slot taken first could take
        # the block a later sequence's chunk needed, which cost that one a preemption.
        for scheduled in chunks:
            self._take_lookahead_slot(scheduled.seq, scheduled.start + scheduled.num_tokens)
        waits_for_sibling = not is_held and self._admit_waiting(chunks)
        # What still waits could not be admitted, and nothing but a sequence's end changes that
        # (a sample waiting for its sibling's prompt is admitted as soon as that is in).
        self.is_lookahead = (
            bool(self.config.overlap_decode)
            and not is_held
            and not waits_for_sibling
            and (not self.waiting or self.can_hold_admission)
        )
        return chunks

    def _schedule_running(self) -> list[ScheduledChunk]:
        """A chunk for each running sequence, oldest first, while the budget lasts; one that
        finds no blocks preempts the newest (itself, if it is the newest)."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            chunk = self._chunk_for(seq, budget)
            while not self.blocks.allocate(seq.block_table, seq.num_computed_tokens + chunk):
                if self.release_head_match():
                    continue  # a match that could not run is cache, not work: it goes first
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, chunk))
                budget -= chunk
        return chunks

    def _admit_waiting(self, chunks: list[ScheduledChunk]) -> bool:
        """Admit waiting sequences in arrival order with the budget the running ones left,
        appending their chunks; the first that cannot be admitted stops the rest (FCFS).
        -> whether the head waits for its sibling's prompt."""
        budget = self.config.max_num_batched_tokens - sum(c.num_tokens for c in chunks)
        prefilling = {id(seq.request) for seq in self.running if self._computes_prompt(seq)}
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self._waits_for_sibling(seq, prefilling):
                return True  # admitted once the sibling's prompt is in: no end
            if not seq.block_table:
                # A scoring sequence must compute every position it scores: match its prompt only.
                known = seq.prompt_token_ids if seq.is_score else seq.token_ids
                seq.block_table = self.blocks.match_prefix(known)
                seq.num_computed_tokens = len(seq.block_table) * self.blocks.block_size
            chunk = self._chunk_for(seq, budget)
            if (
                chunk == 0
                or not self._can_admit(seq, chunk)
                or not self.blocks.allocate(seq.block_table, seq.num_computed_tokens + chunk)
            ):
                break  # it keeps its prefix match while it heads the queue (see _preempt)
            self._take_lookahead_slot(seq, seq.num_computed_tokens + chunk)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if self._computes_prompt(seq):
                prefilling.add(id(seq.request))
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, chunk))
            budget -= chunk
        return False

    def _waits_for_sibling(self, seq: Sequence, prefilling: set[int]) -> bool:
        """Whether seq, a sample of a request of n, waits until a sibling running now has
        computed the prompt's full blocks: it then finds them cached and computes only the
        prompt's last block, where admitted beside it each sample computed the whole prompt
        (n times the work). A prefix hit gives the bits of a miss, so waiting moves none.
        prefilling: id() of each request with a running sample that has not computed them
        (_computes_prompt). Why a set built from the running list, not a pass over seq's
        siblings: an admission step read every sibling of each sample it let in, n = 50,000
        with 256 let in cost 1.2 s of the step."""
        if not self.blocks.enable_prefix_caching or seq.is_score or seq.output_token_ids:
            return False
        return id(seq.request) in prefilling  # (seq waits: it is none of the running ones)

    def _computes_prompt(self, seq: Sequence) -> bool:
        """Whether running seq, a generating sample, has not yet computed its prompt's full
        blocks that match_prefix could give a sibling (it leaves one token to compute)."""
        if seq.is_score:
            return False
        matchable = len(seq.prompt_token_ids) - 1
        matchable -= matchable % self.blocks.block_size
        return seq.num_computed_tokens < matchable

    def _can_admit(self, seq: Sequence, chunk: int) -> bool:
        """Whether admitting seq's chunk (all its tokens if it was preempted) leaves
        scheduler.admission_reserve free blocks (default 1) for each running sequence. Why the
        reserve: admitted into the last free blocks, a sequence took the ones the running
        sequences grow into next, and the newest was preempted a few steps later, its whole
        context computed again (bench/admission.py: with a cache too small for the load,
        20-42% more tokens computed than the sequences hold; 1-10% with a block each). Why
        all of a preempted one's tokens: let in as soon as its first chunk fit, it was
        preempted again at its next chunk, step after step. What either needs comes free only
        as sequences end (or are preempted): no request behind it is admitted meanwhile, and
        with nothing running there is nothing to reserve for (an empty cache holds a sequence
        of max_model_len: checked at start)."""
        num_tokens = seq.num_tokens if seq.is_preempted else seq.num_computed_tokens + chunk
        keep_free = self.config.admission_reserve * len(self.running)
        return self.blocks.can_allocate(seq.block_table, num_tokens, keep_free)

    def _take_lookahead_slot(self, seq: Sequence, num_slots: int) -> None:
        """With overlap_decode, a chunk of seq that ends a generating sequence's known tokens
        (its slots: num_slots) also gets the slot of its next decode position when a block is
        free, never by a preemption: the worker's lookahead writes there before this scheduler
        sees the step's token. Not where the step's token ends it by length (the lookahead
        leaves it out): that block, taken for nothing, cost a newer sequence its next chunk."""
        config = self.config
        if (
            config.overlap_decode
            and not seq.is_score
            and num_slots == seq.num_tokens
            and not ends_by_length(
                seq.params, seq.num_output_tokens + 1, num_slots + 1, config.max_model_len
            )
        ):
            self.blocks.allocate(seq.block_table, num_slots + 1)

    def _chunk_for(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed_tokens
        if self.config.enable_chunked_prefill:
            return min(remaining, budget)
        return remaining if remaining <= budget else 0

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status, seq.is_preempted = SequenceStatus.WAITING, True
        # Why: only the queue's head may hold blocks as it waits (its prefix match, kept so it
        # is not walked again every step). Behind `seq` it would starve it, with nothing
        # running to free a block: it gives the match back and matches again when first.
        self.release_head_match()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def release_head_match(self) -> bool:
        """The queue's head gives back the prefix match it holds while it waits (the blocks'
        references, and their count as hits: it computed nothing with them); -> whether it
        held one. Also when the weights change: those blocks hold the old weights' KV."""
        if not (self.waiting and self.waiting[0].block_table):
            return False
        head = self.waiting[0]
        self.blocks.unmatch(head.block_table)
        head.block_table, head.num_computed_tokens = [], 0
        return True

    def update(self, chunks: list[ScheduledChunk], samples: dict[int, SampleResult]) -> None:
        """Advance the scheduled sequences past this step, ending those that finish."""
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_tokens
            first = seq.num_committed_blocks
            if seq.num_computed_tokens // self.blocks.block_size > first:
                # Only the blocks filled since the last commit: the cost stays flat in context.
                seq.num_committed_blocks, seq.commit_parent = self.blocks.commit(
                    seq.block_table,
                    seq.tokens_from(first * self.blocks.block_size),
                    seq.num_computed_tokens,
                    first,
                    seq.commit_parent,
                )
            if seq.is_score:
                if seq.num_computed_tokens == seq.num_tokens:
                    self.finish(seq, "scored" if seq.non_finite_at is None else "error")
                continue
            sample = samples.get(seq.seq_id)
            if sample is None:
                continue
            if is_non_finite(sample):
                seq.non_finite_at = len(seq.output_token_ids)
                self.finish(seq, "error")
                continue
            seq.output_token_ids.append(sample.token_id)
            seq.output_logprobs.append(sample.logprob)
            seq.output_top_logprobs.append(sample.top_logprobs)
            reason = finish_reason(
                seq.params,
                sample.token_id,
                len(seq.output_token_ids),
                seq.num_tokens,
                self.eos_token_ids,
                self.config.max_model_len,
            )
            if reason == "stop":
                stop = stop_token_reason(seq.params, sample.token_id, self.eos_token_ids)
                self.finish(seq, reason, stop)
            elif reason is not None:
                self.finish(seq, reason)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a running sequence now (a stop token or string, the length, an abort, "error" for
        logits that were not finite);
        stop_reason: the stop token id or string that ended it (None: EOS, or not a stop)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Take a running sequence off the running list, its blocks freed and its commit chain
        reset; the next step names it to the workers (collect_released)."""
        self.running.remove(seq)
        if seq.leave_worker():
            self.released.append(seq.seq_id)
        self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.num_committed_blocks, seq.commit_parent = 0, ROOT_KEY_ID

    def collect_released(self) -> list[int]:
        """The ids of the sequences released since the last call, whose worker copies the next
        step drops."""
        released, self.released = self.released, []
        return released

    def untouched_tail(self) -> list[Sequence]:
        """The samples of the request at the queue's tail (in arrival order) if none of them
        has run or holds a block, and they are no more than max_num_seqs: what another DP
        rank may take over (share_waiting); else []. A request whose sibling runs, or a
        preempted sequence, stays where its blocks are."""
        if not self.waiting:
            return []
        samples = self.waiting[-1].request.samples
        # Why max_num_seqs: no rank may take more; each of their samples was read first, for
        # each rank with nothing waiting at every step (n = 50,000: 185 ms a step at DP 8).
        if len(samples) > min(len(self.waiting), self.config.max_num_seqs):
            return []
        tail = [self.waiting[-i] for i in range(len(samples), 0, -1)]
        is_untouched = all(
            seq is sample
            and seq.status is SequenceStatus.WAITING
            # (a scoring's outputs are the tokens it scores, there before it runs)
            and not (seq.is_preempted or seq.block_table)
            and not (seq.output_token_ids and not seq.is_score)
            and seq.num_computed_tokens == 0
            for seq, sample in zip(tail, samples, strict=True)
        )
        return tail if is_untouched else []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def abort(self, request_ids: set[str]) -> None:
        """Drop every sequence of the requests (e.g. clients went away); frees their blocks.
        One pass over the queues, however many requests (a client leaving a request of
        thousands of prompts must not hold the engine's thread for seconds)."""
        for seq in [s for s in self.running if s.request.request_id in request_ids]:
            self.finish(seq, "abort")
        kept: list[Sequence] = []
        for seq in self.waiting:
            if seq.request.request_id not in request_ids:
                kept.append(seq)
                continue
            if seq.block_table:  # a prefix match it never ran with: not a hit
                self.blocks.unmatch(seq.block_table)
                seq.block_table, seq.num_computed_tokens = [], 0
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        if len(kept) < len(self.waiting):
            self.waiting.clear()
            self.waiting.extend(kept)


def is_non_finite(sample: SampleResult) -> bool:
    """Whether the sample's logits row was not finite (a NaN or +inf in it): its chosen logprob
    is then NaN, as log_softmax spreads either over the whole row. Why the logprob: the sampler
    returns it for every row in the one copy to the host a step makes anyway, so the check
    costs no kernel, copy or sync. A -inf logprob (a token of no probability: a -inf logit, a
    token filtered out in processed logprobs) is no fault: its sample goes on."""
    return math.isnan(sample.logprob)


def share_waiting(schedulers: list[Scheduler]) -> int:
    """Move untouched requests (Scheduler.untouched_tail) from the tail of the queue of the
    busiest DP rank that has one (the most unfinished sequences) to each rank that has nothing
    waiting, while the move narrows the gap and the taker stays within max_num_seqs; ->
    sequences moved. Why: a request's DP rank is chosen as it arrives (LLMEngine._enqueue), so
    a rank whose requests ended early ran empty lockstep steps while another's queue still
    held work it could have taken (a rollout's last requests waited behind one rank's long
    ones). The newest move (FCFS kept: the taker's queue was empty, and takes them in arrival
    order), nothing that has run or holds blocks moves, and in invariant mode which rank
    serves a request changes no bit of it."""
    num_moved = 0
    by_load = sorted(enumerate(schedulers), key=lambda p: p[1].num_unfinished)  # stable
    for dp_rank, taker in by_load:
        if taker.waiting:
            continue
        taken: list[Sequence] = []
        while (move := _next_move(schedulers, taker, len(taken))) is not None:
            giver, tail = move
            for _ in tail:
                giver.waiting.pop()
            taken += tail
        # Arrival order (seq ids are given in it): the busiest rank may change between two
        # moves, so a later tail is not always older than the ones taken before it.
        taken.sort(key=lambda seq: seq.seq_id)
        for seq in taken:
            seq.dp_rank = dp_rank
        taker.waiting.extend(taken)
        num_moved += len(taken)
    return num_moved


def _next_move(
    schedulers: list[Scheduler], taker: Scheduler, num_taken: int
) -> tuple[Scheduler, list[Sequence]] | None:
    """(giver, its untouched tail) for the taker, which has taken num_taken sequences this
    step: the busiest rank (the lowest on ties) whose tail narrows the gap and fits the taker,
    or None. Why not the busiest alone: a busiest rank whose tail cannot move (a sample waiting
    for its sibling's prompt, a preempted sequence) held back every other rank's queue."""
    load = taker.num_unfinished + num_taken
    for giver in sorted(schedulers, key=lambda s: -s.num_unfinished):  # stable
        if giver.num_unfinished <= load + 1:
            return None  # no busier rank left: no move narrows a gap
        tail = giver.untouched_tail()  # (never the taker's: it is busier)
        after = load + len(tail)
        if tail and after < giver.num_unfinished and after <= taker.config.max_num_seqs:
            return giver, tail
    return None
