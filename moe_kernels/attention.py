"""Paged MLA attention over the latent KV cache: one formulation for prefill and decode.

Keys are whole cache rows [C] (kv_lora_rank + rope dims), values their first v_dim channels.
Query t attends to positions 0..positions[t] of sequence query_seq_ids[t]; position p lives
at kv_cache[block_tables[seq, p // BS], p % BS]. The cache is written before attention runs,
so new tokens and cached ones are read the same way.
`mla_attention_ref` is batch-invariant: a query's bits do not depend on the other queries, on
prefill vs decode, or on how a prompt was chunked. `mla_attention_fast` is plain torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_kernels.linear import PAD_FEATURES
from moe_kernels.tiling import pad_rows

FAST_PADDED_BYTES = 1 << 30  # fast path: largest gathered KV [T, S, C] of the padded kernel


def mla_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_seq_ids: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: float,
    v_dim: int,
    tile_rows: int,
    whole_heads: int | None = None,
) -> torch.Tensor:
    """q [T, H, C], kv_cache [NB, BS, C], query_seq_ids/positions [T] int64,
    block_tables [B, MB] int64 (-1 padding allowed past a sequence's end) -> [T, H, v_dim].
    whole_heads (the model's heads at TP 1) is the Triton kernel's launch key; heads are
    independent here, so it changes nothing.
    """
    num_tokens = q.shape[0]
    if num_tokens == 0:  # a rank with no tokens still runs the step (EP lockstep)
        return q.new_empty((0, q.shape[1], v_dim))
    # Why: queries run in fixed tiles; padded rows (seq 0, position 0) are valid and dropped.
    tiles = [pad_rows(t, tile_rows).split(tile_rows) for t in (q.float(), query_seq_ids, positions)]
    outs = [
        _attend_tile(q_t, kv_cache, s_t, block_tables, p_t, scale, v_dim)
        for q_t, s_t, p_t in zip(*tiles, strict=True)
    ]
    return torch.cat(outs)[:num_tokens].to(q.dtype)


def _attend_tile(q, kv_cache, seq_ids, block_tables, positions, scale, v_dim):
    """Online softmax over one query tile q [R, H, C] fp32 -> [R, H, v_dim] fp32."""
    num_rows, num_heads, _ = q.shape
    block_size = kv_cache.shape[1]
    offsets = torch.arange(block_size, device=q.device)
    row_max = q.new_full((num_rows, num_heads), float("-inf"))
    row_sum = q.new_zeros((num_rows, num_heads))
    acc = q.new_zeros((num_rows, num_heads, v_dim))
    # Host sync: the chunk count is the tile's longest query; extra chunks are exact no-ops.
    num_chunks = int(positions.max()) // block_size + 1
    # Why: chunk j is block j of each sequence (aligned to absolute positions) and chunks are
    # merged in order j = 0, 1, ..., so a query sees the same chunks in prefill and decode.
    for j in range(num_chunks):
        valid = j * block_size + offsets <= positions[:, None]  # [R, BS]
        block_ids = block_tables[seq_ids, j].clamp(min=0)  # -1 padding is masked below
        kv = torch.where(valid[:, :, None], kv_cache[block_ids].float(), 0.0)  # [R, BS, C]
        # Why: one head per matmul ([R*H] x [1, C] x [C, BS]): no shape here depends on the
        # batch, and none on the heads per rank either (BLAS rounds an [H, C] x [C, BS]
        # product by H: a head's bits would follow the TP degree).
        scores = _per_head_bmm(q, kv.transpose(1, 2)) * scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        max_new = torch.maximum(row_max, scores.amax(-1))
        alpha = torch.exp(row_max - max_new)
        p = torch.exp(scores - max_new[..., None])
        sum_new = row_sum * alpha + p.sum(-1)
        acc_new = acc * alpha[..., None] + _per_head_bmm(p, kv[:, :, :v_dim])
        # Why: a chunk wholly past a query's position must leave its state bit-for-bit as it
        # was (adding +0.0 would still flip a -0.0), so the tile's chunk count never shows.
        is_live = valid[:, 0, None]
        row_max = torch.where(is_live, max_new, row_max)
        row_sum = torch.where(is_live, sum_new, row_sum)
        acc = torch.where(is_live[..., None], acc_new, acc)
    return acc / row_sum[..., None]


def _per_head_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [R, H, K] x b [R, K, N] (shared by a row's heads) -> [R, H, N], one [1, K] x [K, N]
    product per (row, head)."""
    num_rows, num_heads, k = a.shape
    n = b.shape[-1]
    # Why padded: MKL's bmm rounds a product by its index in the batch (its operands' alignment)
    # where K or N is not a multiple of 16 (K = a block size of 64 and N = a v_dim of 11 say):
    # a query's bits followed its row in the tile. Zero-padded K and N (exact zeros add
    # nothing) give every product one full-width path, as the linears' PAD_FEATURES does.
    # Why copies: at one head the reshape is a view with b's own (transposed) strides, and
    # BLAS would take another path than for the copies made at several heads.
    pad_k, pad_n = -k % PAD_FEATURES, -n % PAD_FEATURES
    b = b[:, None].expand(num_rows, num_heads, k, n).reshape(-1, k, n)
    b = F.pad(b, (0, pad_n, 0, pad_k)).contiguous()
    a = F.pad(a.reshape(-1, 1, k), (0, pad_k)).contiguous()
    return torch.bmm(a, b)[..., :n].reshape(num_rows, num_heads, n)


def mla_attention_fast(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_seq_ids: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: float,
    v_dim: int,
    whole_heads: int | None = None,
) -> torch.Tensor:
    """Same contract as mla_attention_ref; plain torch in the input dtype, shapes set by the batch.

    Up to FAST_PADDED_BYTES of gathered KV (decode-sized steps), one padded batched matmul over
    every query; beyond that, per-sequence matmuls whose M is the sequence's query count.
    """
    if q.shape[0] == 0:
        return q.new_empty((0, q.shape[1], v_dim))
    num_kv = int(positions.max()) + 1  # host sync: the padded length is the batch's longest
    if q.shape[0] * num_kv * kv_cache.shape[2] * kv_cache.element_size() <= FAST_PADDED_BYTES:
        return _attend_padded(
            q, kv_cache, query_seq_ids, block_tables, positions, num_kv, scale, v_dim
        )
    return _attend_per_sequence(q, kv_cache, query_seq_ids, block_tables, positions, scale, v_dim)


def _attend_padded(q, kv_cache, query_seq_ids, block_tables, positions, num_kv, scale, v_dim):
    block_size = kv_cache.shape[1]
    num_blocks = -(-num_kv // block_size)
    blocks = block_tables[query_seq_ids, :num_blocks].clamp(min=0)  # [T, nb]; -1 masked below
    kv = kv_cache[blocks].flatten(1, 2)[:, :num_kv]  # [T, S, C]
    valid = torch.arange(num_kv, device=q.device)[None, :] <= positions[:, None]  # [T, S]
    kv = torch.where(valid[:, :, None], kv, 0)  # unwritten slots may hold anything
    scores = torch.bmm(q, kv.transpose(1, 2)).float() * scale  # [T, H, S]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, -1).to(kv.dtype)
    return torch.bmm(probs, kv[:, :, :v_dim]).to(q.dtype)


def _attend_per_sequence(q, kv_cache, query_seq_ids, block_tables, positions, scale, v_dim):
    out = q.new_empty((q.shape[0], q.shape[1], v_dim))
    block_size = kv_cache.shape[1]
    for seq_id in query_seq_ids.unique().tolist():  # host sync: loop over the batch's sequences
        rows = (query_seq_ids == seq_id).nonzero().squeeze(1)
        seq_positions = positions[rows]
        kv_positions = torch.arange(int(seq_positions.max()) + 1, device=q.device)
        block_ids = block_tables[seq_id, kv_positions // block_size]
        kv = kv_cache[block_ids, kv_positions % block_size].float()  # [S, C]
        q_heads = q[rows].float().transpose(0, 1)  # [H, n, C]
        scores = (q_heads @ kv.t()) * scale  # [H, n, S]
        scores = scores.masked_fill(kv_positions[None, :] > seq_positions[:, None], float("-inf"))
        out[rows] = (torch.softmax(scores, -1) @ kv[:, :v_dim]).transpose(0, 1).to(q.dtype)
    return out
