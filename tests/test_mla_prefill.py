"""Fast mode's multi-head prefill (moe_kernels/mla_prefill.py) against the absorbed form's
reference: the same attention, another order of arithmetic (a tolerance, fast mode is not
invariant), and which steps it takes. The engine's fast mode on the GPU runs it through
tests/test_gpu_golden.py's fast-mode controls."""

from __future__ import annotations

import pytest
import torch

from moe_kernels.attention import mla_attention_ref
from moe_kernels.mla_prefill import MhaPrefill

HEADS, NOPE, ROPE, LORA, V, BLOCK = 4, 16, 8, 32, 16, 4


def _step(spans, gen):
    """A step over sequences whose queries sit at positions [start, end) each (a prompt, or a
    chunk over a cached prefix): (seq_ids, positions, block_tables, kv_cache) with every
    position up to each end already in the cache."""
    width = max(-(-end // BLOCK) for _, end in spans)
    tables = torch.full((len(spans), width), -1, dtype=torch.int64)
    next_block = 0
    for s, (_, end) in enumerate(spans):
        blocks = -(-end // BLOCK)
        tables[s, :blocks] = torch.randperm(blocks, generator=gen) + next_block
        next_block += blocks
    kv_cache = torch.randn(next_block, BLOCK, LORA + ROPE, generator=gen)
    seq_ids = torch.cat([torch.full((end - start,), s) for s, (start, end) in enumerate(spans)])
    positions = torch.cat([torch.arange(start, end) for start, end in spans])
    return seq_ids, positions, tables, kv_cache


def _absorbed(q_nope, q_rot, kv_cache, seq_ids, tables, positions, kv_b, scale):
    """The absorbed form: W_UK into the query, attention over the latent, W_UV after."""
    w = kv_b.view(HEADS, NOPE + V, LORA)
    query = torch.cat([torch.einsum("thn,hnl->thl", q_nope, w[:, :NOPE]), q_rot], -1)
    latent = mla_attention_ref(
        query, kv_cache, seq_ids, tables, positions, scale=scale, v_dim=LORA, tile_rows=8
    )
    return torch.einsum("thl,hvl->thv", latent, w[:, NOPE:])


@pytest.mark.parametrize(
    ("is_shuffled", "is_padded"), ((False, False), (True, False), (False, True))
)  # fmt: skip
def test_multi_head_prefill_matches_the_absorbed_form(monkeypatch, is_shuffled, is_padded):
    """is_padded: the values padded to the query's head dim, as on CUDA without cuDNN's
    attention (here forced on the CPU: the same attention, the padding sliced off)."""
    from moe_kernels import mla_prefill

    padded = []
    monkeypatch.setattr(mla_prefill, "_pads_values", lambda query: padded.append(1) or is_padded)
    gen = torch.Generator().manual_seed(0)
    # A whole prompt, a chunk over a 5-token cached prefix (crossing blocks), another prompt.
    seq_ids, positions, tables, kv_cache = _step([(0, 10), (5, 13), (0, 8)], gen)
    if is_shuffled:  # a sequence's rows need not be contiguous or in order
        order = torch.randperm(seq_ids.shape[0], generator=gen)
        seq_ids, positions = seq_ids[order], positions[order]
    t = seq_ids.shape[0]
    q_nope = torch.randn(t, HEADS, NOPE, generator=gen)
    q_rot = torch.randn(t, HEADS, ROPE, generator=gen)
    kv_b = torch.randn(HEADS * (NOPE + V), LORA, generator=gen) * LORA**-0.5
    scale = (NOPE + ROPE) ** -0.5
    prefill = MhaPrefill(min_queries=4, min_heads=HEADS)
    assert prefill.takes(seq_ids, positions, tables, HEADS)
    query = torch.cat([q_nope, q_rot], -1)
    got = prefill(query, kv_cache, seq_ids, tables, positions, kv_b, scale=scale, v_dim=V)
    want = _absorbed(q_nope, q_rot, kv_cache, seq_ids, tables, positions, kv_b, scale)
    assert got.shape == (t, HEADS, V)
    # Engagement: in order every sequence's rows are one slice (read as a view), shuffled none.
    sequences = prefill._sequences(seq_ids, positions, tables.shape[0])
    assert [seq.start is not None for seq in sequences] == [not is_shuffled] * 3
    # The chunk's queries see its cached prefix and no later key: a causal mask aligned to
    # the first key instead of the last query would fail here.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert padded == [1]  # engagement: the step asked once whether to pad its values


def test_multi_head_prefill_takes_prefill_shaped_steps_only():
    gen = torch.Generator().manual_seed(1)
    prefill = MhaPrefill(min_queries=4, min_heads=HEADS)
    seq_ids, positions, tables, _ = _step([(0, 6), (2, 7)], gen)
    assert prefill.takes(seq_ids, positions, tables, HEADS)
    # A context past max_keys keeps the absorbed form (the expansion is whole).
    assert not MhaPrefill(min_queries=4, min_heads=HEADS, max_keys=6).takes(
        seq_ids, positions, tables, HEADS
    )  # fmt: skip
    assert MhaPrefill(min_queries=4, min_heads=HEADS, max_keys=7).takes(
        seq_ids, positions, tables, HEADS
    )  # fmt: skip
    # A rank of fewer heads than min_heads keeps the absorbed form (the default: 128).
    assert not prefill.takes(seq_ids, positions, tables, HEADS - 1)
    assert MhaPrefill().min_heads == 128
    # A sequence with fewer queries than min_queries (a decode among prompts): refused.
    seq_ids, positions, tables, _ = _step([(0, 6), (6, 7)], gen)
    assert not prefill.takes(seq_ids, positions, tables, HEADS)
    # Decode-shaped (one query a sequence): refused from the shapes alone.
    seq_ids, positions, tables, _ = _step([(5, 6), (3, 4)], gen)
    assert not prefill.takes(seq_ids, positions, tables, HEADS)
    # A gap in a sequence's positions (not a prompt chunk): refused, and calling it raises.
    seq_ids, positions, tables, kv_cache = _step([(0, 8)], gen)
    positions = torch.cat([positions[:4], positions[5:], torch.tensor([9])])
    assert not prefill.takes(seq_ids, positions, tables, HEADS)
    with pytest.raises(ValueError, match="not prefill-shaped"):
        prefill(
            torch.zeros(8, HEADS, NOPE + ROPE), kv_cache, seq_ids, tables, positions,
            torch.zeros(HEADS * (NOPE + V), LORA), scale=1.0, v_dim=V,
        )  # fmt: skip


def test_only_the_fast_cuda_table_prefills_in_the_multi_head_form():
    from moe_kernels import KernelConfig, build_op_table

    assert isinstance(build_op_table(KernelConfig(mode="fast"), "cuda").mla_prefill, MhaPrefill)
    for mode, device in (("invariant", "cuda"), ("fast", "cpu"), ("invariant", "cpu")):
        assert build_op_table(KernelConfig(mode=mode), device).mla_prefill is None


def test_the_attention_layer_prefills_in_the_multi_head_form_like_the_absorbed_one():
    """MLAttention's multi-head branch (q before W_UK, the rotated rope, kv_b_proj's weight,
    the softmax scale, the heads into o_proj) against its absorbed branch on one prompt and
    one chunk over a cached prefix, tiny model, fp32 on the CPU (the CPU's fast table has no
    multi-head prefill; here one is put in it)."""
    import dataclasses

    from moe_kernels import KernelConfig, build_op_table
    from moe_runtime.config import load_config
    from moe_runtime.forward_batch import ForwardBatch
    from moe_runtime.model.layers import NO_TP
    from moe_runtime.model.mla import MLAttention
    from moe_runtime.model.rope import RotaryEmbedding

    cfg = load_config("launch/configs/tiny_cpu.yaml").model
    torch.manual_seed(0)
    rope = RotaryEmbedding(
        cfg.qk_rope_head_dim, 64, cfg.rope_theta, cfg.rope_scaling, cfg.rope_interleave
    )  # fmt: skip
    calls = []

    class Counted(MhaPrefill):
        def __call__(self, *args, **kwargs):
            calls.append(args[0].shape[0])
            return super().__call__(*args, **kwargs)

    absorbed = build_op_table(KernelConfig(mode="fast"), "cpu")
    multi_head = dataclasses.replace(
        absorbed, mla_prefill=Counted(min_queries=4, min_heads=cfg.num_attention_heads)
    )
    layers = {}
    for name, ops in (("absorbed", absorbed), ("multi_head", multi_head)):
        layer = MLAttention(cfg, ops, rope, torch.float32, NO_TP)
        for p in layer.parameters():
            p.requires_grad_(False)
        layers[name] = layer
    for p in layers["absorbed"].parameters():
        p.normal_(0, 0.2)
    layers["multi_head"].load_state_dict(layers["absorbed"].state_dict())
    for layer in layers.values():
        layer.absorb_weights()
    gen = torch.Generator().manual_seed(2)
    seq_ids, positions, tables, _ = _step([(0, 9), (6, 14)], gen)
    slots = torch.stack([tables[s, p // BLOCK] * BLOCK + p % BLOCK for s, p in zip(
        seq_ids.tolist(), positions.tolist(), strict=True
    )])  # fmt: skip
    num_blocks = int(tables.max()) + 1
    prefix = torch.randn(num_blocks, BLOCK, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=gen)
    batch = ForwardBatch(
        token_ids=torch.zeros_like(seq_ids), positions=positions, query_seq_ids=seq_ids,
        block_tables=tables, slot_mapping=slots, logits_indices=torch.arange(seq_ids.shape[0]),
    )  # fmt: skip
    x = torch.randn(seq_ids.shape[0], cfg.hidden_size, generator=gen)
    outs, caches = {}, {}
    for name, layer in layers.items():
        caches[name] = prefix.clone()  # the second sequence's prefix 0-5 as if cached
        outs[name] = layer(x, batch, caches[name])
    assert calls == [seq_ids.shape[0]]  # the multi-head branch ran, once, on every token
    assert torch.equal(caches["absorbed"], caches["multi_head"])  # the same cache writes
    torch.testing.assert_close(outs["multi_head"], outs["absorbed"], rtol=1e-4, atol=1e-5)
    assert not torch.equal(outs["multi_head"], outs["absorbed"])  # another order of adds


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_multi_head_prefill_on_the_gpu_matches_the_absorbed_form():
    """The same check in bf16 on the GPU, where SDPA runs FlashAttention over the padded value
    heads, at V2-Lite's head dims (nope 128, rope 64, latent 512, v 128; 16 heads)."""
    heads, nope, rope, lora, v, block = 16, 128, 64, 512, 128, 64
    gen = torch.Generator().manual_seed(3)
    spans = [(0, 300), (200, 457)]
    width = max(-(-end // block) for _, end in spans)
    tables = torch.arange(len(spans) * width).view(len(spans), width)
    kv_cache = torch.randn(len(spans) * width, block, lora + rope, generator=gen)
    seq_ids = torch.cat([torch.full((end - start,), s) for s, (start, end) in enumerate(spans)])
    positions = torch.cat([torch.arange(start, end) for start, end in spans])
    t = seq_ids.shape[0]
    q_nope = torch.randn(t, heads, nope, generator=gen)
    q_rot = torch.randn(t, heads, rope, generator=gen)
    kv_b = torch.randn(heads * (nope + v), lora, generator=gen) * lora**-0.5
    scale = (nope + rope) ** -0.5
    w = kv_b.view(heads, nope + v, lora)
    query = torch.cat([torch.einsum("thn,hnl->thl", q_nope, w[:, :nope]), q_rot], -1)
    latent = mla_attention_ref(
        query, kv_cache, seq_ids, tables, positions, scale=scale, v_dim=lora, tile_rows=64
    )
    want = torch.einsum("thl,hvl->thv", latent, w[:, nope:])
    both = torch.cat([q_nope, q_rot], -1)
    cuda = [x.cuda() for x in (both, kv_cache, seq_ids, tables, positions, kv_b)]
    bf16 = [x.bfloat16() if x.is_floating_point() else x for x in cuda]
    prefill = MhaPrefill(min_heads=heads)
    assert prefill.takes(bf16[2], bf16[4], bf16[3], heads)
    got = prefill(*bf16, scale=scale, v_dim=v)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2)
