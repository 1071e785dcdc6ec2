"""CUDA-graph decode (kernels.cuda_graphs) on the GPU: the graphs change no bit.

- Generation with graphs on equals graphs off bitwise (token ids, logprobs, top-5) for 40
  prompts x 16 tokens in batches whose decode sizes cross the batch-size buckets.
- The graph path really ran: replays and captures counted on the DecodeGraphRunner.
- With scheduler.overlap_decode (the default here) the decode steps replayed ahead give the
  same bits as with it off; the lookaheads really served steps, most of them queued before
  the read with the sampled ids fed on the device.
- A real row's hidden states and logits are bitwise the same whatever the padding rows hold,
  and equal to the eager model's.
- A step replays the graph of the narrowest block-table width that holds its tables; a batch
  padded to a wider table, and one whose longest context needs the next width, give the eager
  model's bits.
- Scoring a generated sequence from its first token routes it as generation did (decode's
  routed experts from graph replays with lookaheads, scoring's from an eager prefill), its
  logprobs bitwise decode's.
Skipped without CUDA.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moe_runtime import LLM
from moe_runtime.forward_batch import ForwardBatch
from tests.invariance import mixed_params, mixed_prompts, run_each_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TINY_GPU = Path(__file__).resolve().parent.parent / "launch" / "configs" / "tiny_gpu.yaml"
NUM_PROMPTS, MAX_TOKENS = 40, 16
# Decode sizes 1, 3, 5, 18, 13 and 40: buckets 1, 4, 8, 32, 16, 64, each padded but the first.
BATCHES = [[0], [1, 2, 3], list(range(4, 9)), list(range(9, 27)), list(range(27, 40))]
BATCHES.append(list(range(NUM_PROMPTS)))
BASE = {"cache.enable_prefix_caching": False}


@pytest.fixture(scope="module")
def workload():
    return mixed_prompts(NUM_PROMPTS, 8, 120, seed=23), mixed_params(NUM_PROMPTS, MAX_TOKENS)


def _generate(workload, use_graphs: bool, overlap: bool | None = None):
    """-> (per batch {prompt: fingerprint}, the graph runner, the model runner)."""
    prompts, params = workload
    overrides = {"kernels.cuda_graphs": use_graphs, "scheduler.overlap_decode": overlap}
    results, runner = run_each_batch(LLM(TINY_GPU, **overrides, **BASE), prompts, params, BATCHES)
    return results, runner.graphs, runner


def test_gpu_graph_decode_bitwise_equals_eager(workload, caplog):
    eager, no_graphs, _ = _generate(workload, use_graphs=False)
    with caplog.at_level("INFO", logger="moe_runtime.worker.cuda_graphs"):
        graphed, graphs, _ = _generate(workload, use_graphs=True, overlap=False)
    assert no_graphs is None
    for got, want in zip(graphed, eager, strict=True):
        for i, fingerprint in want.items():
            assert len(fingerprint[0]) == MAX_TOKENS
            assert got[i] == fingerprint, f"prompt {i}: graph decode differs from eager"
    # Engagement: every pure decode step of every batch went through a replay.
    assert graphs.num_replays >= len(BATCHES) * (MAX_TOKENS - 1) // 2, graphs.num_replays
    assert graphs.num_captures >= 5, f"only {graphs.num_captures} bucket sizes were captured"
    captured = [r for r in caplog.records if r.getMessage().startswith("captured the decode")]
    assert len(captured) == graphs.num_captures  # each capture logged (the first step waits)


def test_gpu_overlap_decode_bitwise_equals_off(workload):
    """scheduler.overlap_decode (on by default with graphs on one rank): decode steps replayed
    ahead of the engine give the bits of the steps replayed when asked for."""
    plain, _, _ = _generate(workload, use_graphs=True, overlap=False)
    overlapped, graphs, runner = _generate(workload, use_graphs=True)
    lookahead = runner.lookahead
    assert lookahead.is_enabled, "overlap_decode is not on by default with CUDA graphs"
    for got, want in zip(overlapped, plain, strict=True):
        for i, fingerprint in want.items():
            assert got[i] == fingerprint, f"prompt {i}: the lookahead changed the output"
    # Engagement: most decode steps were served by a lookahead (a replay each).
    assert lookahead.num_hits >= len(BATCHES) * (MAX_TOKENS - 2) // 2, lookahead.num_hits
    assert graphs.num_replays >= lookahead.num_hits
    # ... and most of those were queued before the read, fed the sampled ids on the device.
    assert lookahead.num_unread_launches >= lookahead.num_hits // 2, (
        lookahead.num_unread_launches,
        lookahead.num_hits,
    )


def _decode_batch(num_seqs: int, block_size: int) -> ForwardBatch:
    """One decode token per sequence at positions 5, 21, 37, ...; sequence s owns blocks
    [3s, 3s + 3)."""
    positions = [5 + 16 * s for s in range(num_seqs)]
    tables = [[3 * s + b for b in range(3)] for s in range(num_seqs)]
    slots = [
        tables[s][p // block_size] * block_size + p % block_size for s, p in enumerate(positions)
    ]
    return ForwardBatch(
        token_ids=torch.tensor([(37 * s + 11) % 256 for s in range(num_seqs)]),
        positions=torch.tensor(positions),
        query_seq_ids=torch.arange(num_seqs),
        block_tables=torch.tensor(tables),
        slot_mapping=torch.tensor(slots),
        logits_indices=torch.arange(num_seqs),
    )


def test_gpu_graph_real_rows_ignore_padding_rows():
    llm = LLM(TINY_GPU, **{"kernels.cuda_graphs": True, **BASE})
    runner = llm.engine.executor.worker.runner
    graphs, num_real = runner.graphs, 3  # padded to bucket 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    for cache in runner.kv_caches:  # earlier positions: random latents
        cache.copy_(torch.randn(cache.shape, generator=gen, device="cuda").to(cache.dtype))
    batch = _decode_batch(num_real, runner.block_size)
    with torch.inference_mode():
        eager = runner.model(batch.to(runner.device), runner.kv_caches)
    assert graphs.can_run(True, batch)  # as the runner does: it also picks the bucket (4)
    clean = graphs.run(batch)
    size = graphs._graphs[4, graphs.table_widths[0]]  # three blocks: the narrowest table
    clean_states = [tuple(t.clone() for t in out) for out in size.outputs]

    load = graphs._load

    def scribble(size_graphs, host_batch):
        load(size_graphs, host_batch)
        size_graphs.batch.token_ids[num_real:] = 255
        for x in size.inputs[1:]:
            x[num_real:] = torch.randn(x[num_real:].shape, generator=gen, device="cuda") * 100

    graphs._load = scribble
    assert graphs.can_run(True, batch)
    noisy = graphs.run(batch)
    graphs._load = load
    moe_layers = runner.model.moe_layers
    loads = [int(moe.last_slot_counts.sum()) for moe in moe_layers]
    llm.shutdown()
    # Engagement: one rank, so the whole step is one graph with every MoE layer inside it.
    assert len(graphs.segments) == 1 and len(graphs.captured_moe) == len(moe_layers) > 0
    top_k = runner.model.config.num_experts_per_tok
    assert loads == [num_real * top_k] * len(moe_layers), "padding rows counted as expert load"
    assert graphs.num_replays == 2
    assert torch.equal(clean, eager), "graph logits differ from the eager model's"
    assert torch.equal(noisy, clean), "padding rows changed a real row's logits"
    for j, (before, after) in enumerate(zip(clean_states, size.outputs, strict=True)):
        for a, b in zip(before, after, strict=True):
            assert torch.equal(a[:num_real], b[:num_real]), f"segment {j}: real row changed"
    # Control: the padding rows really held something else the second time.
    assert not torch.equal(clean_states[-1][0][num_real:], size.outputs[-1][0][num_real:])


def test_gpu_graph_table_width_follows_the_batch_and_changes_no_bit():
    llm = LLM(TINY_GPU, **{"kernels.cuda_graphs": True, **BASE})
    runner = llm.engine.executor.worker.runner
    graphs, block_size = runner.graphs, runner.block_size
    assert len(graphs.table_widths) >= 3, graphs.table_widths  # contexts up to 1024, blocks of 16
    narrow, middle, wide = graphs.table_widths[:3]
    gen = torch.Generator(device="cuda").manual_seed(1)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen, device="cuda").to(cache.dtype))
    short = _decode_batch(3, block_size)  # tables of three blocks
    extra = middle + 1 - short.block_tables.shape[1]  # the same batch, tables padded with -1
    wider = F.pad(short.block_tables, (0, extra), value=-1)
    padded = dataclasses.replace(short, block_tables=wider)
    # Three sequences of narrow + 2 blocks each (their own), decoding past the narrow width.
    num_blocks = narrow + 2
    positions = [narrow * block_size + 5 + s for s in range(3)]
    tables = torch.tensor([[num_blocks * s + b for b in range(num_blocks)] for s in range(3)])
    slots = [int(tables[s, p // block_size]) * block_size + p % block_size
             for s, p in enumerate(positions)]  # fmt: skip
    long = dataclasses.replace(
        short,
        positions=torch.tensor(positions),
        block_tables=tables,
        slot_mapping=torch.tensor(slots),
    )
    got, want, widths = {}, {}, {}
    for name, batch in (("short", short), ("padded", padded), ("long", long)):
        with torch.inference_mode():
            want[name] = runner.model(batch.to(runner.device), runner.kv_caches)
        assert graphs.can_run(True, batch)
        widths[name] = graphs._step_width
        got[name] = graphs.run(batch)
    llm.shutdown()
    # Engagement: three widths of one size, each graph's tables as wide as its key says.
    assert widths == {"short": narrow, "padded": wide, "long": middle}, widths
    assert set(graphs._graphs) == {(4, narrow), (4, middle), (4, wide)}, list(graphs._graphs)
    for key, size in graphs._graphs.items():
        assert tuple(size.batch.block_tables.shape) == key, key
    for name in got:
        assert torch.equal(got[name], want[name]), f"{name}: graph replay differs from eager"
    assert torch.equal(got["padded"], got["short"]), "a wider table moved the bits"


def test_gpu_scoring_routes_a_sequence_as_its_generation_did(workload):
    """LLM.score_outputs(..., return_routed_experts=True) from the first token: the rows after
    the prompt are generation's routed experts (graphs and lookaheads on), bit for bit."""
    import numpy as np

    prompts, params = workload
    prompts, params = (
        prompts[:8],
        [dataclasses.replace(p, return_routed_experts=True) for p in params[:8]],
    )
    llm = LLM(TINY_GPU, **BASE)
    assert llm.config.kernels.cuda_graphs
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sequences = [p + o.outputs[0].token_ids for p, o in zip(prompts, outputs, strict=True)]
    whole = llm.score_outputs(
        sequences, [1] * len(sequences), return_routed_experts=True, use_tqdm=False
    )
    scored = llm.score_outputs(sequences, [len(p) for p in prompts], use_tqdm=False)
    llm.shutdown()
    for prompt, out, row, score in zip(prompts, outputs, whole, scored, strict=True):
        generated = np.asarray(out.outputs[0].routed_experts)
        assert generated.shape[0] == MAX_TOKENS and generated.size
        assert np.array_equal(np.asarray(row.routed_experts)[len(prompt) - 1 :], generated)
        hexed = [float.hex(x) for x in out.outputs[0].logprobs]
        assert hexed == [float.hex(x) for x in score.logprobs]
