"""Multi-head latent attention (MLA) over the paged latent KV cache.

One formulation for prefill and decode: the latent (kv_lora) and rope key of every new token are
written to the cache first, then every query attends over the cache with W_UK absorbed into the
query and W_UV applied after, so a token's output has the same bits whether its prompt was
prefilled whole, in chunks, from the prefix cache, or decoded one token at a time. With TP each
rank holds whole heads for every token, then swaps them for every head of its token share and
runs o_proj whole on that share: a token's output is one plain linear at every TP degree.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_kernels import OpTable
from moe_runtime.forward_batch import ForwardBatch
from moe_runtime.model.layers import Linear, RMSNorm
from moe_runtime.model.rope import RotaryEmbedding, softmax_scale
from moe_runtime.model.tensor_parallel import TensorParallel
from moe_runtime.model_config import ModelConfig

# Why: transformers and DeepSeek's inference code build q_a_layernorm and kv_a_layernorm with
# their RMSNorm default eps, not the config's rms_norm_eps (which only the residual norms use).
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        ops: OpTable,
        rope: RotaryEmbedding,
        dtype: torch.dtype,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        d, h = cfg.hidden_size, tp.split(cfg.num_attention_heads, "model.num_attention_heads")
        self.num_heads, self.nope_dim, self.rope_dim = h, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.whole_heads = cfg.num_attention_heads
        self.kv_lora_rank, self.v_dim = cfg.kv_lora_rank, cfg.v_head_dim
        whole_q = cfg.num_attention_heads * cfg.qk_head_dim  # q's rows at TP 1
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(d, h * cfg.qk_head_dim, ops, dtype, whole_q)
        else:
            self.q_a_proj = Linear(d, cfg.q_lora_rank, ops, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, ops, dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, ops, dtype, whole_q)
        self.kv_a_proj_with_mqa = Linear(d, cfg.latent_dim, ops, dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, ops, dtype)
        self.kv_b_proj = Linear(
            cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), ops, dtype
        )
        # Why whole: each TP rank runs o_proj on its share of the tokens with all of K, so a
        # token's row is one plain invariant linear (batch-invariant, K in the kernel's fixed
        # order) whatever the TP degree: no fixed K tree (its prefill launch cost ~1.4x the
        # plain linear's on the GPU). On the wire: the heads' outputs and the finished rows in
        # the model dtype instead of fp32 [T, D] subtree sums. The price: the weight is whole
        # on every TP rank (README.md, TP invariance, gives the sizes).
        self.o_proj = Linear(self.whole_heads * cfg.v_head_dim, d, ops, dtype)
        self.scale = softmax_scale(cfg.qk_head_dim, cfg.rope_scaling)
        self.rope, self.ops, self.tp = rope, ops, tp
        self.w_uk_t: torch.Tensor | None = None
        self.w_uv: torch.Tensor | None = None

    def absorb_weights(self) -> None:
        """Split kv_b_proj into per-head W_UK^T [H, kv_lora, nope] and W_UV [H, v, kv_lora].

        Called after every weight load; contiguous copies, the batched GEMMs' [B, OUT, IN].
        """
        w = self.kv_b_proj.weight.view(
            self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank
        )
        self.w_uk_t = w[:, : self.nope_dim].transpose(1, 2).contiguous()
        self.w_uv = w[:, self.nope_dim :].contiguous()

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]; writes this step's latents into kv_cache [NB, BS, C] first."""
        t = x.shape[0]
        # Why a branch: kv_a and the query projection read only x, so at decode sizes kv_a's
        # launch runs beside the query's on a second stream (moe_kernels/streams.py; no bit moves).
        with self.ops.branch(t) as side:
            latent = side.run(self.kv_a_proj_with_mqa, x)
            if hasattr(self, "q_proj"):
                q = self.q_proj(x)
            else:
                q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        prefill = self.ops.mla_prefill  # fast mode on CUDA only: not the absorbed form's bits
        if prefill is not None and prefill.takes(
            batch.query_seq_ids, batch.positions, batch.block_tables, self.num_heads
        ):
            out = self._prefill_multi_head(prefill, latent, q_nope, q_pe, batch, kv_cache)
        else:
            out = self._absorbed(latent, q_nope, q_pe, batch, kv_cache)
        # Collectives (every TP rank, in layer order, even with an empty share; none at tp 1,
        # where this is o_proj(out)): this rank's heads of every token for every head of its
        # token share, o_proj on the share, the finished rows of all shares back to every rank.
        heads = self.tp.heads_to_share(out.reshape(t, self.num_heads * self.v_dim))
        return self.tp.gather_shares(self.o_proj(heads), t, "attention_share_gather")

    def _write_cache(self, latent, q_pe, q_rot, batch: ForwardBatch, kv_cache, side=None) -> None:
        """The latent norm and the k_pe rope, stored straight into each token's cache row (on
        side's stream, or here). Why q rides along: the same positions and tables, so one
        launch fewer a layer (same bits): q_pe rotated into q_rot."""
        (side.run if side is not None else _call)(
            self.ops.write_latent_cache,
            latent,
            self.kv_a_layernorm.weight,
            self.kv_a_layernorm.eps,
            batch.positions,
            self.rope.cos,
            self.rope.sin,
            self.rope.is_interleaved,
            kv_cache,
            batch.slot_mapping,
            q_pe=q_pe,
            q_rot=q_rot,
        )

    def _prefill_multi_head(self, prefill, latent, q_nope, q_pe, batch, kv_cache):
        """Fast mode's prefill: this step's latents into the cache, then each sequence's keys
        and values expanded from its cached latents (moe_kernels/mla_prefill.py) -> [T, H, v]."""
        # The query [T, H, nope + R] built in place: q_nope copied in, the rope rotated into
        # its last channels by the cache write.
        query = q_nope.new_empty((q_nope.shape[0], self.num_heads, self.nope_dim + self.rope_dim))
        query[..., : self.nope_dim].copy_(q_nope)
        self._write_cache(latent, q_pe, query[..., self.nope_dim :], batch, kv_cache)
        return prefill(
            query, kv_cache, batch.query_seq_ids, batch.block_tables, batch.positions,
            self.kv_b_proj.weight, scale=self.scale, v_dim=self.v_dim,
        )  # fmt: skip

    def _absorbed(self, latent, q_nope, q_pe, batch, kv_cache):
        """Every query over the cache with W_UK absorbed into it and W_UV after -> [T, H, v]."""
        t = q_nope.shape[0]
        # The query [T, H, kv_lora + R] is built in place (no cat; only stores move, so the same
        # bits): the rotated q_pe into its last channels, W_UK's product into the rest.
        query = q_nope.new_empty((t, self.num_heads, self.kv_lora_rank + self.rope_dim))
        q_latent, q_rot = query.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        # Why a second branch: the cache write and W_UK's product read and write disjoint
        # parts (q_pe -> q_rot; q_nope -> q_latent), so they run side by side as well.
        with self.ops.branch(t) as side:
            self._write_cache(latent, q_pe, q_rot, batch, kv_cache, side)
            # Absorbed W_UK and W_UV: one batched GEMM over the heads each ([H, T, .] views).
            self.ops.batched_linear(
                q_nope.transpose(0, 1), self.w_uk_t, out=q_latent.transpose(0, 1)
            )
        out_latent = self.ops.mla_attention(
            query,
            kv_cache,
            batch.query_seq_ids,
            batch.block_tables,
            batch.positions,
            scale=self.scale,
            v_dim=self.kv_lora_rank,
            whole_heads=self.whole_heads,  # the launch every TP degree keeps
        )
        # W_UV's product stored through [H, T, v] strides into a [T, H, v] buffer: o_proj reads
        # it as [T, H * v] without a copy (a strided out moves only the stores, not the bits).
        out = out_latent.new_empty((t, self.num_heads, self.v_dim))
        self.ops.batched_linear(out_latent.transpose(0, 1), self.w_uv, out=out.transpose(0, 1))
        return out


def _call(fn, *args, **kwargs):
    """fn(*args, **kwargs): a branch's `run` where there is no branch."""
    return fn(*args, **kwargs)
