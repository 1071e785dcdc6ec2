"""Fast-mode MLA prefill in the multi-head form: not batch-invariant, the baseline's prefill.

Invariant mode attends every query in the absorbed form (MQA over the 576-wide latent, W_UV
after), so a token's bits are the same prefilled, chunked or decoded. That form costs about
twice the multiply-adds of the multi-head one at prefill: per query-key pair 576 + 512
against 192 + 128 (DeepSeek's qk and v head dims), the latents' expansion through kv_b_proj
added once per key. A user free of that contract prefills in the multi-head form with a
FlashAttention kernel (vLLM and SGLang do), so fast mode does too for models of at least
`min_heads` heads a rank where every sequence of a step brings at least `min_queries` queries:
each sequence's cached latents (already normed and rotated) expand through kv_b_proj into
per-head keys and values, and torch's scaled_dot_product_attention (FlashAttention on the GPU)
attends with the causal mask aligned to the last query. Decode-shaped steps, mixed ones and
graph captures keep the absorbed form.

Why from 128 heads: through the engine (H200, V2-Lite's shapes, prefill 8 x 1024, BENCHMARKS.md,
twenty-eighth session) the multi-head form ran 34,500 tok/s against the absorbed form's 31,000
at 128 heads, and 55,000-72,000 against 76,000-78,000 at V2-Lite's 16, where the absorbed
kernel reads each latent once for all heads and the multi-head form's expansion outweighs the
pairs saved (58,824 with the values unpadded through cuDNN against 76,808: thirty-third).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


@dataclass(frozen=True)
class _Sequence:
    rows: torch.Tensor  # the step's token rows of this sequence, by position, on the device
    num_queries: int
    length: int  # its last query's position + 1: the keys it attends
    # Where its rows are the step's rows [start, start + num_queries) in order (a step of
    # whole prompts, as the scheduler lays them out): read and written as slices, no gather.
    start: int | None = None

    def of(self, x: torch.Tensor) -> torch.Tensor:
        """x's rows of this sequence, by position: a view where they are one slice."""
        return x[self.rows] if self.start is None else x[self.start : self.start + self.num_queries]

    def put(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        """rows (this sequence's, by position) into out's rows of this sequence."""
        if self.start is None:
            out[self.rows] = rows
        else:
            self.of(out).copy_(rows)


@dataclass
class MhaPrefill:
    """Fast mode's prefill attention in the multi-head form (module docstring). `takes` decides
    from the step's batch (host shapes first; a sync only for prefill-sized steps outside graph
    capture); calling it attends a step `takes` accepted."""

    min_queries: int = 64
    min_heads: int = 128
    # Why a cap: a sequence's keys and values are expanded whole, [keys, heads, 192] twice plus
    # kv_b_proj's [keys, heads, nope + v]; at 16,384 keys and 128 heads ~2.1 GB in bf16 at once.
    # Longer contexts keep the absorbed form, which reads the cache in place.
    max_keys: int = 16384
    # The last step's plan, keyed by its query_seq_ids tensor (the layers of a step share it).
    _plan: tuple | None = field(default=None, repr=False)

    def takes(
        self,
        query_seq_ids: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        num_heads: int,
    ) -> bool:
        """Whether a rank of num_heads heads attends this step in the multi-head form: at
        least min_heads of them, and every sequence of the step brings >= min_queries queries
        at consecutive positions (a prompt or a prompt chunk) ending within max_keys."""
        num_tokens, num_seqs = query_seq_ids.shape[0], block_tables.shape[0]
        if num_heads < self.min_heads:
            return False
        if num_seqs == 0 or num_tokens < self.min_queries * num_seqs:
            return False
        if query_seq_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        return self._sequences(query_seq_ids, positions, num_seqs) is not None

    def _sequences(
        self, query_seq_ids: torch.Tensor, positions: torch.Tensor, num_seqs: int
    ) -> list[_Sequence] | None:
        """The step's sequences, or None where one has fewer than min_queries queries or a gap
        in its positions. One host copy a step: the plan is kept for the step's other layers."""
        plan = self._plan
        if plan is not None and plan[0]() is query_seq_ids and plan[1]() is positions:
            return plan[2]
        ids, pos = query_seq_ids.cpu(), positions.cpu()
        counts = torch.bincount(ids, minlength=num_seqs)
        sequences = None
        if int(counts.min()) >= self.min_queries and int(pos.max()) < self.max_keys:
            order = torch.sort(ids * (int(pos.max()) + 1) + pos, stable=True).indices
            sorted_pos = pos[order].split(counts.tolist())
            if all(bool((p[1:] - p[:-1] == 1).all()) for p in sorted_pos):
                sequences = []
                for rows, p in zip(order.split(counts.tolist()), sorted_pos, strict=True):
                    first = int(rows[0])
                    is_slice = bool((rows == torch.arange(first, first + rows.shape[0])).all())
                    sequences.append(_Sequence(
                        rows.to(query_seq_ids.device), int(p.shape[0]), int(p[-1]) + 1,
                        first if is_slice else None,
                    ))  # fmt: skip
        self._plan = (weakref.ref(query_seq_ids), weakref.ref(positions), sequences)
        return sequences

    def __call__(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        query_seq_ids: torch.Tensor,
        block_tables: torch.Tensor,
        positions: torch.Tensor,
        kv_b_weight: torch.Tensor,
        *,
        scale: float,
        v_dim: int,
    ) -> torch.Tensor:
        """query [T, H, nope + R] (q_nope before W_UK, then the rotated rope), kv_cache [NB, BS,
        L + R] with this step's latents written, kv_b_weight [H * (nope + v_dim), L] ->
        [T, H, v_dim] in query's dtype: softmax(q k^T * scale) v per head, k = (latent W_UK,
        k_rot), v = latent W_UV, over each sequence's positions up to each query's."""
        num_tokens, num_heads, qk_dim = query.shape
        rope = kv_cache.shape[2] - kv_b_weight.shape[1]
        nope, lora = qk_dim - rope, kv_b_weight.shape[1]
        if kv_b_weight.shape[0] != num_heads * (nope + v_dim):
            raise ValueError(
                f"kv_b_weight {tuple(kv_b_weight.shape)} is not {num_heads} heads of "
                f"{nope} + {v_dim} rows"
            )
        sequences = self._sequences(query_seq_ids, positions, block_tables.shape[0])
        if sequences is None:
            raise ValueError("the step is not prefill-shaped (MhaPrefill.takes refused it)")
        out = query.new_empty((num_tokens, num_heads, v_dim))
        block_size = kv_cache.shape[1]
        pads_values = _pads_values(query)
        for s, seq in enumerate(sequences):
            blocks = block_tables[s, : -(-seq.length // block_size)]
            cached = kv_cache[blocks].flatten(0, 1)[: seq.length]  # [S, L + R]
            expanded = F.linear(cached[:, :lora], kv_b_weight).view(
                seq.length, num_heads, nope + v_dim
            )
            # Keys [S, H, nope + R] by two copies into one buffer (the rope part broadcast over
            # the heads): a cat with a broadcast operand ran at ~0.6 TB/s on the H200.
            key = expanded.new_empty((seq.length, num_heads, qk_dim))
            key[..., :nope].copy_(expanded[..., :nope])
            key[..., nope:].copy_(cached[:, None, lora:])
            value = expanded[..., nope:]
            if pads_values:
                value = F.pad(value, (0, qk_dim - v_dim))
            # Why 4-d: FlashAttention (and the memory-efficient kernel) take [batch, heads,
            # tokens, dim] only; 3-d inputs fell back to the materialised math kernel, 2-4x
            # slower than the absorbed form (H200).
            attended = F.scaled_dot_product_attention(
                seq.of(query).transpose(0, 1)[None],  # [1, H, n, nope + R]
                key.transpose(0, 1)[None],
                value.transpose(0, 1)[None],
                attn_mask=causal_lower_right(seq.num_queries, seq.length),
                scale=scale,
            )
            seq.put(out, attended[0].transpose(0, 1)[..., :v_dim])
        return out


def _pads_values(query: torch.Tensor) -> bool:
    """Whether the values reach SDPA padded to the query's head dim: on CUDA without cuDNN's
    attention, whose kernel takes v's own head dim (FlashAttention takes one head dim for q, k
    and v; the memory-efficient kernel takes both but ran 2x slower than FlashAttention
    padded). H200, 128 heads, one causal sequence of 1024 through SDPA: padded 178.9 us,
    unpadded (cuDNN) 112.5, outputs within 5e-5 (BENCHMARKS.md, thirty-third session)."""
    if not query.is_cuda:
        return False
    return not (torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled())
