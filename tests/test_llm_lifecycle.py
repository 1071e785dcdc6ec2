"""Lifecycle of the Python API inside a bigger program, found by an outside audit: an LLM beside
the caller's own torch.distributed group, one dropped without shutdown, shutdown from another
thread, Ctrl-C, a forked child, and llm.engine stepped from a second thread."""

from __future__ import annotations

import torch.distributed as dist

from moe_runtime import LLM, SamplingParams
from tests.invariance import TINY_CONFIG, fingerprint


def test_shutdown_at_world_size_1_leaves_the_callers_process_group(tmp_path):
    """An RL trainer's own default group: shutting down (or rebuilding) an in-process rank
    destroyed it, though the rank never joined it."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", world_size=1, rank=0
    )
    try:
        llm = LLM(TINY_CONFIG)
        params = SamplingParams(max_tokens=3, seed=1)
        expected = fingerprint(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0])
        llm.shutdown()
        assert dist.is_initialized()
        assert fingerprint(LLM(TINY_CONFIG).generate([[5, 6, 7]], params)[0]) == expected
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
