"""TP invariance on the GPU: the compiled row-parallel Triton kernels, and TP=2 == TP=1 over NCCL.

- One GPU: on DeepSeek-V2-Lite's shapes in bf16 (dense mlp_down, the runtime's row-parallel
  weight; o_proj and the two shared experts' down_proj, which run whole on token shares now but
  keep their chunk widths here), every tp in {1, 2, 4, 8} gives the tp=1 bits; a row's bits ignore
  the row count and permutations; the tree-sum kernel rounds to bf16 exactly as torch does;
  close to fp64 (tolerance stated).
- One GPU: every column-parallel slice (q, gate/up, LM head) gives the whole linear's columns.
- One GPU, TP 2 and 4 as Ray actors over gloo at V2-Lite's widths: the TP=1 bits.
- Two GPUs, one Ray actor each over NCCL: the tiny model at TP=2 gives the world-size-1 bits
  (token ids, chosen and top-k logprobs, score()); engagement: both ranks all-gathered fp32
  subtree sums (the dense down_proj) and swapped attention heads for token shares (o_proj);
  control: fast mode at TP=2 differs from fast mode at TP=1.
Skipped without CUDA (and the second part without two GPUs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_kernels.tp_linear import tree_sum
from moe_runtime import LLM
from tests.invariance import mixed_params, mixed_prompts, random_sub_batches, run_in_batches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TINY_GPU = Path(__file__).resolve().parent.parent / "launch" / "configs" / "tiny_gpu.yaml"
TP_MAX = 8
# (out, in) the tree kernels are checked on: V2-Lite's o_proj (chunks on the 64-column grid),
# dense mlp_down (the row-parallel weight) and shared experts' down_proj (chunks off the grid).
V2_LITE_ROW_PARALLEL = [(2048, 2048), (2048, 10944), (2048, 2816)]
# 300 takes the in-program tree on 64-column-step chunks (moe_kernels/triton_tp_linear.py
# TREE_MIN_ROWS), 513 and 4100 on the others too, 4100 two row launches on long ones; the
# smaller prefixes the chunk path.
ROWS = (1, 2, 16, 17, 64, 65, 300, 513, 4100)
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}  # one bf16 rounding of outputs of magnitude ~1
NUM, MAX_TOKENS = 16, 16


def _at_tp(x, w, tp_size):
    from moe_kernels.triton_tp_linear import row_parallel_linear_triton, tp_linear_triton

    xs, ws = x.chunk(tp_size, dim=1), w.chunk(tp_size, dim=1)
    subtrees = [
        tp_linear_triton(xs[r], ws[r], TP_MAX // tp_size, k_origin=r * xs[0].shape[1])
        for r in range(tp_size)
    ]
    return row_parallel_linear_triton(
        xs[0], ws[0], tp_size, lambda t: subtrees, None, tp_max=TP_MAX
    )


def test_gpu_tree_off_grid_chunks_full_or_half_steps_same_bits():
    """The shared experts' down (352-column chunks, off the 64-column grid): the in-program
    tree in masked 64-column steps (the default) == in 32-column steps == the chunk launch,
    bitwise, on every tile shape the tree may run."""
    from moe_kernels.triton_chunk_tree import TREE_CONFIG, grid_steps, linear_chunk_tree
    from moe_kernels.triton_linear_config import LinearConfig
    from moe_kernels.triton_tp_linear import launch_tp_chunks

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1100, 2816, generator=gen).bfloat16().cuda()
    w = (torch.randn(2048, 2816, generator=gen) / 2816**0.5).bfloat16().cuda()
    assert grid_steps(352, 8, 64) == 6
    want = launch_tp_chunks(x, w, 8, torch.bfloat16)
    for config in (TREE_CONFIG, LinearConfig(128, 64, 64, 8, 8, 3)):
        for is_grid in (True, False):
            got = linear_chunk_tree(x, w, 8, torch.bfloat16, config, is_grid=is_grid)
            assert torch.equal(got, want), (config, is_grid)
    # Both loop forms of the kernel (one loop; a chunk loop around each chunk's steps).
    for config in (
        TREE_CONFIG,
        LinearConfig(128, 64, 64, 8, 4, 3),
        LinearConfig(128, 128, 64, 8, 8, 3),
    ):
        for form in (False, True):
            for is_tree in (True, False):
                got = linear_chunk_tree(
                    x, w, 8, torch.bfloat16, config, is_tree=is_tree, is_chunk_loop=form
                )
                base = (
                    want
                    if is_tree
                    else linear_chunk_tree(x, w, 8, torch.bfloat16, config, is_tree=False)
                )
                assert torch.equal(got, base), (config, form, is_tree)


@pytest.mark.parametrize("num_rows", [1100, 8192])
def test_gpu_tree_paired_form_same_bits(num_rows):
    """o_proj's shape (2048 x 2048, 8 chunks of 256 columns: whole K steps): the paired form
    (PAIRED_TREE_CONFIG, the default there) == the one-loop tree on TREE_CONFIG == the chunk
    launch, bitwise, and on other tiles; engagement: the default takes the paired form."""
    from moe_kernels.triton_chunk_tree import (
        PAIRED_TREE_CONFIG,
        TREE_CONFIG,
        _chunk_tree_kernel,
        linear_chunk_tree,
    )
    from moe_kernels.triton_linear_config import LinearConfig
    from moe_kernels.triton_tp_linear import launch_tp_chunks

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(num_rows, 2048, generator=gen).bfloat16().cuda()
    w = (torch.randn(2048, 2048, generator=gen) / 2048**0.5).bfloat16().cuda()
    want = launch_tp_chunks(x, w, 8, torch.bfloat16)
    assert torch.equal(linear_chunk_tree(x, w, 8, torch.bfloat16, TREE_CONFIG), want)
    import moe_kernels.triton_chunk_tree as chunk_tree

    launches = []

    class Recorder:  # the launch's constexprs, then the real launch
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs)
                return _chunk_tree_kernel[grid](*args, **kwargs)

            return launch

    chunk_tree._chunk_tree_kernel = Recorder()
    try:
        got = linear_chunk_tree(x, w, 8, torch.bfloat16)
    finally:
        chunk_tree._chunk_tree_kernel = _chunk_tree_kernel
    assert torch.equal(got, want)
    assert [(k["IS_PAIRED"], k["BLOCK_M"], k["BLOCK_N"]) for k in launches] == [(True, 128, 64)]
    for config in (PAIRED_TREE_CONFIG, TREE_CONFIG, LinearConfig(128, 64, 64, 8, 8, 4)):
        got = linear_chunk_tree(x, w, 8, torch.bfloat16, config, is_paired=True)
        assert torch.equal(got, want), config
    # Control: the chain over the same chunks differs.
    assert not torch.equal(linear_chunk_tree(x, w, 8, torch.bfloat16, is_tree=False), want)


@pytest.mark.parametrize("in_dim", [2048, 2816])
def test_gpu_tree_hand_off_same_bits_under_graph_replay(in_dim):
    """The hand-off launch (a tile's programs add their subtrees as they finish; the second of
    a pair spins on the first's flag) gives the in-program tree's bits for 1, 2 and 4 chunks
    a program on every tile shape, at 1100 rows and at 4100 (two row launches), eager and
    in 20 replays of one graph (a race that read a part before its store would show as a
    changed bit or a left NaN), and leaves every node's counts at zero."""
    from moe_kernels.triton_chunk_tree import linear_chunk_tree
    from moe_kernels.triton_linear_config import LinearConfig
    from moe_kernels.triton_split_k import arrival_counts, launch_split_k

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4100, in_dim, generator=gen).bfloat16().cuda()
    w = (torch.randn(2048, in_dim, generator=gen) / in_dim**0.5).bfloat16().cuda()
    arrivals = arrival_counts("cuda")
    configs = (
        LinearConfig(64, 64, 64, 8, 4, 4),
        LinearConfig(128, 64, 64, 8, 8, 3),
        LinearConfig(128, 128, 64, 8, 8, 3),
    )

    def hand_off(rows, config, per_program):
        out = torch.empty(rows, w.shape[0], dtype=x.dtype, device="cuda")
        return launch_split_k(
            x[:rows], w, out, in_dim // TP_MAX, config, is_tree=True,
            chunks_per_program=per_program, arrivals=arrivals, is_handoff=True,
        )  # fmt: skip

    cases = [(r, c, g) for r in (1100, 4100) for c in configs for g in (1, 2, 4)]
    wants = {r: linear_chunk_tree(x[:r], w, TP_MAX, torch.bfloat16) for r in (1100, 4100)}
    eager = [hand_off(*case) for case in cases]
    for case, got in zip(cases, eager, strict=True):
        assert torch.equal(got, wants[case[0]]), case
    assert not arrivals.any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [hand_off(*case) for case in cases]
    for _ in range(20):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for case, out in zip(cases, outs, strict=True):
            assert torch.equal(out, wants[case[0]]), case
    assert not arrivals.any()


@pytest.mark.parametrize(("out_dim", "in_dim"), V2_LITE_ROW_PARALLEL)
def test_gpu_every_tp_degree_same_bits_and_rows_invariant(out_dim, in_dim):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(max(ROWS), in_dim, generator=gen).bfloat16().cuda()
    w = (torch.randn(out_dim, in_dim, generator=gen) / in_dim**0.5).bfloat16().cuda()
    full = _at_tp(x, w, 1)
    expected = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(full.float(), expected, **BF16_TOL)
    for tp_size in (2, 4, 8):
        assert torch.equal(_at_tp(x, w, tp_size), full), tp_size
    for m in ROWS:
        assert torch.equal(_at_tp(x[:m], w, 1), full[:m]), m
    perm = torch.randperm(x.shape[0], generator=gen).cuda()
    assert torch.equal(_at_tp(x[perm], w, 2), full[perm])


# (out, in) of the column-parallel weights: V2-Lite q_proj, shared and dense gate/up, LM head;
# V3 q_b_proj, shared and dense gate/up.
COLUMN_PARALLEL = [
    (3072, 2048),
    (2816, 2048),
    (10944, 2048),
    (102400, 2048),
    (24576, 1536),
    (2048, 7168),
    (18432, 7168),
]


def test_gpu_column_parallel_slices_same_bits():
    """Every TP rank's column slice, with the whole weight's out dim, gives the whole linear's
    columns bitwise at 1-300 rows; control: slices on their own shape change the K split of
    some weights (the TP=2 divergence this fixed)."""
    from moe_kernels.triton_linear import linear_triton

    gen = torch.Generator(device="cuda").manual_seed(3)
    diverged = []
    for out_dim, in_dim in COLUMN_PARALLEL:
        x = torch.randn(300, in_dim, generator=gen, device="cuda").bfloat16()
        w = (torch.randn(out_dim, in_dim, generator=gen, device="cuda") / in_dim**0.5).bfloat16()
        for m in (1, 16, 64, 300):
            whole = linear_triton(x[:m], w)
            for tp_size in (2, 4, 8):
                for rank, rows in enumerate(w.chunk(tp_size)):
                    cols = slice(rank * rows.shape[0], (rank + 1) * rows.shape[0])
                    part = linear_triton(x[:m], rows, whole_out_dim=out_dim)
                    assert torch.equal(part, whole[:, cols]), (out_dim, in_dim, m, tp_size)
                    if not torch.equal(linear_triton(x[:m], rows), whole[:, cols]):
                        diverged.append((out_dim, in_dim, m, tp_size))
    assert diverged, "no slice changed its K split on its own shape: the check could not fail"


def test_gpu_tree_sum_kernel_bitwise():
    from moe_kernels.triton_tp_linear import tree_sum_triton

    gen = torch.Generator().manual_seed(1)
    for num_parts in (1, 2, 4, 8):
        scale = torch.pow(10.0, torch.randint(-6, 7, (num_parts, 65, 300), generator=gen))
        parts = (torch.randn(num_parts, 65, 300, generator=gen) * scale).cuda()
        expected = tree_sum(list(parts))
        assert torch.equal(tree_sum_triton(parts, torch.float32), expected)
        assert torch.equal(tree_sum_triton(parts, torch.bfloat16), expected.bfloat16())


def test_gpu_split_k_launches_replay_in_a_graph():
    """The split-K launches' last-arriving program adds the parts and zeroes its tile's count:
    one CUDA graph of the fixed-split linear (kv_a, chunk order, folded at 8 rows), the tp_max
    tree (mlp_down's 1368-column chunks, folded at 16 rows) sharing one arrival buffer, and
    unfolded calls (64 rows, and 4100 rows: two row launches), replayed 20 times, gives the
    eager bits every time and leaves every count at zero."""
    from moe_kernels.triton_linear import linear_triton
    from moe_kernels.triton_linear_config import k_split_count
    from moe_kernels.triton_split_k import arrival_counts
    from moe_kernels.triton_tp_linear import row_parallel_linear_triton

    gen = torch.Generator(device="cuda").manual_seed(7)
    kv_a = torch.randn(576, 2048, generator=gen, device="cuda").bfloat16() / 2048**0.5
    down = torch.randn(2048, 10944, generator=gen, device="cuda").bfloat16() / 10944**0.5
    assert k_split_count(576, 2048, torch.bfloat16) > 1  # the chunk-order path runs
    x_a = torch.randn(64, 2048, generator=gen, device="cuda").bfloat16()
    x_d = torch.randn(4100, 10944, generator=gen, device="cuda").bfloat16()

    arrivals = arrival_counts("cuda")

    def step():
        return (
            linear_triton(x_a[:8], kv_a, arrivals=arrivals),  # folded: <= 16 rows
            linear_triton(x_a, kv_a, arrivals=arrivals),
            row_parallel_linear_triton(x_d[:16], down, 1, None, None, tp_max=8, arrivals=arrivals),
            _at_tp(x_d[:64], down, 1),
            _at_tp(x_d, down, 1),
        )

    eager = step()  # compiles, and makes the arrival counts before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(20):
        for out in outs:
            out.fill_(float("nan"))  # a replay that skipped a tile's finish leaves NaN
        graph.replay()
        torch.cuda.synchronize()
        for out, want in zip(outs, eager, strict=True):
            assert torch.equal(out, want)
    assert not arrivals.any()


@pytest.fixture(scope="module")
def ray_on_gpu():
    ray = pytest.importorskip("ray")
    ray.init(
        address="local",
        num_cpus=8,
        num_gpus=torch.cuda.device_count(),
        include_dashboard=False,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


def _assert_heads_exchanged(stats: list[dict]) -> None:
    """Every rank swapped its heads for its token share and gathered o_proj's rows, in step."""
    exchanges = [s["num_tp_head_exchanges"] for s in stats]
    assert len(set(exchanges)) == 1 and exchanges[0] > 0, exchanges
    assert [s["num_tp_attention_gathers"] for s in stats] == exchanges


def _run(mode: str, workload, **overrides) -> tuple[dict, dict, list, list[dict]]:
    """(together, shuffled sub-batches, score() logprobs, worker stats) of one engine."""
    prompts, params = workload
    llm = LLM(TINY_GPU, **{"kernels.mode": mode, "parallel.timeout_s": 120, **overrides})
    try:
        together = run_in_batches(llm, prompts, params, [list(range(NUM))])
        shuffled = run_in_batches(llm, prompts, params, random_sub_batches(NUM, seed=5))
        score = llm.score(mixed_prompts(4, 40, 80, seed=5), [8] * 4)
        stats = llm.engine.worker_stats()
    finally:
        llm.shutdown()
    return together, shuffled, score, stats


TP2_NCCL = {"parallel.world_size": 2, "parallel.tp_size": 2, "parallel.backend": "nccl"}
# The tiny model at V2-Lite's attention widths (16 heads of 128 + 64, latent 512, hidden 2048,
# q_lora 1536): q_b_proj's TP slices are narrow enough to take a K split of their own, as
# V2-Lite's q_proj does, and the dense gate/up's at TP 4 (the tiny widths never split K).
WIDE = {
    "model.hidden_size": 2048,
    "model.intermediate_size": 5632,
    "model.moe_intermediate_size": 1408,
    "model.num_attention_heads": 16,
    "model.q_lora_rank": 1536,
    "model.kv_lora_rank": 512,
    "model.qk_nope_head_dim": 128,
    "model.qk_rope_head_dim": 64,
    "model.v_head_dim": 128,
}


@pytest.fixture(scope="module")
def workload():
    return mixed_prompts(NUM, 8, 200, seed=17), mixed_params(NUM, MAX_TOKENS)


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("mode", ["invariant", "fast"])
@pytest.mark.usefixtures("ray_on_gpu")
def test_gpu_tp2_nccl_gives_tp1_bits(workload, mode):
    together1, _, score1, _ = _run(mode, workload)
    together, shuffled, score, stats = _run(mode, workload, **TP2_NCCL)
    assert [(s["tp_size"], s["tp_rank"]) for s in stats] == [(2, 0), (2, 1)]
    counts = [s["num_tp_all_reduces"] for s in stats]
    assert counts[0] == counts[1] > 0, counts
    _assert_heads_exchanged(stats)
    if mode == "fast":  # control: the backend's all_reduce of bf16 partials
        assert [s["num_tp_fp32_gathers"] for s in stats] == [0, 0]
        assert score != score1 or together != together1, "fast TP=2 gave the TP=1 bits"
        return
    assert [s["num_tp_fp32_gathers"] for s in stats] == counts
    assert score == score1, "TP=2 score() logprobs differ from TP=1"
    for i in range(NUM):
        assert together[i] == together1[i], f"prompt {i}: TP=2 batched differs from TP=1"
        assert shuffled[i] == together1[i], f"prompt {i}: TP=2 shuffled differs from TP=1"


@pytest.mark.parametrize("mode", ["invariant", "fast"])
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.usefixtures("ray_on_gpu")
def test_gpu_tp_gloo_one_gpu_gives_tp1_bits(workload, mode, tp_size):
    """TP 2 and 4 as Ray actors sharing one GPU, gloo between them, at V2-Lite's widths: the
    compiled kernels (column slices, the dense down's fixed tp_max split, o_proj and the MoE
    on token shares) give the TP=1 bits; engagement: every rank gathered fp32 subtree sums and
    exchanged heads; control: fast mode differs."""
    tp = {"parallel.world_size": tp_size, "parallel.tp_size": tp_size, "parallel.backend": "gloo"}
    together1, _, score1, _ = _run(mode, workload, **WIDE)
    together, shuffled, score, stats = _run(mode, workload, **WIDE, **tp)
    assert [s["tp_rank"] for s in stats] == list(range(tp_size))
    counts = [s["num_tp_all_reduces"] for s in stats]
    assert len(set(counts)) == 1 and counts[0] > 0, counts
    _assert_heads_exchanged(stats)
    if mode == "fast":
        assert score != score1 or together != together1, f"fast TP={tp_size} gave TP=1 bits"
        return
    assert [s["num_tp_fp32_gathers"] for s in stats] == counts
    assert score == score1, f"TP={tp_size} score() logprobs differ from TP=1"
    for i in range(NUM):
        assert together[i] == together1[i], f"prompt {i}: TP={tp_size} batched differs"
        assert shuffled[i] == together1[i], f"prompt {i}: TP={tp_size} shuffled differs"
