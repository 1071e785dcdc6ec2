"""Our model against transformers' DeepSeek-V2/V3 forward on tiny checkpoints the test writes.

Tolerance: fp32 logits within atol 2e-4 / rtol 1e-3 (different but equivalent MLA formulations:
we attend over the latent cache with W_UK absorbed, transformers expands K and V). Greedy
generations must agree token for token for 16 tokens.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe_runtime import LLM, SamplingParams  # noqa: E402
from moe_runtime.forward_batch import ForwardBatch  # noqa: E402

TINY = dict(
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
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}

CASES = {
    "v3-sigmoid-noaux_tc": ("v3", dict(q_lora_rank=None, routed_scaling_factor=2.5)),
    "v3-sigmoid-q_lora": ("v3", dict(q_lora_rank=24, routed_scaling_factor=2.5)),
    "v3-q_lora-yarn": ("v3", dict(q_lora_rank=24, rope_parameters=YARN)),
    "v2-softmax-greedy": ("v2", dict(q_lora_rank=None, topk_method="greedy")),
    "v2-softmax-group_limited-q_lora": (
        "v2",
        dict(q_lora_rank=24, topk_method="group_limited_greedy"),
    ),
}


def _write_checkpoint(path, family: str, extra: dict) -> torch.nn.Module:
    if family == "v3":
        config = transformers.DeepseekV3Config(**TINY, **extra)
        model_cls = transformers.DeepseekV3ForCausalLM
    else:
        config = transformers.DeepseekV2Config(**TINY, **extra)
        model_cls = transformers.DeepseekV2ForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(1234)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape) * 0.2 - 0.1)  # a non-zero bias exercises noaux_tc
    model.save_pretrained(path)
    return model


def _our_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    runner = llm.engine.executor.worker.runner
    block_size = runner.block_size
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    batch = ForwardBatch(
        token_ids=torch.tensor(token_ids),
        positions=torch.arange(n),
        query_seq_ids=torch.zeros(n, dtype=torch.int64),
        block_tables=torch.arange(num_blocks)[None],
        slot_mapping=torch.arange(n),
        logits_indices=torch.arange(n),
    )
    return runner.model(batch, runner.kv_caches)


def _hf_greedy(model: torch.nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding with full re-forwards (no cache), so nothing but the forward is trusted."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_match_transformers(tmp_path, case):
    family, extra = CASES[case]
    hf_model = _write_checkpoint(tmp_path, family, extra)
    llm = LLM({"model": {"path": str(tmp_path)}, "scheduler": {"max_model_len": 256}})
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 256, (40,), generator=gen).tolist()

    ours = _our_logits(llm, prompt)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-3)

    hf_tokens = _hf_greedy(hf_model, prompt, 16)
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf_tokens
