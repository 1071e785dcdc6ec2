"""A layer's branches on a second CUDA stream (moe_kernels/streams.py) on the GPU: no bit moves.

- Generation with CUDA graphs (decode steps replayed, prefills eager) gives the same token ids,
  logprobs and top-5 bit for bit with kernels.side_stream_rows at its default and at 0 (off),
  for test_gpu_graphs' 40 prompts and batches.
- Engagement: the branches really forked onto the side stream, three times a MoE layer's
  step (kv_a, the cache write, the shared experts) in every capture and its warm-up; with 0
  the table has no side stream.
- Control: fast mode's kernels give other bits on the same workload.
- Split-K launches running at once on both streams (V2-Lite's kv_a and shared-expert down
  beside the router and o_proj, each with a fixed K split whose last program adds the parts
  by an arrival count) give the bits of the same launches run one after another, eager and
  in a graph: each stream has its own arrival counts.
Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from moe_kernels import KernelConfig, build_op_table
from moe_kernels.config import SIDE_STREAM_ROWS
from moe_kernels.triton_linear_config import k_split_count
from moe_runtime import LLM
from tests.invariance import mixed_params, mixed_prompts, run_each_batch
from tests.test_gpu_graphs import BATCHES, MAX_TOKENS, NUM_PROMPTS, TINY_GPU

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _generate(side_stream_rows: int, mode: str = "invariant"):
    """-> (per batch {prompt: fingerprint}, the worker's op table, its model)."""
    prompts = mixed_prompts(NUM_PROMPTS, 8, 120, seed=31)
    params = mixed_params(NUM_PROMPTS, MAX_TOKENS)
    overrides = {"kernels.side_stream_rows": side_stream_rows, "kernels.mode": mode}
    llm = LLM(TINY_GPU, **{"kernels.cuda_graphs": True, **overrides})
    results, runner = run_each_batch(llm, prompts, params, BATCHES)
    return results, runner.ops, runner


def test_gpu_side_stream_changes_no_bit():
    on, ops_on, runner = _generate(side_stream_rows=SIDE_STREAM_ROWS)
    off, ops_off, _ = _generate(side_stream_rows=0)
    for got, want in zip(on, off, strict=True):
        for i, fingerprint in want.items():
            assert len(fingerprint[0]) == MAX_TOKENS
            assert got[i] == fingerprint, f"prompt {i}: the side stream changed its bits"
    # Engagement: three forks a MoE layer a step (MLA's kv_a, its cache write, the shared
    # experts; a dense layer forks twice) in each capture and its warm-up, so the replayed
    # graphs hold the branches; none with the stream off.
    assert ops_off.side_stream is None
    num_layers = len(runner.model.model.layers)
    num_moe = len(runner.model.moe_layers)
    forks_a_step = 2 * num_layers + num_moe
    assert ops_on.side_stream.num_forks >= 2 * forks_a_step * runner.graphs.num_captures, (
        ops_on.side_stream.num_forks,
        forks_a_step,
        runner.graphs.num_captures,
    )
    assert runner.graphs.num_captures >= 5 and runner.graphs.num_replays > 0
    # Control: other kernels (fast mode, side stream on) give other bits on this workload.
    fast, _, _ = _generate(side_stream_rows=SIDE_STREAM_ROWS, mode="fast")
    assert any(got[i] != want[i] for got, want in zip(fast, on, strict=True) for i in want), (
        "fast mode gave the invariant bits: the fingerprints would not see a change"
    )


# V2-Lite weights whose decode launch splits K (their last program adds the parts): kv_a and
# the shared experts' down on the side stream, the router (fp32, the tree) and o_proj on the
# main one, as a decode step's branches put them.
SIDE_SHAPES = ((576, 2048, torch.bfloat16), (2048, 2816, torch.bfloat16))
MAIN_SHAPES = ((64, 2048, torch.float32), (2048, 2048, torch.bfloat16))
ROUNDS = 20


def test_gpu_split_k_launches_on_both_streams_keep_their_bits():
    ops = build_op_table(KernelConfig(), "cuda")
    side = ops.side_stream
    gen = torch.Generator(device="cuda").manual_seed(5)

    def operands(shapes):
        return [
            (
                torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16),
                torch.randn(n, k, generator=gen, device="cuda").to(dtype) * 0.05,
            )
            for n, k, dtype in shapes
        ]

    side_ops, main_ops = operands(SIDE_SHAPES), operands(MAIN_SHAPES)
    # Engagement: every one of these launches splits K at one row (arrival counts in use).
    for n, k, dtype in SIDE_SHAPES + MAIN_SHAPES:
        assert k_split_count(n, k, dtype) > 1, (n, k, dtype)

    def one(x, w):
        return ops.router_logits(x, w) if w.dtype == torch.float32 else ops.linear(x, w)

    def rounds():
        """ROUNDS of the side launches forked beside the main ones -> every output."""
        outs = []
        for _ in range(ROUNDS):
            with ops.branch(1) as branch:
                got_side = [branch.run(one, x, w) for x, w in side_ops]
                got_main = [one(x, w) for x, w in main_ops]
            outs.append(got_side + got_main)
        return outs

    with ops.branch(1) as branch:  # engagement: the side stream's launches take its counts
        assert branch.run(side.is_current) and not side.is_current()
    forks = side.num_forks
    with torch.inference_mode():
        want = [one(x, w) for x, w in side_ops + main_ops]  # one stream, one at a time
        eager = rounds()
        assert side.num_forks == forks + ROUNDS
        forks = side.num_forks
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            rounds()  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed = rounds()
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
    assert side.num_forks == forks + 2 * ROUNDS  # the warm-up's and the capture's branches
    for name, outs in (("eager", eager), ("graph", graphed)):
        for i, got in enumerate(outs):
            for j, (a, b) in enumerate(zip(got, want, strict=True)):
                assert torch.equal(a, b), f"{name} round {i}, launch {j}: bits moved"
