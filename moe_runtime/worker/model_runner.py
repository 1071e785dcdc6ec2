"""ModelRunner: turns a step's sequences into a ForwardBatch, runs the model, samples.

Owns the model, the per-layer latent KV caches, the sampler of one rank and the worker's copy
of every sequence it serves (`SequenceState`, kept up to date from the wire format's deltas).
With expert parallelism (`must_join`), a step with no sequences still runs the model on zero
tokens, because every MoE layer is a collective all ranks join. Rows that need logits are the
last token of a chunk that completes its sequence (a new token is sampled) and, for scoring
sequences, every position whose next token is a scored one. With graph batch sizes (cuda only)
pure decode steps go through a DecodeGraphRunner, and the cache holds one more block than the
BlockManager is given: the scratch block the graphs' padding rows write to.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from kernels import OpTable
from moe_runtime.forward_batch import ForwardBatch, host_to_device
from moe_runtime.model.deepseek import DeepseekForCausalLM
from moe_runtime.worker.cuda_graphs import DecodeGraphRunner
from moe_runtime.worker.sampler import Sampler
from moe_runtime.worker.step_input import NewSequence, StepOutput


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
    ) -> None:
        """graph_batch_sizes: CUDA-graph decode batch sizes (empty: always eager); block
        tables of graphed steps are padded to max_blocks_per_seq columns."""
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
        self.graphs: DecodeGraphRunner | None = None
        if graph_batch_sizes:
            if device.type != "cuda":
                raise ValueError(f"kernels.cuda_graphs needs a cuda device, got {device}")
            self.graphs = DecodeGraphRunner(
                model, self.kv_caches, graph_batch_sizes, max_blocks_per_seq, num_blocks
            )

    def step(self, chunks: list[Chunk]) -> StepOutput:
        out = StepOutput()
        if not chunks and not self.must_join:
            return out
        batch, row_owners = self._build_batch(chunks)
        is_pure_decode = all(c.num_tokens == 1 and not c.seq.is_score for c in chunks)
        if self.graphs is not None and self.graphs.can_run(is_pure_decode, batch):
            logits = self.graphs.run(batch)
        else:
            logits = self.model(batch.to(self.device), self.kv_caches)
        samples, scored = out.samples, out.scored
        gen_rows = [i for i, (chunk, _) in enumerate(row_owners) if not chunk.seq.is_score]
        if gen_rows:
            seqs = [row_owners[i][0].seq for i in gen_rows]
            gen_logits = logits
            if len(gen_rows) < logits.shape[0]:
                # A list index is a pageable copy that would wait for the step's GPU work.
                gen_logits = logits[host_to_device(gen_rows, logits.device)]
            results = self.sampler.sample(
                gen_logits,
                [s.params for s in seqs],
                [s.seed for s in seqs],
                [len(s.token_ids) - s.num_prompt_tokens for s in seqs],
            )
            samples.update({s.seq_id: r for s, r in zip(seqs, results, strict=True)})
            out.routed = self._routed_experts(batch, gen_rows, seqs)
        score_rows = [i for i, (chunk, _) in enumerate(row_owners) if chunk.seq.is_score]
        if score_rows:
            logprobs = self.ops.log_softmax(logits[score_rows]).cpu()
            for row, i in enumerate(score_rows):
                chunk, position = row_owners[i]
                next_token = chunk.seq.token_ids[position + 1]
                scored.setdefault(chunk.seq.seq_id, []).append(logprobs[row, next_token].item())
                chunk.seq.num_scored += 1
        return out

    def _routed_experts(self, batch: ForwardBatch, gen_rows: list[int], seqs) -> dict:
        """seq_id -> [L_moe, K] int32 logical experts of the position whose logits were
        sampled, for the sequences that asked for them."""
        moe_layers = self.model.moe_layers
        asking = [i for i, s in enumerate(seqs) if s.params.return_routed_experts]
        if not moe_layers or not asking:
            return {}
        rows = batch.logits_indices[[gen_rows[i] for i in asking]]
        token_rows = host_to_device(rows, self.device)
        ids = torch.stack([moe.last_topk_ids[token_rows] for moe in moe_layers], dim=1)
        ids = ids.to(torch.int32).cpu().numpy()  # [R, L_moe, K]: one host copy, compact
        return {seqs[i].seq_id: ids[j] for j, i in enumerate(asking)}

    def _build_batch(self, chunks: list[Chunk]) -> tuple[ForwardBatch, list[tuple[Chunk, int]]]:
        token_ids, positions, seq_rows, slots, logit_rows = [], [], [], [], []
        row_owners: list[tuple[Chunk, int]] = []
        for seq_row, chunk in enumerate(chunks):
            seq = chunk.seq
            span = range(chunk.start, chunk.start + chunk.num_tokens)
            all_ids = seq.token_ids
            num_tokens = len(all_ids)
            for position in span:
                if seq.is_score:
                    # Positions scored before a preemption are not scored twice.
                    first = seq.num_prompt_tokens - 1 + seq.num_scored
                    needs_logits = first <= position < num_tokens - 1
                else:
                    needs_logits = position == num_tokens - 1
                if needs_logits:
                    logit_rows.append(len(token_ids))
                    row_owners.append((chunk, position))
                token_ids.append(all_ids[position])
                positions.append(position)
                seq_rows.append(seq_row)
                block = seq.block_table[position // self.block_size]
                slots.append(block * self.block_size + position % self.block_size)
        width = max((len(c.seq.block_table) for c in chunks), default=1)
        tables = [c.seq.block_table + [-1] * (width - len(c.seq.block_table)) for c in chunks]
        batch = ForwardBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            query_seq_ids=torch.tensor(seq_rows, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int64).view(len(chunks), width),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            logits_indices=torch.tensor(logit_rows, dtype=torch.int64),
        )
        return batch, row_owners
