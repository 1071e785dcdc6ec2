"""Programmatic dependent launch (moe_kernels/triton_pdl.py) on the GPU: it changes no bit.

- Generation with CUDA graphs (the decode steps replayed, the prefills eager) gives the same
  token ids, logprobs and top-5 bit for bit with the Triton kernels launched with PDL and
  without it, for test_gpu_graphs' 40 prompts and batches (decode sizes across the graph buckets).
- Engagement: the launches of the PDL run asked for PDL and the GPU has it (the launch
  arguments counted), and the run without it asked for none.
- Control: fast mode's kernels give other bits on the same workload, so a comparison of these
  fingerprints sees a change of kernels.
Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from moe_kernels import triton_pdl
from moe_runtime import LLM
from tests.invariance import mixed_params, mixed_prompts, run_each_batch
from tests.test_gpu_graphs import BATCHES, MAX_TOKENS, NUM_PROMPTS, TINY_GPU

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HAS_PDL = triton_pdl._has_pdl  # the real check, before any test wraps it


def _generate(monkeypatch, is_pdl: bool, mode: str = "invariant") -> tuple[list, list[bool]]:
    """-> (per batch {prompt: fingerprint}, whether each launch argument check gave PDL)."""
    prompts = mixed_prompts(NUM_PROMPTS, 8, 120, seed=29)
    params = mixed_params(NUM_PROMPTS, MAX_TOKENS)
    asked = []

    def has_pdl(device_index: int) -> bool:
        asked.append(HAS_PDL(device_index))
        return asked[-1]

    monkeypatch.setattr(triton_pdl, "ENABLED", is_pdl)
    monkeypatch.setattr(triton_pdl, "_has_pdl", has_pdl)
    llm = LLM(TINY_GPU, **{"kernels.cuda_graphs": True, "kernels.mode": mode})
    results, _ = run_each_batch(llm, prompts, params, BATCHES)
    return results, asked


def test_gpu_pdl_launches_change_no_bit(monkeypatch):
    with_pdl, asked = _generate(monkeypatch, is_pdl=True)
    without, asked_off = _generate(monkeypatch, is_pdl=False)
    for got, want in zip(with_pdl, without, strict=True):
        for i, fingerprint in want.items():
            assert len(fingerprint[0]) == MAX_TOKENS
            assert got[i] == fingerprint, f"prompt {i}: PDL launches changed its bits"
    # Engagement: the kernels were launched with PDL (every check found it on this GPU),
    # and with ENABLED off none was asked for.
    assert len(asked) > 100 and all(asked), (len(asked), asked.count(False))
    assert asked_off == []
    # Control: other kernels (fast mode) give other bits on this workload.
    fast, _ = _generate(monkeypatch, is_pdl=True, mode="fast")
    assert any(got[i] != want[i] for got, want in zip(fast, with_pdl, strict=True) for i in want), (
        "fast mode gave the invariant bits: the fingerprints would not see a change"
    )
