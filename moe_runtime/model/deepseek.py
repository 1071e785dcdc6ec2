"""The DeepSeek-V2/V3-style decoder: embeddings, MLA + (dense MLP | DeepSeekMoE) layers, LM head.

Plain tensor math over the op table; module and parameter names mirror HF checkpoints
(`model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight`, ...). The model owns no KV memory:
the runner passes one latent cache tensor per layer.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_kernels import OpTable
from moe_runtime.forward_batch import ForwardBatch
from moe_runtime.model.layers import NO_TP, GatedMLP, Linear, RMSNorm
from moe_runtime.model.mla import MLAttention
from moe_runtime.model.moe import MoE
from moe_runtime.model.rope import RotaryEmbedding
from moe_runtime.model.tensor_parallel import TensorParallel
from moe_runtime.model_config import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LOGIT_ROWS = 1024  # rows the LM head runs on at once (DeepseekForCausalLM.logits)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        ops: OpTable,
        rope: RotaryEmbedding,
        dtype: torch.dtype,
        num_local_slots: int,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.self_attn = MLAttention(cfg, ops, rope, dtype, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        if cfg.is_moe_layer(layer_id):
            self.mlp = MoE(cfg, ops, dtype, num_local_slots, tp)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ops, dtype, tp)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoE)

    def attention_part(
        self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (x + attention, its post-attention norm): the MLP's residual and input.

        Free of host syncs and collectives (with tp.size 1), so a CUDA graph can capture it.
        """
        attn = self.self_attn(self.input_layernorm(x), batch, kv_cache)
        return self.post_attention_layernorm.add_and_norm(x, attn)

    def mlp_part(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Residual x [T, D] + MLP or MoE of the normed h [T, D]."""
        if self.is_moe:
            return self.mlp(h, residual=x)  # the residual add is fused into the MoE's output
        return x + self.mlp(h)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        return self.mlp_part(*self.attention_part(x, batch, kv_cache))


class DeepseekModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, ops: OpTable, num_local_slots: int, tp: TensorParallel
    ) -> None:
        super().__init__()
        dtype = TORCH_DTYPES[cfg.dtype]
        rope = RotaryEmbedding(
            cfg.qk_rope_head_dim,
            cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling,
            cfg.rope_interleave,
        )
        # Given its (uninitialised) weight, nn.Embedding skips its own init, which drew vocab x
        # hidden normals from torch's global generator: the caller's at world size 1, whose
        # stream then depended on whether (and how often: rebuilds) an LLM was built in its
        # process. Every loader path writes the weight anyway.
        embedding = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=embedding)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, ops, rope, dtype, num_local_slots, tp)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.rope = rope

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, D]: a row gather, no arithmetic."""
        return self.embed_tokens.weight[token_ids]

    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        x = self.embed(batch.token_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, batch, kv_cache)
        return x


class DeepseekForCausalLM(nn.Module):
    """`num_local_slots`: routed-expert slots held by this rank (all experts when None);
    `tp`: this rank's place in its tensor-parallel group (none by default)."""

    def __init__(
        self,
        cfg: ModelConfig,
        ops: OpTable,
        num_local_slots: int | None = None,
        tp: TensorParallel = NO_TP,
    ) -> None:
        super().__init__()
        if tp.size > 1 and cfg.tie_word_embeddings:
            raise ValueError("tied word embeddings are not supported with parallel.tp_size > 1")
        self.config, self.ops, self.tp = cfg, ops, tp
        self.model = DeepseekModel(cfg, ops, num_local_slots or cfg.n_routed_experts, tp)
        vocab = tp.split(cfg.vocab_size, "model.vocab_size")
        self.lm_head = Linear(cfg.hidden_size, vocab, ops, TORCH_DTYPES[cfg.dtype], cfg.vocab_size)

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.config.dtype]

    def after_weights_loaded(self) -> None:
        """Derive the absorbed MLA weights and re-join any gate/up pair whose storage was
        replaced; call after any change to the parameters."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for layer in self.model.layers:
            layer.self_attn.absorb_weights()
        for module in self.modules():
            if isinstance(module, GatedMLP):
                module.join_gate_up()

    @property
    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if layer.is_moe]

    def bind_expert_parallel(self, dispatcher, replica_rows: torch.Tensor) -> None:
        """replica_rows [L_moe, E]: this rank's static logical -> physical map per MoE layer."""
        for moe, row in zip(self.moe_layers, replica_rows, strict=True):
            moe.bind_expert_parallel(dispatcher, row)

    def to(self, *args, **kwargs):  # keep the rope tables beside the weights
        module = super().to(*args, **kwargs)
        self.model.rope.to(self.lm_head.weight.device)
        return module

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """-> fp32 logits [R, V] for the rows batch.logits_indices."""
        hidden = self.model(batch, kv_caches)
        return self.logits(hidden[batch.logits_indices])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: residual stream [R, D] -> fp32 logits [R, V], the head run
        on LOGIT_ROWS rows at a time. Why: a step of 8k scored rows held its logits in the
        model's dtype and in fp32 at once (4.6 GB at V2-Lite's vocabulary), past what a cache
        sized from free memory left on an H100. A row's logits are its own (the head's kernels
        are batch-invariant in invariant mode), so the blocks change no bit there."""
        normed = self.model.norm(hidden)
        gather = self.tp.all_gather_last  # vocab-parallel head: slices in rank order
        if normed.shape[0] <= LOGIT_ROWS:  # every decode step, graphs included
            return gather(self.lm_head(normed).float())
        # Each block's slices gathered on their own: the whole [R, V / tp] gathered at once
        # held its parts and their concatenation, two [R, V] fp32 beside the slice.
        logits = None
        for start in range(0, normed.shape[0], LOGIT_ROWS):
            block = gather(self.lm_head(normed[start : start + LOGIT_ROWS]))
            if logits is None:  # the gathered width known from the first block
                logits = block.new_empty(normed.shape[0], block.shape[1], dtype=torch.float32)
            logits[start : start + block.shape[0]] = block  # bf16 -> fp32 copy_ is exact
        return logits
