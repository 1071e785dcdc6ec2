"""ModelRunner: turns a step's sequences into a ForwardBatch, runs the model, samples.

Owns the model, the per-layer latent KV caches, the sampler of one rank and the worker's copy
of every sequence it serves (`SequenceState`, kept up to date from the wire format's deltas).
With expert parallelism (`must_join`), a step with no sequences still runs the model on zero
tokens, because every MoE layer is a collective all ranks join. Rows that need logits are the
last token of a chunk that completes its sequence (a new token is sampled) and, for scoring
sequences, every position whose next token is a scored one. With graph batch sizes (cuda only)
pure decode steps go through a DecodeGraphRunner, and the cache holds one more block than the
BlockManager is given: the scratch block the graphs' padding rows write to.

With `overlap` (one rank), a step whose every sequence sampled may launch the next one ahead:
the decode of the samples that go on, fed the tokens just sampled, with its sampling, while
the host returns the results and the engine schedules. Where nothing it needs waits on the
read (`_launch_unread`) it is queued before the read, fed the sampled ids on the device, so
the GPU goes from one step's sampling into the next; otherwise after it (`launch_lookahead`).
The next `step` uses it only when its batch and sampling inputs equal the launched ones
element for element, so its bits are those of the same computation; otherwise it is dropped
and the step runs as usual. A dropped lookahead wrote only the KV slot of each sample's next
position, in a block the sample holds and that is not full (never a cached prefix); whoever
writes that slot next runs after it on the same stream.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from kernels import OpTable
from moe_runtime.forward_batch import ForwardBatch, HostCopy, device_to_host, host_to_device
from moe_runtime.model.deepseek import DeepseekForCausalLM
from moe_runtime.sampling_params import SamplingParams, ends_by_length, finish_reason
from moe_runtime.worker.cuda_graphs import DecodeGraphRunner
from moe_runtime.worker.sampler import SampleLaunch, Sampler
from moe_runtime.worker.step_input import NewSequence, StepOutput

SampleArgs = tuple[list[SamplingParams], list[int], list[int]]  # params, seeds, output positions


@dataclass(eq=False)
class SequenceState(NewSequence):
    """The worker's copy of one sequence, updated in place from each step's deltas."""

    block_table: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, new: NewSequence) -> SequenceState:
        state = {f.name: getattr(new, f.name) for f in fields(new)}
        return cls(**{**state, "token_ids": list(new.token_ids)})


@dataclass(frozen=True)
class Chunk:
    """Positions [start, start + num_tokens) of one sequence, computed this step."""

    seq: SequenceState
    start: int
    num_tokens: int


@dataclass(frozen=True)
class _Lookahead:
    """A decode step launched ahead: its host inputs and its queued sampling."""

    batch: ForwardBatch
    sample_args: SampleArgs
    launched: SampleLaunch


@dataclass(frozen=True)
class _Prepared:
    """A lookahead's host inputs built before its tokens are known (placeholders in
    batch.token_ids, filled in place once they are)."""

    batch: ForwardBatch
    sample_args: SampleArgs


@dataclass(frozen=True)
class _Routed:
    """Sampled positions' routed experts on their way to the host."""

    seq_ids: list[int]
    ids: HostCopy  # [R, L_moe, K] int32

    def wait(self) -> dict[int, np.ndarray]:
        """seq_id -> [L_moe, K] int32 logical experts of its sampled position."""
        ids = self.ids.wait().numpy()
        return {seq_id: ids[j] for j, seq_id in enumerate(self.seq_ids)}


def same_batch(a: ForwardBatch, b: ForwardBatch) -> bool:
    """Every tensor of the two batches equal in shape and elements."""
    return all(torch.equal(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))


class ModelRunner:
    def __init__(
        self,
        model: DeepseekForCausalLM,
        ops: OpTable,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        must_join: bool = False,
        graph_batch_sizes: tuple[int, ...] = (),
        max_blocks_per_seq: int = 0,
        overlap: bool = False,
        max_model_len: int | None = None,
    ) -> None:
        """graph_batch_sizes: CUDA-graph decode batch sizes (empty: always eager); block
        tables of graphed steps are padded to max_blocks_per_seq columns. overlap: decode
        steps may be launched ahead (one rank only); max_model_len ends samples as the
        scheduler does, so a lookahead leaves out those that end."""
        if overlap and must_join:
            raise ValueError("a decode lookahead needs one rank: every MoE layer is a collective")
        cfg = model.config
        self.model, self.ops, self.device = model, ops, device
        self.block_size, self.must_join = block_size, must_join
        self.num_blocks = num_blocks  # blocks the BlockManager may hand out
        num_scratch = 1 if graph_batch_sizes else 0
        self.kv_caches = [
            torch.zeros(
                num_blocks + num_scratch,
                block_size,
                cfg.latent_dim,
                dtype=model.dtype,
                device=device,
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        self.sampler = Sampler(ops.log_softmax, ops.cumsum)
        self.overlap, self.max_model_len = overlap, max_model_len
        self.eos_token_id = cfg.eos_token_id
        self._lookahead: _Lookahead | None = None
        self._slot_counts: HostCopy | None = None
        self.num_lookahead_hits = 0  # steps served by a lookahead (tests check the path ran)
        self.num_lookahead_misses = 0  # lookaheads dropped: the step was another one
        self.num_unread_launches = 0  # lookaheads queued before the read (tests check it ran)
        self.graphs: DecodeGraphRunner | None = None
        if graph_batch_sizes:
            if device.type != "cuda":
                raise ValueError(f"kernels.cuda_graphs needs a cuda device, got {device}")
            self.graphs = DecodeGraphRunner(
                model, self.kv_caches, graph_batch_sizes, max_blocks_per_seq, num_blocks
            )

    def step(self, chunks: list[Chunk], lookahead: bool = False) -> StepOutput:
        """Run the step; lookahead: nothing waits on the engine's side, so once the samples
        are on the host the next decode step may be launched (`launch_lookahead`) before
        their results are built."""
        out = StepOutput()
        if not chunks and not self.must_join:
            self.drop_lookahead()
            self._slot_counts = None
            return out
        batch, row_owners = self._build_batch(chunks)
        gen_rows = [i for i, (chunk, _) in enumerate(row_owners) if not chunk.seq.is_score]
        seqs = [row_owners[i][0].seq for i in gen_rows]
        sample_args = self._sample_args(seqs)
        launched = self._take_lookahead(batch, sample_args)
        if launched is None:
            logits = self._forward(batch, chunks)
            if gen_rows:
                gen_logits = logits
                if len(gen_rows) < logits.shape[0]:
                    # A list index is a pageable copy that would wait for the step's GPU work.
                    gen_logits = logits[host_to_device(gen_rows, logits.device)]
                launched = self.sampler.launch(gen_logits, *sample_args)
        self._queue_slot_counts()  # before the wait below, which it then shares
        if gen_rows:
            # Why before the wait: all of the next step's batch but its tokens is known now,
            # so the host builds it while the GPU runs, not between the read and the launch.
            prepared = self._prepare_lookahead(chunks) if lookahead else None
            # Before any lookahead, whose replay refills the captured routing it reads.
            routed = self._queue_routed_experts(batch, gen_rows, seqs, launched)
            unread = None
            if prepared is not None:
                unread = self._launch_unread(chunks, seqs, prepared, launched)
            rows = self.sampler.read(launched)
            out.routed = routed.wait() if routed is not None else {}
            tokens = [int(row[0]) for row in rows]
            if unread is not None:
                self._settle_unread([seqs[i] for i in unread], [tokens[i] for i in unread])
            elif lookahead:
                by_seq = {s.seq_id: t for s, t in zip(seqs, tokens, strict=True)}
                self.launch_lookahead(chunks, by_seq, prepared)
            results = self.sampler.results(launched, rows)
            out.samples.update({s.seq_id: r for s, r in zip(seqs, results, strict=True)})
        score_rows = [i for i, (chunk, _) in enumerate(row_owners) if chunk.seq.is_score]
        if score_rows:  # never a lookahead's step: it has no scoring rows
            logprobs = self.ops.log_softmax(logits[score_rows]).cpu()
            for row, i in enumerate(score_rows):
                chunk, position = row_owners[i]
                next_token = chunk.seq.token_ids[position + 1]
                out.scored.setdefault(chunk.seq.seq_id, []).append(logprobs[row, next_token].item())
                chunk.seq.num_scored += 1
        out.is_ahead = self._lookahead is not None
        return out

    def _queue_slot_counts(self) -> None:
        """Queue the copy of every MoE layer's slot counts of this step to the host (page-
        locked on CUDA, not waited for: `slot_counts` waits for it)."""
        layers = self.model.moe_layers
        if not layers:
            self._slot_counts = None
            return
        self._slot_counts = device_to_host(torch.stack([moe.last_slot_counts for moe in layers]))

    def slot_counts(self) -> np.ndarray | None:
        """[MoE layer][local slot] rows the last step served (its real rows), or None when it
        ran no model. Waits for the copy (already done once the step sampled)."""
        if self._slot_counts is None:
            return None
        return self._slot_counts.wait().numpy()

    def _forward(
        self, batch: ForwardBatch, chunks: list[Chunk], token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The model on a host batch: a graph replay for a pure decode step it fits, else
        eager. token_ids: the rows' ids on the device, read in place of batch.token_ids.
        -> fp32 logits of batch.logits_indices."""
        is_pure_decode = all(c.num_tokens == 1 and not c.seq.is_score for c in chunks)
        if self.graphs is not None and self.graphs.can_run(is_pure_decode, batch):
            return self.graphs.run(batch, token_ids)
        device_batch = batch.to(self.device)
        if token_ids is not None:
            device_batch = replace(device_batch, token_ids=token_ids)
        return self.model(device_batch, self.kv_caches)

    @staticmethod
    def _sample_args(seqs: list[SequenceState]) -> SampleArgs:
        positions = [len(s.token_ids) - s.num_prompt_tokens for s in seqs]
        return [s.params for s in seqs], [s.seed for s in seqs], positions

    def _prepare_lookahead(self, chunks: list[Chunk]) -> _Prepared | None:
        """The next decode step of every sequence of `chunks` but its tokens (placeholders
        in batch.token_ids, chunk order), or None where launch_lookahead would not take it
        whole: a sequence scores, or its next position needs a block the table lacks."""
        if not self.overlap or not chunks:
            return None
        seqs = [chunk.seq for chunk in chunks]
        if any(seq.is_score or not self._holds_next_block(seq) for seq in seqs):
            return None
        return _Prepared(*self._lookahead_batch(seqs, [0] * len(seqs)))

    def _holds_next_block(self, seq: SequenceState) -> bool:
        """Whether seq's table has the block of the position after its last token (the one
        a lookahead writes)."""
        return len(seq.token_ids) // self.block_size < len(seq.block_table)

    def _lookahead_batch(
        self, seqs: list[SequenceState], token_ids: list[int]
    ) -> tuple[ForwardBatch, SampleArgs]:
        """The decode step of seqs fed token_ids (one each), as the engine's next step will
        build it once it appends them; the sequences are left as they were."""
        for seq, token_id in zip(seqs, token_ids, strict=True):
            seq.token_ids.append(token_id)
        try:
            batch, _ = self._build_batch([Chunk(seq, len(seq.token_ids) - 1, 1) for seq in seqs])
            return batch, self._sample_args(seqs)
        finally:
            for seq in seqs:
                seq.token_ids.pop()

    def _launch_unread(
        self,
        chunks: list[Chunk],
        seqs: list[SequenceState],
        prepared: _Prepared,
        launched: SampleLaunch,
    ) -> list[int] | None:
        """Before this step's samples are read: launch the next decode step of the sequences
        of `chunks` that go on whatever they sampled, fed the sampled ids where they are, so
        the GPU needs no host between the steps (prepared: the step of all of them, placeholder
        tokens; a sample that ends by length with this token is left out). -> the rows of seqs
        it covers, or None when none was launched. seqs: the sampled rows' sequences, which
        must be the chunks' in order (a chunk that leaves its prompt unfinished samples
        nothing)."""
        if [s.seq_id for s in seqs] != [c.seq.seq_id for c in chunks]:
            return None
        rows = [i for i, seq in enumerate(seqs) if not self._ends_by_length(seq)]
        if not rows:
            return None
        batch, sample_args, fed = prepared.batch, prepared.sample_args, launched
        if len(rows) < len(seqs):
            batch, sample_args = self._lookahead_batch([seqs[i] for i in rows], [0] * len(rows))
            fed = Sampler.rows_of(launched, rows)
        ahead = [Chunk(seqs[i], len(seqs[i].token_ids), 1) for i in rows]  # pure decode chunks
        logits = self._forward(batch, ahead, self.sampler.token_ids(fed))
        self._lookahead = _Lookahead(batch, sample_args, self.sampler.launch(logits, *sample_args))
        self.num_unread_launches += 1
        return rows

    def _settle_unread(self, seqs: list[SequenceState], tokens: list[int]) -> None:
        """After the read, for a lookahead `_launch_unread` queued for these seqs (the rows it
        covers) and the tokens they sampled: its host batch gets the tokens it was fed (what
        the next step's batch is compared with). Where a sample ended with its token (a stop
        token, EOS), invariant mode keeps the others' rows: the batch-invariant kernels gave
        each row the bits it gets in a step without the ended ones. Fast mode drops it (a
        row's bits there follow the batch)."""
        ahead = self._lookahead
        going_on = [
            i for i, (s, t) in enumerate(zip(seqs, tokens, strict=True)) if not self._ends(s, t)
        ]
        if len(going_on) == len(seqs):
            ahead.batch.token_ids.copy_(torch.tensor(tokens, dtype=torch.int64))
            return
        if not going_on or self.ops.mode != "invariant":
            self.drop_lookahead()
            return
        batch, sample_args = self._lookahead_batch(
            [seqs[i] for i in going_on], [tokens[i] for i in going_on]
        )
        self._lookahead = _Lookahead(batch, sample_args, Sampler.rows_of(ahead.launched, going_on))

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
        counts, eos, max_len = self._next_counts(seq), self.eos_token_id, self.max_model_len
        return finish_reason(seq.params, token_id, *counts, eos, max_len) is not None

    def launch_lookahead(
        self, chunks: list[Chunk], token_ids: dict[int, int], prepared: _Prepared | None = None
    ) -> None:
        """After a step of `chunks` whose every sequence sampled (token_ids: seq_id -> the
        token it sampled): launch the next decode step of the samples that go on (their new
        token each) and its sampling, without waiting. prepared: _prepare_lookahead(chunks),
        taken when every sequence goes on (its tokens filled in).
        Nothing is launched when a sequence scores or is mid-prefill (the next step is not a
        pure decode) or when a new position needs a block the table lacks (the engine
        appends it first, so the next batch would differ anyway)."""
        self._lookahead = None
        if not self.overlap or not chunks:
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
            batch, sample_args = self._lookahead_batch(seqs, tokens)
        ahead = [Chunk(seq, len(seq.token_ids), 1) for seq in seqs]  # pure decode chunks
        launched = self.sampler.launch(self._forward(batch, ahead), *sample_args)
        self._lookahead = _Lookahead(batch, sample_args, launched)

    def _take_lookahead(self, batch: ForwardBatch, sample_args: SampleArgs) -> SampleLaunch | None:
        """The lookahead's sampling if it computed exactly this step, else None (dropped)."""
        ahead, self._lookahead = self._lookahead, None
        if ahead is None:
            return None
        if ahead.sample_args == sample_args and same_batch(ahead.batch, batch):
            self.num_lookahead_hits += 1
            return ahead.launched
        self.num_lookahead_misses += 1
        return None

    def drop_lookahead(self) -> None:
        """Forget a launched lookahead (weights or experts are about to change)."""
        if self._lookahead is not None:
            self._lookahead = None
            self.num_lookahead_misses += 1

    def _queue_routed_experts(
        self,
        batch: ForwardBatch,
        gen_rows: list[int],
        seqs: list[SequenceState],
        launched: SampleLaunch,
    ) -> _Routed | None:
        """Queue the copy of the logical experts [L_moe, K] of each sampled position whose
        sequence asked for them (None: none asked); `_Routed.wait` reads them. launched: the
        step's sampling; a lookahead's that kept some of its rows ran a pure decode step of
        more sequences, its rows' tokens then `launched.rows`."""
        moe_layers = self.model.moe_layers
        asking = [i for i, s in enumerate(seqs) if s.params.return_routed_experts]
        if not moe_layers or not asking:
            return None
        if launched.rows is not None:
            rows = [launched.rows[i] for i in asking]
        else:
            rows = batch.logits_indices[[gen_rows[i] for i in asking]]
        token_rows = host_to_device(rows, self.device)
        ids = torch.stack([moe.last_topk_ids[token_rows] for moe in moe_layers], dim=1)
        # [R, L_moe, K] int32: one compact copy
        return _Routed([seqs[i].seq_id for i in asking], device_to_host(ids.to(torch.int32)))

    def _build_batch(self, chunks: list[Chunk]) -> tuple[ForwardBatch, list[tuple[Chunk, int]]]:
        """The step's host batch (per-chunk work and array ops, no loop over positions: a
        decode step's lookahead builds it on the critical path) and, per row needing logits,
        its (chunk, position): the last token of a chunk that completes its sequence and, for
        scoring sequences, every position whose next token is a scored one."""
        bs = self.block_size
        counts = np.fromiter((c.num_tokens for c in chunks), np.int64, len(chunks))
        starts = np.fromiter((c.start for c in chunks), np.int64, len(chunks))
        first_rows = np.cumsum(counts) - counts
        total = int(counts.sum())
        seq_rows = np.repeat(np.arange(len(chunks)), counts)
        positions = np.arange(total) + np.repeat(starts - first_rows, counts)
        token_ids = np.fromiter(
            itertools.chain.from_iterable(
                c.seq.token_ids[c.start : c.start + c.num_tokens] for c in chunks
            ),
            np.int64,
            total,
        )
        # Only the blocks the step's positions reach: with overlap_decode the scheduler may
        # have appended the block of the next position already, which this step never reads
        # and which would make its batch differ from the lookahead launched without it.
        used = [c.seq.block_table[: (c.start + c.num_tokens - 1) // bs + 1] for c in chunks]
        lengths = np.fromiter(map(len, used), np.int64, len(used))
        width = int(lengths.max()) if len(used) else 1
        tables = np.full((len(chunks), width), -1, dtype=np.int64)
        tables[np.arange(width)[None, :] < lengths[:, None]] = np.fromiter(
            itertools.chain.from_iterable(used), np.int64, int(lengths.sum())
        )
        slots = tables[seq_rows, positions // bs] * bs + positions % bs
        logit_rows: list[int] = []
        row_owners: list[tuple[Chunk, int]] = []
        for chunk, first_row in zip(chunks, first_rows.tolist(), strict=True):
            seq, end = chunk.seq, chunk.start + chunk.num_tokens
            num_tokens = len(seq.token_ids)
            if not seq.is_score:
                if end == num_tokens:
                    logit_rows.append(first_row + chunk.num_tokens - 1)
                    row_owners.append((chunk, end - 1))
                continue
            # Positions scored before a preemption are not scored twice.
            first = max(chunk.start, seq.num_prompt_tokens - 1 + seq.num_scored)
            for position in range(first, min(end, num_tokens - 1)):
                logit_rows.append(first_row + position - chunk.start)
                row_owners.append((chunk, position))
        batch = ForwardBatch(
            token_ids=torch.from_numpy(token_ids),
            positions=torch.from_numpy(positions),
            query_seq_ids=torch.from_numpy(seq_rows),
            block_tables=torch.from_numpy(tables),
            slot_mapping=torch.from_numpy(slots),
            logits_indices=torch.tensor(logit_rows, dtype=torch.int64),
        )
        return batch, row_owners
