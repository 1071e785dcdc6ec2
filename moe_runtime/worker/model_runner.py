"""ModelRunner: turns a step's sequences into a ForwardBatch, runs the model, samples.

Owns the model, the per-layer latent KV caches and the sampler of one rank; the sequences it
runs (`SequenceState`) are the worker's, kept up to date from the wire format's deltas and
handed to each `step` as chunks.
With expert parallelism (`must_join`), a step with no sequences still runs the model on zero
tokens, because every MoE layer is a collective all ranks join. Rows that need logits are the
last token of a chunk that completes its sequence (a new token is sampled) and, for scoring
sequences, every position whose next token is a scored one. With graph batch sizes (cuda only)
pure decode steps go through a DecodeGraphRunner, and the cache holds one more block than the
BlockManager is given: the scratch block the graphs' padding rows write to.

With `overlap` (one rank), a step whose every sequence sampled may launch the next one ahead
(`Lookahead`, moe_runtime.worker.lookahead), while the host returns the results and the engine
schedules; the next `step` uses it only when it is exactly that step, else runs as usual. A
dropped lookahead wrote only the KV slot of each sample's next position; whoever writes that
slot next runs after it on the same stream.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from moe_kernels import OpTable
from moe_runtime.forward_batch import ForwardBatch, HostCopy, device_to_host, host_to_device
from moe_runtime.model.deepseek import DeepseekForCausalLM
from moe_runtime.worker.cuda_graphs import DecodeGraphRunner
from moe_runtime.worker.lookahead import Lookahead
from moe_runtime.worker.sampler import SampleLaunch, Sampler, top_logprobs
from moe_runtime.worker.sequence_state import Chunk, SequenceState, sample_args_of
from moe_runtime.worker.step_input import StepOutput

_SORT_ROWS = 256  # scored rows a top-k sort takes at once (a decode step's batch at most)
_SCORE_ROWS = 1024  # scored rows whose logprobs are computed at once (_score)


@dataclass(frozen=True)
class _Routed:
    """Sampled positions' routed experts on their way to the host."""

    seq_ids: list[int]
    ids: HostCopy  # [R, L_moe, K] int32

    def wait(self) -> dict[int, np.ndarray]:
        """seq_id -> [L_moe, K] int32 logical experts of its sampled position."""
        ids = self.ids.wait().numpy()
        return {seq_id: ids[j] for j, seq_id in enumerate(self.seq_ids)}


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
        sampled_vocab_size: int | None = None,
    ) -> None:
        """graph_batch_sizes: CUDA-graph decode batch sizes (empty: always eager); block
        tables of graphed steps are padded to max_blocks_per_seq columns. overlap: decode
        steps may be launched ahead (one rank only); max_model_len ends samples as the
        scheduler does, so a lookahead leaves out those that end. sampled_vocab_size: the
        Sampler's bound on the ids it draws."""
        if overlap and must_join:
            raise ValueError("a decode lookahead needs one rank: every MoE layer is a collective")
        cfg = model.config
        self.model, self.ops, self.device = model, ops, device
        self.block_size, self.must_join = block_size, must_join
        self.num_blocks = num_blocks  # blocks the BlockManager may hand out
        num_scratch = 1 if graph_batch_sizes else 0
        shape = (num_blocks + num_scratch, block_size, cfg.latent_dim)
        try:
            self.kv_caches = [
                torch.zeros(shape, dtype=model.dtype, device=device)
                for _ in range(cfg.num_hidden_layers)
            ]
        except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory errors among them
            size = math.prod(shape) * cfg.num_hidden_layers * model.dtype.itemsize
            raise ValueError(
                f"the KV cache of cache.num_blocks={num_blocks} blocks of cache.block_size="
                f"{block_size} ({size / 2**30:.3g} GiB in {cfg.num_hidden_layers} layers) "
                f"cannot be allocated on {device}: {str(exc).splitlines()[0]}"
            ) from exc
        self.sampler = Sampler(ops.log_softmax, ops.cumsum, cfg.eos_token_ids, sampled_vocab_size)
        self.lookahead = Lookahead(
            self.sampler,
            self._build_batch,
            self._forward,
            block_size=block_size,
            is_enabled=overlap,
            is_invariant=ops.mode == "invariant",
            eos_token_ids=cfg.eos_token_ids,
            max_model_len=max_model_len,
        )
        self._slot_counts: HostCopy | None = None
        self.graphs: DecodeGraphRunner | None = None
        if graph_batch_sizes:
            if device.type != "cuda":
                raise ValueError(f"kernels.cuda_graphs needs a cuda device, got {device}")
            self.graphs = DecodeGraphRunner(
                model, self.kv_caches, graph_batch_sizes, max_blocks_per_seq, num_blocks
            )

    def step(self, chunks: list[Chunk], lookahead: bool = False) -> StepOutput:
        """Run the step; lookahead: nothing waits on the engine's side, so once the samples
        are on the host the next decode step may be launched (`Lookahead.launch`) before
        their results are built."""
        out = StepOutput()
        if not chunks and not self.must_join:
            self.lookahead.drop()
            self._slot_counts = None
            return out
        batch, row_owners = self._build_batch(chunks)
        gen_rows = [i for i, (chunk, _) in enumerate(row_owners) if not chunk.seq.is_score]
        seqs = [row_owners[i][0].seq for i in gen_rows]
        sample_args = sample_args_of(seqs)
        launched = self.lookahead.take(batch, sample_args)
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
            prepared = self.lookahead.prepare(chunks) if lookahead else None
            # Before any lookahead, whose replay refills the captured routing it reads.
            routed = self._queue_routed_experts(batch, gen_rows, seqs, launched)
            unread = None
            if prepared is not None:
                unread = self.lookahead.launch_unread(chunks, seqs, prepared, launched)
            rows = self.sampler.read(launched)
            out.routed = routed.wait() if routed is not None else {}
            tokens = [int(row[0]) for row in rows]
            if unread is not None:
                self.lookahead.settle_unread([seqs[i] for i in unread], [tokens[i] for i in unread])
            elif lookahead:
                by_seq = {s.seq_id: t for s, t in zip(seqs, tokens, strict=True)}
                self.lookahead.launch(chunks, by_seq, prepared)
            results = self.sampler.results(launched, rows)
            out.samples.update({s.seq_id: r for s, r in zip(seqs, results, strict=True)})
        score_rows = [i for i, (chunk, _) in enumerate(row_owners) if chunk.seq.is_score]
        if score_rows:  # never a lookahead's step: it has no scoring rows
            self._score(logits, score_rows, row_owners, out)
            self._scored_routed_experts(batch, score_rows, row_owners, out)
        out.is_ahead = self.lookahead.is_launched
        return out

    def _score(self, logits, score_rows: list[int], row_owners, out: StepOutput) -> None:
        """The scored rows' logprobs of their next tokens, and the top logprobs of those that
        ask, as decode reports them (Sampler.launch, raw mode: the same op and stable sort),
        _SCORE_ROWS rows at a time. Why: a step of 8k scored rows held its [R, V] fp32
        logits, their copy and their logprobs at once (10 GB at V2-Lite's vocabulary), in the
        memory a cache sized from free memory leaves; a row's logprobs are its own, so the
        blocks change no bit."""
        for first in range(0, len(score_rows), _SCORE_ROWS):
            self._score_block(logits, score_rows[first : first + _SCORE_ROWS], row_owners, out)

    def _score_block(self, logits, score_rows: list[int], row_owners, out: StepOutput) -> None:
        first, last = score_rows[0], score_rows[-1]
        if last - first + 1 == len(score_rows):  # consecutive rows (a scoring's chunk): a view
            logprobs = self.ops.log_softmax(logits[first : last + 1])
        else:
            logprobs = self.ops.log_softmax(logits[score_rows])
        num_tops = [row_owners[i][0].seq.params.logprobs for i in score_rows]  # None: not asked
        most = max((num or 0 for num in num_tops), default=0)
        top_values: list[list[float]] = [[] for _ in score_rows]
        top_ids: list[list[int]] = [[] for _ in score_rows]
        if most:  # rows sorted a block at a time: a whole prefill's [T, V] sort could OOM
            top_values, top_ids = [], []
            for block in logprobs.split(_SORT_ROWS):  # each block's sort freed before the next
                values, ids = top_logprobs(block, most)
                top_values += values.tolist()
                top_ids += ids.tolist()
        # The next tokens' logprobs gathered where they are: [S] to the host, not [S, V] (4 GB
        # for a step of 8k scored rows at V3's vocabulary).
        owners = [row_owners[i] for i in score_rows]
        next_tokens = [chunk.seq.token_ids[position + 1] for chunk, position in owners]
        picked = host_to_device(next_tokens, logprobs.device)[:, None]
        chosen = logprobs.gather(1, picked).squeeze(1).tolist()
        for row, (chunk, _) in enumerate(owners):
            seq_id = chunk.seq.seq_id
            out.scored.setdefault(seq_id, []).append(chosen[row])
            if (num := num_tops[row]) is not None:  # 0 too: an empty top, as decode reports
                top = dict(zip(top_ids[row][:num], top_values[row][:num], strict=True))
                out.scored_top.setdefault(seq_id, []).append(top)
            chunk.seq.num_scored += 1

    def _scored_routed_experts(
        self, batch: ForwardBatch, score_rows: list[int], row_owners, out: StepOutput
    ) -> None:
        """The logical experts [L_moe, K] of each scored position whose scoring asked for
        them, as `_queue_routed_experts` reads a sampled position's: a sequence scored after
        it was generated gets the generation's experts at the same positions."""
        moe_layers = self.model.moe_layers
        asking = [i for i in score_rows if row_owners[i][0].seq.params.return_routed_experts]
        if not moe_layers or not asking:
            return
        ids = self._copy_routed(batch.logits_indices[asking]).wait().numpy()  # [S, L_moe, K]
        seq_ids = np.array([row_owners[i][0].seq.seq_id for i in asking])
        for seq_id in dict.fromkeys(seq_ids.tolist()):  # rows in order, a sequence's together
            out.scored_routed[seq_id] = ids[seq_ids == seq_id]

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
        return _Routed([seqs[i].seq_id for i in asking], self._copy_routed(rows))

    def _copy_routed(self, token_rows) -> HostCopy:
        """Queue the copy to the host of the last forward's logical experts [R, L_moe, K]
        int32 (one compact copy) at its token rows (host indices): what sampled and scored
        positions report alike."""
        rows = host_to_device(token_rows, self.device)
        ids = torch.stack([moe.last_topk_ids[rows] for moe in self.model.moe_layers], dim=1)
        return device_to_host(ids.to(torch.int32))

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
        used = [c.seq.block_table.head((c.start + c.num_tokens - 1) // bs + 1) for c in chunks]
        lengths = np.fromiter(map(len, used), np.int64, len(used))
        width = int(lengths.max()) if len(used) else 1
        tables = np.full((len(chunks), width), -1, dtype=np.int64)
        if used:
            tables[np.arange(width)[None, :] < lengths[:, None]] = np.concatenate(used)
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
