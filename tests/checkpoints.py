"""Tiny DeepSeek-V2/V3 checkpoints written with transformers (the outside reference), and
edited copies of them (the malformed checkpoints the loader must refuse)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TINY_HF = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=16,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=16,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=4,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    initializer_range=0.1,
    bos_token_id=256,
    eos_token_id=257,
)


def write_tiny_checkpoint(path, family: str = "v3", seed: int = 1234, **extra) -> torch.nn.Module:
    """Save a random tiny model to `path`; returns transformers' model (eval, eager attention).

    A non-zero e_score_correction_bias exercises noaux_tc routing. A V2 model whose config sets
    norm_topk_prob gets DeepSeek's released V2 gate, which transformers does not implement.
    """
    import transformers

    config_cls, model_cls = {
        "v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
    }[family]
    config = config_cls(**{**TINY_HF, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape) * 0.2 - 0.1)
    model.save_pretrained(path)
    if family == "v2" and config.norm_topk_prob:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        for module in model.modules():
            if isinstance(module, DeepseekV2TopkRouter):
                module.forward = _deepseek_v2_gate(module, module.forward)
    return model


def _deepseek_v2_gate(router, forward):
    """DeepSeek-V2's MoEGate (modeling_deepseek.py): with top_k > 1 and norm_topk_prob the chosen
    softmax scores are normalised and not scaled; otherwise scaled by routed_scaling_factor."""

    def gate(hidden_states):
        logits, _, topk_ids = forward(hidden_states)
        weights = logits.softmax(dim=-1, dtype=torch.float32).gather(1, topk_ids)
        if router.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights = weights * router.routed_scaling_factor
        return logits, weights, topk_ids

    return gate


def rewrite_checkpoint(
    src,
    dst,
    tensors: Callable[[dict], dict] | None = None,
    config: Callable[[dict], dict] | None = None,
) -> Path:
    """Copy the checkpoint directory `src` (config.json, model.safetensors) to the new directory
    `dst`, its tensors passed through `tensors(dict) -> dict` and its config through
    `config(dict) -> dict`; -> dst."""
    src, dst = Path(src), Path(dst)
    dst.mkdir()
    hf = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(hf) if config else hf))
    state = load_file(str(src / "model.safetensors"))
    save_file(tensors(state) if tensors else state, str(dst / "model.safetensors"))
    return dst


def write_byte_level_bpe(directory, corpus: str, special_tokens: tuple[str, ...] = ()) -> None:
    """A byte-level BPE tokenizer.json (the kind DeepSeek's models ship) trained on `corpus`:
    a character it never saw is one token a byte; `special_tokens` added after training."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet)
    tokenizer.train_from_iterator([corpus] * 20, trainer)
    tokenizer.add_special_tokens(list(special_tokens))
    tokenizer.save(str(Path(directory) / "tokenizer.json"))


def write_sentencepiece_like(directory, words: tuple[str, ...]) -> dict[str, int]:
    """A Llama-style tokenizer.json without the hub: sentencepiece pieces ("\u2581" for a
    space, stripped at the text's start by the decoder), a byte-fallback piece "<0xHH>" for
    every byte, the letters, and `words` (spelled with "\u2581"); -> its vocabulary. No merges:
    its encoder spells text letter by letter, so build ids from the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in [*"abcdefghijklmnopqrstuvwxyz", *words]:
        vocab.setdefault(piece, len(vocab))
    model = models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True)
    tokenizer = Tokenizer(model)
    space = "\u2581"
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend(space), normalizers.Replace(" ", space)]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace(space, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(Path(directory) / "tokenizer.json"))
    return vocab


def shard_checkpoint(src, dst, num_shards: int) -> Path:
    """Copy the checkpoint directory `src` (config.json, model.safetensors) to the new directory
    `dst` as HF saves a large one: its tensors, in name order, cut into `num_shards` files
    `model-0000i-of-0000n.safetensors`, and model.safetensors.index.json mapping each tensor to
    its file; -> dst."""
    src, dst = Path(src), Path(dst)
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    keys = sorted(state)
    weight_map = {}
    for shard in range(num_shards):
        name = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = keys[shard * len(keys) // num_shards : (shard + 1) * len(keys) // num_shards]
        save_file({key: state[key] for key in part}, str(dst / name))
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst
