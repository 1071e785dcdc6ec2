"""Our model against transformers' DeepSeek-V2/V3 forward on tiny checkpoints the test writes.

Tolerance: fp32 logits within atol 1e-4, rtol 0 (different but equivalent MLA formulations:
we attend over the latent cache with W_UK absorbed, transformers expands K and V). Greedy
generations must agree token for token for 16 tokens.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe_runtime import LLM, SamplingParams  # noqa: E402
from moe_runtime.forward_batch import ForwardBatch  # noqa: E402
from tests.checkpoints import write_tiny_checkpoint  # noqa: E402

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
    # rms_norm_eps reaches the residual norms only; q_a/kv_a norms keep transformers' 1e-6.
    "v3-eps-tied": ("v3", dict(q_lora_rank=24, rms_norm_eps=1e-2, tie_word_embeddings=True)),
    "v3-dense2-unnormalised": (
        "v3",
        dict(q_lora_rank=None, first_k_dense_replace=2, norm_topk_prob=False),
    ),
    # DeepSeek's V2 gate (tests/checkpoints.py): normalised, then not scaled.
    "v2-norm_topk_prob-yarn": (
        "v2",
        dict(
            q_lora_rank=None,
            norm_topk_prob=True,
            routed_scaling_factor=2.0,
            rms_norm_eps=1e-5,
            rope_parameters=YARN,
        ),
    ),
}


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
    hf_model = write_tiny_checkpoint(tmp_path, family, **extra)
    llm = LLM({"model": {"path": str(tmp_path)}, "scheduler": {"max_model_len": 256}})
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 256, (40,), generator=gen).tolist()

    ours = _our_logits(llm, prompt)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)

    hf_tokens = _hf_greedy(hf_model, prompt, 16)
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf_tokens
