"""Lookahead: the decode step one rank launches before the engine asks for it (overlap_decode).

Owns the launched step (its host batch, sampling inputs and queued sampling) and the counts of
steps it served, dropped and queued before the read. After a step whose every sequence
sampled it launches the decode of the samples that go on: before the read, fed the sampled
ids on the device, where nothing it needs waits on the read; otherwise after it. `take` hands
it to the next step only when that step's batch and sampling inputs equal the launched ones
element for element (the same computation, so the same bits); otherwise it is dropped. It
must not launch for a scoring or mid-prefill sequence, nor write a KV slot but each sample's
next position, in a block the sample holds that is not full (never a cached prefix).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from moe_runtime.forward_batch import ForwardBatch
from moe_runtime.sampling_params import ends_by_length, finish_reason
from moe_runtime.worker.sampler import SampleLaunch, Sampler
from moe_runtime.worker.sequence_state import Chunk, SampleArgs, SequenceState, sample_args_of

# The runner's batch builder: chunks -> (host batch, per logits row its (chunk, position)).
BuildBatch = Callable[[list[Chunk]], tuple[ForwardBatch, list[tuple[Chunk, int]]]]
# The runner's model call: (host batch, its chunks, token ids on the device or None) -> logits.
Forward = Callable[[ForwardBatch, list[Chunk], torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class _LaunchedStep:
    """A decode step launched ahead: its host inputs and its queued sampling."""

    batch: ForwardBatch
    sample_args: SampleArgs
    launched: SampleLaunch


@dataclass(frozen=True)
class Prepared:
    """A lookahead's host inputs built before its tokens are known (placeholders in
    batch.token_ids, filled in place once they are)."""

    batch: ForwardBatch
    sample_args: SampleArgs


def same_batch(a: ForwardBatch, b: ForwardBatch) -> bool:
    """Every tensor of the two batches equal in shape and elements."""
    return all(torch.equal(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))


class Lookahead:
    """One rank's decode step launched ahead, at most one at a time, and its counters."""

    def __init__(
        self,
        sampler: Sampler,
        build_batch: BuildBatch,
        forward: Forward,
        *,
        block_size: int,
        is_enabled: bool,
        is_invariant: bool,
        eos_token_ids: tuple[int, ...],
        max_model_len: int | None,
    ) -> None:
        """build_batch, forward: the runner's, for the steps launched ahead. is_enabled: steps
        may be launched ahead (else `prepare` and `launch` launch none). is_invariant: the
        kernels are batch-invariant, so a lookahead may keep the rows of the samples that go
        on. eos_token_ids, max_model_len: end samples as the scheduler does, so a lookahead
        leaves out those that end."""
        self._sampler, self._build_batch, self._forward = sampler, build_batch, forward
        self.block_size, self.is_enabled, self.is_invariant = block_size, is_enabled, is_invariant
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self._step: _LaunchedStep | None = None
        self.num_hits = 0  # steps served by a lookahead (tests check the path ran)
        self.num_misses = 0  # lookaheads dropped: the step was another one
        self.num_unread_launches = 0  # lookaheads queued before the read (tests check it ran)

    @property
    def is_launched(self) -> bool:
        """Whether a launched step waits for the next `take`."""
        return self._step is not None

    def prepare(self, chunks: list[Chunk]) -> Prepared | None:
        """The next decode step of the sequences of `chunks` that go on whatever they sample
        (not ended by length: those `launch_unread` leaves out) but its tokens (placeholders in
        batch.token_ids, chunk order), or None where none would be launched from it: a
        sequence scores, none goes on, or one that goes on needs a block its table lacks. Why
        not the ones ending by length: the scheduler gives them no next block."""
        if not self.is_enabled or not chunks:
            return None
        seqs = [chunk.seq for chunk in chunks]
        going_on = [seq for seq in seqs if not self._ends_by_length(seq)]
        if any(seq.is_score for seq in seqs) or not going_on:
            return None
        if not all(self._holds_next_block(seq) for seq in going_on):
            return None
        return Prepared(*self._decode_batch(going_on, [0] * len(going_on)))

    def _holds_next_block(self, seq: SequenceState) -> bool:
        """Whether seq's table has the block of the position after its last token (the one
        a lookahead writes)."""
        return len(seq.token_ids) // self.block_size < len(seq.block_table)

    def _decode_batch(
        self, seqs: list[SequenceState], token_ids: list[int]
    ) -> tuple[ForwardBatch, SampleArgs]:
        """The decode step of seqs fed token_ids (one each), as the engine's next step will
        build it once it appends them; the sequences are left as they were."""
        for seq, token_id in zip(seqs, token_ids, strict=True):
            seq.token_ids.append(token_id)
        try:
            batch, _ = self._build_batch([Chunk(seq, len(seq.token_ids) - 1, 1) for seq in seqs])
            return batch, sample_args_of(seqs)
        finally:
            for seq in seqs:
                seq.token_ids.pop()

    def launch_unread(
        self,
        chunks: list[Chunk],
        seqs: list[SequenceState],
        prepared: Prepared,
        launched: SampleLaunch,
    ) -> list[int] | None:
        """Before this step's samples are read: launch the next decode step of the sequences
        of `chunks` that go on whatever they sampled, fed the sampled ids where they are, so
        the GPU needs no host between the steps (prepared: prepare(chunks), their step with
        placeholder tokens, which leaves out a sample that ends by length with this token). ->
        the rows of seqs it covers, or None when none was launched. seqs: the sampled rows'
        sequences, which must be the chunks' in order (a chunk that leaves its prompt
        unfinished samples nothing)."""
        if [s.seq_id for s in seqs] != [c.seq.seq_id for c in chunks]:
            return None
        rows = [i for i, seq in enumerate(seqs) if not self._ends_by_length(seq)]
        if not rows:
            return None
        fed = launched if len(rows) == len(seqs) else Sampler.rows_of(launched, rows)
        self._run_ahead(
            prepared.batch, prepared.sample_args, [seqs[i] for i in rows],
            self._sampler.token_ids(fed),
        )  # fmt: skip
        self.num_unread_launches += 1
        return rows

    def _run_ahead(
        self,
        batch: ForwardBatch,
        sample_args: SampleArgs,
        seqs: list[SequenceState],
        token_ids: torch.Tensor | None,
    ) -> None:
        """Launch the decode step `batch` of seqs (their next position each) and its sampling;
        token_ids: the rows' ids on the device in place of batch.token_ids (None: those)."""
        ahead = [Chunk(seq, len(seq.token_ids), 1) for seq in seqs]  # pure decode chunks
        logits = self._forward(batch, ahead, token_ids)
        self._step = _LaunchedStep(batch, sample_args, self._sampler.launch(logits, *sample_args))

    def settle_unread(self, seqs: list[SequenceState], tokens: list[int]) -> None:
        """After the read, for a lookahead `launch_unread` queued for these seqs (the rows it
        covers) and the tokens they sampled: its host batch gets the tokens it was fed (what
        the next step's batch is compared with). Where a sample ended with its token (a stop
        token, EOS), invariant mode keeps the others' rows: the batch-invariant kernels gave
        each row the bits it gets in a step without the ended ones. Fast mode drops it (a
        row's bits there follow the batch)."""
        ahead = self._step
        going_on = [
            i for i, (s, t) in enumerate(zip(seqs, tokens, strict=True)) if not self._ends(s, t)
        ]
        if len(going_on) == len(seqs):
            ahead.batch.token_ids.copy_(torch.tensor(tokens, dtype=torch.int64))
            return
        if not going_on or not self.is_invariant:
            self.drop()
            return
        batch, sample_args = self._decode_batch(
            [seqs[i] for i in going_on], [tokens[i] for i in going_on]
        )
        self._step = _LaunchedStep(batch, sample_args, Sampler.rows_of(ahead.launched, going_on))

    @staticmethod
    def _next_counts(seq: SequenceState) -> tuple[int, int]:
        """(output tokens, tokens) of seq once its next token (not yet in seq) is."""
        num_tokens = len(seq.token_ids) + 1
        return num_tokens - seq.num_prompt_tokens, num_tokens

    def _ends_by_length(self, seq: SequenceState) -> bool:
        """Whether seq ends with its next token, whatever that is (max_tokens, the context)."""
        return ends_by_length(seq.params, *self._next_counts(seq), self.max_model_len)

    def _ends(self, seq: SequenceState, token_id: int) -> bool:
        """Whether seq ends once token_id (just sampled, not yet in seq) is its newest."""
        counts, eos, max_len = self._next_counts(seq), self.eos_token_ids, self.max_model_len
        return finish_reason(seq.params, token_id, *counts, eos, max_len) is not None

    def launch(
        self, chunks: list[Chunk], token_ids: dict[int, int], prepared: Prepared | None = None
    ) -> None:
        """After a step of `chunks` whose every sequence sampled (token_ids: seq_id -> the
        token it sampled): launch the next decode step of the samples that go on (their new
        token each) and its sampling, without waiting. prepared: prepare(chunks), taken when
        every sequence goes on (its tokens filled in).
        Nothing is launched when a sequence scores or is mid-prefill (the next step is not a
        pure decode) or when a new position needs a block the table lacks (the engine
        appends it first, so the next batch would differ anyway)."""
        self._step = None
        if not self.is_enabled or not chunks:
            return
        going_on = []
        for chunk in chunks:
            seq, token_id = chunk.seq, token_ids.get(chunk.seq.seq_id)
            if seq.is_score or token_id is None:
                return
            if self._ends(seq, token_id):
                continue
            if not self._holds_next_block(seq):
                return
            going_on.append((seq, token_id))
        if not going_on:
            return
        seqs, tokens = [seq for seq, _ in going_on], [token_id for _, token_id in going_on]
        if prepared is not None and len(going_on) == len(chunks):
            batch, sample_args = prepared.batch, prepared.sample_args
            batch.token_ids.copy_(torch.tensor(tokens, dtype=torch.int64))
        else:
            batch, sample_args = self._decode_batch(seqs, tokens)
        self._run_ahead(batch, sample_args, seqs, None)

    def take(self, batch: ForwardBatch, sample_args: SampleArgs) -> SampleLaunch | None:
        """The launched step's sampling if it computed exactly this step, else None (dropped).
        Either way nothing stays launched."""
        ahead, self._step = self._step, None
        if ahead is None:
            return None
        if ahead.sample_args == sample_args and same_batch(ahead.batch, batch):
            self.num_hits += 1
            return ahead.launched
        self.num_misses += 1
        return None

    def drop(self) -> None:
        """Forget a launched step (no step follows, or weights or experts are about to
        change)."""
        if self._step is not None:
            self._step = None
            self.num_misses += 1
