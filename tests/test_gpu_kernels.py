"""Triton kernels on the GPU: bit-exact row invariance (prefixes across block thresholds,
permutations, fresh neighbours) at DeepSeek-V2-Lite shapes, closeness to the torch oracles,
and cuBLAS / torch as the negative control that the same comparison can fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_kernels.rmsnorm import rms_norm_fast
from moe_runtime.config import load_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

EPS = 1e-6
# Both sides of BLOCK_M = 64 and of cuBLAS's small-M paths (it differs for M <= 128).
# Both sides of the linear's row buckets (16, 64, 512) and BLOCK_M (16, 32, 128).
ROW_COUNTS = (1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 511, 512, 513, 1000)
# DeepSeek-V2-Lite linear weights (name, in_dim K, out_dim N), from the shipped config.
V2_LITE_LINEARS = load_config(
    Path(__file__).resolve().parent.parent / "launch" / "configs" / "v2_lite_gpu.yaml"
).model.linear_shapes()
BUCKET_PROBE_ROWS = (1, 16, 17, 64, 65, 512, 513, 4096)
# bf16 output after fp32 accumulation: one bf16 ulp (2**-8 relative) plus order effects.
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}


def _randn(generator, *shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=generator) * scale).to("cuda", dtype)


def _record_tma_launches(monkeypatch, what) -> list:
    """A list that gets what(x, num_chunks) for every launch of the persistent TMA kernel
    (moe_kernels/triton_linear.py's _launch_persistent) from here on: engagement checks."""
    from moe_kernels import triton_linear

    launches = []
    launch_persistent = triton_linear._launch_persistent

    def counted(x, weight, out, config, num_chunks=1):
        launches.append(what(x, num_chunks))
        return launch_persistent(x, weight, out, config, num_chunks)

    monkeypatch.setattr(triton_linear, "_launch_persistent", counted)
    return launches


def _assert_row_invariant(op, x, full, generator):
    for m in ROW_COUNTS:
        if m <= x.shape[0]:
            assert torch.equal(op(x[:m]), full[:m]), m
    perm = torch.randperm(x.shape[0], generator=generator).cuda()
    assert torch.equal(op(x[perm]), full[perm])
    fresh = torch.randn(70, *x.shape[1:], generator=generator).to(x.device, x.dtype)
    mixed = torch.cat([fresh[:37], x[5:6], fresh[37:]])
    assert torch.equal(op(mixed)[37], full[5])


def test_linear_bitwise_invariant_where_cublas_is_not(generator):
    from moe_kernels.triton_linear import linear_triton

    in_dim, out_dim = 7168, 2048
    x = _randn(generator, 4096, in_dim)
    w = _randn(generator, out_dim, in_dim, scale=in_dim**-0.5)
    full = linear_triton(x, w)
    torch.testing.assert_close(full.float(), x.float() @ w.float().t(), **BF16_TOL)
    _assert_row_invariant(lambda rows: linear_triton(rows, w), x, full, generator)
    # Negative control: cuBLAS row 0 changes with M at this shape (DESIGN.md, measured).
    cublas_full = x @ w.t()
    assert any(not torch.equal((x[:m] @ w.t())[0], cublas_full[0]) for m in (1, 16, 64, 128))


def test_linear_fp32_router_shape_invariant(generator):
    from moe_kernels.triton_linear import linear_triton

    x = _randn(generator, 1024, 2048, dtype=torch.float32)
    w = _randn(generator, 64, 2048, dtype=torch.float32, scale=2048**-0.5)
    full = linear_triton(x, w)
    expected = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(full, expected, atol=1e-5, rtol=1e-5)  # ieee fp32 products
    _assert_row_invariant(lambda rows: linear_triton(rows, w), x, full, generator)


@pytest.mark.parametrize("num_experts, hidden", [(64, 2048), (256, 7168)])
def test_router_logits_16bit_weight_invariant_and_fp32_close(generator, num_experts, hidden):
    """The model's bf16 router weight: fp32 logits from the tensor-core linear, the same bits
    for a row in every batch (row buckets 1 to 8192: the decode K split and the prefill chain),
    within fp32 sum error of the float64 product (every bf16 x bf16 product is exact)."""
    from moe_kernels.triton_router import router_logits_triton

    x = _randn(generator, 8192, hidden)
    w = _randn(generator, num_experts, hidden, scale=hidden**-0.5)
    full = router_logits_triton(x, w)
    assert full.dtype == torch.float32
    expected = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(full, expected, atol=2e-5, rtol=1e-5)
    # Engagement: not the bf16-rounded output of the plain 16-bit linear.
    assert not torch.equal(full, full.bfloat16().float())
    _assert_row_invariant(lambda rows: router_logits_triton(rows, w), x, full, generator)
    for m in BUCKET_PROBE_ROWS:
        assert torch.equal(router_logits_triton(x[:m], w), full[:m]), m


@pytest.mark.parametrize("in_dim, out_dim", [(2048, 102400), (512, 4096), (2048, 576)])
def test_linear_other_shapes_invariant(generator, in_dim, out_dim):
    from moe_kernels.triton_linear import linear_triton

    x = _randn(generator, 300, in_dim)
    w = _randn(generator, out_dim, in_dim, scale=in_dim**-0.5)
    full = linear_triton(x, w)
    torch.testing.assert_close(full.float(), x.float() @ w.float().t(), **BF16_TOL)
    _assert_row_invariant(lambda rows: linear_triton(rows, w), x, full, generator)


@pytest.mark.parametrize("name, in_dim, out_dim", V2_LITE_LINEARS)
def test_linear_every_bucket_config_gives_the_same_bits(generator, name, in_dim, out_dim):
    """The row-count buckets pick tile shapes only: each config in use, run on the same 600
    rows, gives bit-identical output, and slices across every bucket boundary match."""
    from moe_kernels.triton_linear import _launch, linear_triton
    from moe_kernels.triton_linear_config import POINTER_CONFIG_16BIT, linear_config

    x = _randn(generator, 600, in_dim)
    w = _randn(generator, out_dim, in_dim, scale=in_dim**-0.5)
    configs = {linear_config(out_dim, in_dim, x.dtype, m) for m in BUCKET_PROBE_ROWS}
    configs.add(POINTER_CONFIG_16BIT)  # batched/grouped launches' stand-in for TMA
    assert len({c.block_k for c in configs}) == 1, configs
    outs = {c: _launch(x, w, x.new_empty((600, out_dim)), 600, c) for c in configs}
    first = next(iter(outs.values()))
    for config, out in outs.items():
        assert torch.equal(out, first), (name, config)
    torch.testing.assert_close(first.float(), x.float() @ w.float().t(), **BF16_TOL)
    for m in ROW_COUNTS:
        if m <= 600:
            assert torch.equal(linear_triton(x[:m], w), first[:m]), (name, m)
    assert torch.equal(linear_triton(x[1:], w), first[1:])  # an odd base address (TMA)


@pytest.mark.parametrize(
    "out_dim, in_dim", ((576, 2048), (2048, 2048), (2048, 1408), (2048, 2816), (2048, 16384))
)
def test_linear_prefill_chain_gives_the_chunk_launch_bits(generator, monkeypatch, out_dim, in_dim):
    """From CHAIN_MIN_ROWS rows a bf16 linear with a fixed K split (kv_a; o_proj's at 16 and
    128 heads, the shared experts' and an expert's down shapes as plain linears) adds its
    chunk sums in one program: the chunk launch's bits at the same rows, and every row's bits
    at decode sizes; the tree over the same chunks differs where there are more than two (two
    chunks: one add, the same). Wide outputs take the TMA kernel's chain (engagement: its
    launches counted), an input TMA cannot read the pointer kernel's, with the same bits.
    fp32 weights (the routers) keep the chunk launch at every row count."""
    from moe_kernels.triton_chunk_tree import (
        CHAIN_MIN_ROWS,
        CHAIN_WIDE_CONFIG,
        chain_config,
        linear_chunk_tree,
    )
    from moe_kernels.triton_linear import linear_triton
    from moe_kernels.triton_linear_config import k_split_chunk, k_split_count, linear_config
    from moe_kernels.triton_split_k import launch_split_k

    tma_chains = _record_tma_launches(monkeypatch, lambda x, num_chunks: num_chunks)
    x = _randn(generator, 2 * CHAIN_MIN_ROWS + 37, in_dim)
    w = _randn(generator, out_dim, in_dim, scale=in_dim**-0.5)
    num_chunks = k_split_count(out_dim, in_dim, w.dtype)
    chain = chain_config(out_dim, in_dim, num_chunks, w.dtype, x.shape[0])
    assert num_chunks > 1 and chain is not None  # engagement: the chain runs at these rows
    assert chain_config(out_dim, in_dim, num_chunks, w.dtype, CHAIN_MIN_ROWS - 1) is None
    assert chain_config(out_dim, 2048, 4, torch.float32, x.shape[0]) is None
    full = linear_triton(x, w)
    assert tma_chains == ([num_chunks] if chain.is_persistent else [])
    assert chain.is_persistent == (out_dim >= 2048)
    launch = torch.empty_like(full)
    config = linear_config(out_dim, in_dim, w.dtype, x.shape[0])
    launch_split_k(x, w, launch, k_split_chunk(in_dim, num_chunks), config, is_tree=False)
    assert torch.equal(full, launch)
    torch.testing.assert_close(full.float(), x.float() @ w.float().t(), **BF16_TOL)
    for m in (1, 16, 64, 600, CHAIN_MIN_ROWS - 1, CHAIN_MIN_ROWS, CHAIN_MIN_ROWS + 1):
        assert torch.equal(linear_triton(x[:m], w), full[:m]), m
    pointer = CHAIN_WIDE_CONFIG if chain.is_persistent else chain
    tree = linear_chunk_tree(x, w, num_chunks, full.dtype, pointer)
    assert torch.equal(tree, full) == (num_chunks == 2), "tree vs chain: no control"
    for is_chunk_loop in (False, True):  # both loop forms of the kernel: the same adds
        got = linear_chunk_tree(
            x, w, num_chunks, full.dtype, pointer, is_tree=False, is_chunk_loop=is_chunk_loop
        )
        assert torch.equal(got, full), is_chunk_loop
    # A base address TMA cannot take (2 bytes past 16-byte alignment): the pointer kernel's chain.
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view_as(x)
    shifted.copy_(x)
    tma_chains.clear()
    assert torch.equal(linear_triton(shifted, w), full)
    assert tma_chains == []


def test_grouped_linear_rows_independent_of_expert_load(generator):
    from moe_kernels.linear import grouped_linear_fast
    from moe_kernels.triton_grouped_linear import grouped_linear_triton
    from moe_kernels.triton_linear import linear_triton

    hidden, inter, num_local = 2048, 1408, 8
    w = _randn(generator, num_local, 2 * inter, hidden, scale=hidden**-0.5)
    sizes = [5, 0, 300, 1, 64, 65, 17, 48]
    x = _randn(generator, sum(sizes), hidden)
    out = grouped_linear_triton(x, w, sizes)
    torch.testing.assert_close(out.float(), grouped_linear_fast(x, w, sizes).float(), **BF16_TOL)
    rows = x[5:305]  # expert 2's rows
    _assert_row_invariant(
        lambda r: grouped_linear_triton(r, w, [0, 0, r.shape[0], 0, 0, 0, 0, 0]),
        rows,
        out[5:305],
        generator,
    )
    # The grouped GEMM and the plain linear give a row the same bits (this weight shape has no
    # K split: wider than SPLIT_MAX_OUT).
    from moe_kernels.triton_linear_config import k_split_count

    assert k_split_count(*w.shape[1:], w.dtype) == 1
    assert torch.equal(linear_triton(rows, w[2]), out[5:305])
    # No cuBLAS control at this shape: measured equal row 0 for M in (1, 16, 64) vs 300 at
    # K=2048, N=2816; the K=7168 control in the linear test is the one that fails for cuBLAS.


@pytest.mark.parametrize("num_experts, hidden", ((64, 2048), (256, 7168)))
def test_fp32_router_linear_every_bucket_config_gives_the_same_bits(generator, num_experts, hidden):
    """The router's fp32 linear (ieee products): its row buckets pick tile shapes only, and
    the chunks a program sums as a subtree from FP32_PREFILL_ROWS rows give the decode
    launch's bits (engagement: sixteen tree chunks; control: chunk order differs)."""
    from moe_kernels.triton_linear import _launch, linear_triton
    from moe_kernels.triton_linear_config import (
        FP32_PREFILL_ROWS,
        k_split_chunk,
        k_split_chunks_per_program,
        k_split_count,
        linear_config,
    )
    from moe_kernels.triton_split_k import launch_split_k

    rows = FP32_PREFILL_ROWS + 77
    x = _randn(generator, rows, hidden, dtype=torch.float32)
    w = _randn(generator, num_experts, hidden, dtype=torch.float32, scale=hidden**-0.5)
    num_chunks = k_split_count(num_experts, hidden, w.dtype)
    assert num_chunks == 16
    assert k_split_chunks_per_program(w.dtype, num_chunks, rows) > 1
    assert k_split_chunks_per_program(w.dtype, num_chunks, FP32_PREFILL_ROWS - 1) == 1
    configs = {linear_config(num_experts, hidden, x.dtype, m) for m in BUCKET_PROBE_ROWS}
    assert len(configs) == 4 and len({c.block_k for c in configs}) == 1, configs
    outs = [_launch(x, w, x.new_empty((rows, num_experts)), rows, c) for c in configs]
    for config, out in zip(configs, outs, strict=True):
        assert torch.equal(out, outs[0]), config
    torch.testing.assert_close(outs[0], x @ w.t(), atol=1e-4, rtol=1e-4)
    for m in (1, 16, 17, 64, 65, 599, FP32_PREFILL_ROWS - 1, FP32_PREFILL_ROWS, rows):
        assert torch.equal(linear_triton(x[:m], w), outs[0][:m]), m
    chunk_k = k_split_chunk(hidden, num_chunks)
    in_order = launch_split_k(
        x, w, torch.empty_like(outs[0]), chunk_k, next(iter(configs)), is_tree=False
    )
    assert not torch.equal(in_order, outs[0])


@pytest.mark.parametrize("num_heads", (16, 128))
def test_batched_linear_gives_each_head_the_linear_bits(generator, num_heads):
    """MLA's absorbed W_UK / W_UV products, one launch over heads: head h's rows are bitwise
    linear_triton's for every row bucket, from the strided [H, T, K] view the model passes."""
    from moe_kernels.triton_linear import batched_linear_triton, linear_triton

    nope, v, lora = 128, 128, 512
    w_uk_t = _randn(generator, num_heads, lora, nope, scale=nope**-0.5)
    w_uv = _randn(generator, num_heads, v, lora, scale=lora**-0.5)
    for rows in (1, 16, 17, 64, 65, 600, 1100):
        q_nope = _randn(generator, rows, num_heads, nope + 64)[:, :, :nope]
        latent = _randn(generator, rows, num_heads, lora)
        for x, w in ((q_nope.transpose(0, 1), w_uk_t), (latent.transpose(0, 1), w_uv)):
            out = batched_linear_triton(x, w)
            for h in (0, num_heads // 2, num_heads - 1):
                assert torch.equal(out[h], linear_triton(x[h].contiguous(), w[h])), (rows, h)
            torch.testing.assert_close(
                out.float(), torch.bmm(x, w.transpose(1, 2)).float(), **BF16_TOL
            )


@pytest.mark.parametrize("num_heads", (16, 128))
def test_batched_linear_tma_gives_the_pointer_kernel_bits(generator, monkeypatch, num_heads):
    """The persistent TMA kernel's batched form (3-d descriptors; batched_config's tiles for
    the absorbed products past MEDIUM_ROWS) in the engine's layout (W_UK reads q_nope out of
    the projected query and writes into the query buffer; W_UV reads the attention's rows and
    writes [T, H, v]): the pointer kernel's bits, at rows past a tile."""
    from moe_kernels.triton_linear import _launch
    from moe_kernels.triton_linear_config import (
        BATCHED_NARROW_TMA,
        BATCHED_WIDE_TMA,
        POINTER_CONFIG_16BIT,
        LinearConfig,
    )

    tma_launches = _record_tma_launches(monkeypatch, lambda x, num_chunks: x.dim())
    nope, rope, v, lora, rows = 128, 64, 128, 512, 1000
    w_uk_t = _randn(generator, num_heads, lora, nope, scale=nope**-0.5)
    w_uv = _randn(generator, num_heads, v, lora, scale=lora**-0.5)
    q = _randn(generator, rows, num_heads, nope + rope)
    latent = _randn(generator, rows, num_heads, lora)
    for config in (
        BATCHED_WIDE_TMA,
        BATCHED_NARROW_TMA,
        LinearConfig(128, 128, 64, 8, 8, 3, True),
        LinearConfig(64, 128, 64, 8, 4, 4, True),
    ):
        uk_out = q.new_empty((rows, num_heads, lora + rope))[..., :lora].transpose(0, 1)
        uv_out = q.new_empty((rows, num_heads, v)).transpose(0, 1)
        cases = (
            (q[..., :nope].transpose(0, 1), w_uk_t, uk_out),
            (latent.transpose(0, 1), w_uv, uv_out),
        )
        for x, w, out in cases:
            want = _launch(x, w, torch.empty_like(out), rows, POINTER_CONFIG_16BIT)
            tma_launches.clear()
            got = _launch(x, w, out, rows, config)
            assert tma_launches == [3]  # engagement: the TMA kernel's batched form ran
            assert torch.equal(got, want), (config, tuple(w.shape))


@pytest.mark.parametrize(
    ("dtype", "out_dim", "in_dim"),
    [(torch.float32, 64, 64), (torch.bfloat16, 24, 64), (torch.bfloat16, 64, 40)],
    ids=["fp32", "out24", "in40"],
)
def test_fast_grouped_linear_off_the_cutlass_shapes_is_captured(generator, dtype, out_dim, in_dim):
    """Shapes torch's grouped GEMM cannot take (not bf16, or features not multiples of 16)
    fell back to the per-group loop, whose host read of the counts failed inside a graph's
    capture: fast mode with graphs on did not start for an fp32 model or expert sizes like 24.
    Now captured, and replayed with other counts it gives the eager rows."""
    from moe_kernels.linear import grouped_linear_cuda_fast, grouped_linear_ref

    num_local, num_rows = 4, 24
    w = (torch.randn(num_local, out_dim, in_dim, generator=generator) * in_dim**-0.5).cuda()
    x = torch.randn(num_rows, in_dim, generator=generator).cuda()
    w, x = w.to(dtype), x.to(dtype)
    counts = torch.tensor([10, 0, 6, 8], device="cuda")
    grouped_linear_cuda_fast(x, w, counts)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = grouped_linear_cuda_fast(x, w, counts)
    for sizes in ([10, 0, 6, 8], [0, 24, 0, 0], [1, 2, 3, 18]):
        counts.copy_(torch.tensor(sizes))
        graph.replay()
        eager = grouped_linear_cuda_fast(x, w, counts)
        assert torch.equal(captured, eager), sizes
        want = grouped_linear_ref(x.cpu().float(), w.cpu().float(), sizes, tile_rows=16)
        tol = BF16_TOL if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
        torch.testing.assert_close(captured.float().cpu(), want, **tol)
    assert grouped_linear_cuda_fast(x[:0], w, torch.zeros_like(counts)).shape == (0, out_dim)


def test_grouped_linear_device_counts_same_bits_in_every_bucket_and_in_a_graph(generator):
    """The capturable grouped GEMM (counts on the device): expert 2's rows keep their bits
    whether the batch is decode-sized or prefill-sized (different tile buckets), equal the
    host-count path, and a CUDA graph replayed with new counts gives the eager bits."""
    from moe_kernels.linear import grouped_linear_cuda_fast
    from moe_kernels.triton_grouped_linear import grouped_config, grouped_linear_triton

    hidden, inter, num_local = 2048, 1408, 64
    w = _randn(generator, num_local, 2 * inter, hidden, scale=hidden**-0.5)
    rows = _randn(generator, 12, hidden)  # expert 2's rows
    configs, outs = set(), []
    # Mean rows per expert 1, 47, 94 and 625: the small, pointer and TMA buckets.
    for other_rows in (6, 3000, 6000, 40000):
        sizes = [other_rows // 2, 0, 12] + [0] * (num_local - 4) + [other_rows - other_rows // 2]
        x = torch.cat(
            [
                _randn(generator, other_rows // 2, hidden),
                rows,
                _randn(generator, other_rows - other_rows // 2, hidden),
            ]
        )
        configs.add(grouped_config(2 * inter, hidden, x.dtype, x.shape[0], num_local))
        counts = torch.tensor(sizes, device="cuda")
        out = grouped_linear_triton(x, w, counts)
        assert torch.equal(out, grouped_linear_triton(x, w, sizes))
        outs.append(out[other_rows // 2 : other_rows // 2 + 12])
        fast = grouped_linear_cuda_fast(x, w, counts)
        torch.testing.assert_close(fast.float(), out.float(), **BF16_TOL)
    assert len(configs) == 4, configs  # the batches really took different tile shapes
    assert any(c.is_persistent for c in configs), configs
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    # Captured once, replayed with other counts written into the same tensor.
    x = _randn(generator, 48, hidden)
    counts = torch.zeros(num_local, dtype=torch.int64, device="cuda")
    counts[:3] = torch.tensor([40, 0, 8])
    grouped_linear_triton(x, w, counts)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = grouped_linear_triton(x, w, counts)
    for sizes in ([40, 0, 8], [1, 46, 1], [0, 0, 48]):
        counts.zero_()
        counts[:3] = torch.tensor(sizes)
        graph.replay()
        full = sizes + [0] * (num_local - 3)
        assert torch.equal(captured, grouped_linear_triton(x, w, full)), sizes
    # The TMA bucket captured too (rows read through an index: gathered in the graph).
    x = _randn(generator, 5000, hidden)
    index = torch.randint(0, 5000, (40000,), device="cuda")
    counts = torch.zeros(num_local, dtype=torch.int64, device="cuda")
    counts[:3] = torch.tensor([20000, 0, 20000])
    grouped_linear_triton(x, w, counts, row_index=index)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = grouped_linear_triton(x, w, counts, row_index=index)
    for sizes in ([20000, 0, 20000], [1, 39998, 1]):
        counts[:3] = torch.tensor(sizes)
        graph.replay()
        full = sizes + [0] * (num_local - 3)
        assert torch.equal(captured, grouped_linear_triton(x[index], w, full)), sizes


@pytest.mark.parametrize("dim", (2048, 7168 + 5))
def test_rms_norm_invariant_and_close(generator, dim):
    from moe_kernels.triton_rmsnorm import rms_norm_triton

    x = _randn(generator, 4096, dim, scale=3.0)
    weight = (torch.rand(dim, generator=generator) + 0.5).to("cuda", torch.bfloat16)
    full = rms_norm_triton(x, weight, EPS)
    # bf16 rounds twice (normalised row, then times weight): up to two bf16 ulps.
    torch.testing.assert_close(full, rms_norm_fast(x, weight, EPS), atol=4e-2, rtol=2e-2)
    _assert_row_invariant(lambda rows: rms_norm_triton(rows, weight, EPS), x, full, generator)


@pytest.mark.parametrize("is_log", (False, True))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_softmax_invariant_and_close(generator, is_log, dtype):
    from moe_kernels.triton_softmax import log_softmax_triton, softmax_triton

    op, ref = (log_softmax_triton, torch.log_softmax) if is_log else (softmax_triton, torch.softmax)
    x = _randn(generator, 1100, 102400, dtype=dtype, scale=4.0)
    full = op(x)
    expected = ref(x.double(), dim=-1).float()
    torch.testing.assert_close(full, expected, atol=1e-5, rtol=1e-5)
    _assert_row_invariant(op, x, full, generator)


@pytest.mark.parametrize("bad", (float("nan"), float("inf")))
@pytest.mark.parametrize("vocab", (1000, 102400))  # one program a row; parts of PART_V
def test_log_softmax_spreads_one_non_finite_logit_over_its_row_alone(generator, bad, vocab):
    """What the engine ends a sample by (moe_runtime/engine/scheduler.py is_non_finite: the
    chosen logprob is NaN): on the GPU kernel one NaN or +inf logit makes its whole row NaN,
    whichever column it is in, and every other row keeps its bits; torch's op alike."""
    from moe_kernels.triton_softmax import log_softmax_triton

    x = _randn(generator, 6, vocab, dtype=torch.float32, scale=4.0)
    poisoned = x.clone()
    poisoned[2, vocab - 7] = bad
    for op in (log_softmax_triton, lambda rows: torch.log_softmax(rows, -1)):
        clean, out = op(x), op(poisoned)
        assert torch.isnan(out[2]).all()
        assert torch.equal(out[[0, 1, 3, 4, 5]], clean[[0, 1, 3, 4, 5]])
        assert not torch.isnan(clean).any()  # control: the clean rows are numbers


def test_silu_mul_elementwise_invariant_on_gpu(generator):
    """The fused kernel the GPU op table binds: an element's bits ignore the row count, the
    halves being views of one gate_up output, and its neighbours; close to the reference."""
    from moe_kernels.activation import silu_mul_ref
    from moe_kernels.triton_activation import silu_mul_triton

    x = _randn(generator, 1000, 2 * 1408)
    gate, up = x.chunk(2, dim=-1)  # strided views, as the MoE calls it
    full = silu_mul_triton(gate, up)
    torch.testing.assert_close(full.float(), silu_mul_ref(gate, up).float(), **BF16_TOL)
    for m in (1, 2, 3, 17, 999):
        assert torch.equal(silu_mul_triton(gate[:m], up[:m]), full[:m]), m
    assert torch.equal(silu_mul_triton(gate.contiguous(), up.contiguous()), full)
    perm = torch.randperm(1000, generator=generator).cuda()
    assert torch.equal(silu_mul_triton(gate[perm], up[perm]), full[perm])


@pytest.mark.parametrize("is_interleaved", (True, False))
def test_rope_kernel_rows_ignore_the_batch(generator, is_interleaved):
    """The one-launch rope: a token's bits follow its own values and position only (prefixes,
    a permutation), for the 16-head q_pe view and the one-head k_pe; within one bf16 rounding
    of torch's (its intermediate roundings are torch's steps, which the compiler may merge)."""
    from moe_kernels.rope import rope_ref
    from moe_kernels.triton_rope import rope_triton

    cos = torch.randn(4096, 32, generator=generator).cuda()
    sin = torch.randn(4096, 32, generator=generator).cuda()
    positions = torch.randint(0, 4096, (300,), generator=generator).cuda()
    q = _randn(generator, 300, 16, 192)
    for x in (q[..., 128:], q[:, :1, 128:]):
        full = rope_triton(x, positions, cos, sin, is_interleaved)
        want = rope_ref(x, positions, cos, sin, is_interleaved)
        torch.testing.assert_close(full.float(), want.float(), atol=4e-2, rtol=1.6e-2)
        for m in (1, 17, 299):
            assert torch.equal(
                rope_triton(x[:m], positions[:m], cos, sin, is_interleaved), full[:m]
            )
        perm = torch.randperm(300, generator=generator).cuda()
        got = rope_triton(x[perm], positions[perm], cos, sin, is_interleaved)
        assert torch.equal(got, full[perm])


def test_expert_layout_kernel_is_the_stable_sort(generator):
    """The one-launch layout == the torch composition it replaces: the stable sort, bincount,
    order // K (the dispatch gather's tokens) and order's inverse (the combine's rows)."""
    from moe_kernels.triton_layout import expert_layout_triton

    for num_tokens, top_k, num_experts in ((1, 6, 64), (64, 6, 64), (256, 6, 64), (256, 8, 256)):
        ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=generator).cuda()
        order, counts, token_of_row, row_of_slot = expert_layout_triton(ids, num_experts)
        want = torch.sort(ids.reshape(-1), stable=True).indices
        assert torch.equal(order, want)
        assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=num_experts))
        assert torch.equal(token_of_row, want // top_k)
        inverse = torch.full_like(want, -1)
        inverse[want] = torch.arange(want.numel(), device="cuda")
        assert torch.equal(row_of_slot, inverse)


def test_moe_combine_kernel_rows_ignore_the_batch(generator):
    """The GPU combine: a token's sum over its slots (k ascending) has the same bits alone,
    with its rows arriving in another order, and among 4096 other tokens."""
    from moe_kernels.combine import moe_combine_ref
    from moe_kernels.triton_combine import moe_combine_triton

    num_tokens, top_k, dim = 4096, 6, 2048
    rows = _randn(generator, num_tokens * top_k, dim)
    weights = torch.rand(num_tokens, top_k, generator=generator).cuda()
    slots = torch.randperm(num_tokens * top_k, generator=generator).cuda()
    full = moe_combine_triton(rows, slots, weights)
    torch.testing.assert_close(full, moe_combine_ref(rows, slots, weights), atol=1e-5, rtol=1e-5)
    for token in (0, 1, 2047, 4095):
        mine = (slots // top_k == token).nonzero()[:, 0].flip(0)
        alone = moe_combine_triton(rows[mine], slots[mine] % top_k, weights[token : token + 1])
        assert torch.equal(alone[0], full[token]), token
    first = (slots < 17 * top_k).nonzero()[:, 0]
    assert torch.equal(moe_combine_triton(rows[first], slots[first], weights[:17]), full[:17])


def _paged_cache(generator, seq_lens, num_heads, cache_dim, block_size):
    """bf16 cache with the sequences in shuffled blocks and NaN in every unwritten slot."""
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 5
    kv_cache = torch.full((num_blocks, block_size, cache_dim), float("nan"))
    block_tables = torch.full((len(seq_lens), max(seq_lens) // block_size + 2), -1)
    free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
    for seq_id, seq_len in enumerate(seq_lens):
        for j in range(-(-seq_len // block_size)):
            block = free_blocks.pop()
            block_tables[seq_id, j] = block
            rows = min(block_size, seq_len - j * block_size)
            kv_cache[block, :rows] = torch.randn(rows, cache_dim, generator=generator)
    seq_ids = torch.cat([torch.full((n,), s) for s, n in enumerate(seq_lens)])
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    q = torch.randn(len(seq_ids), num_heads, cache_dim, generator=generator)
    cuda = [t.to("cuda") for t in (q, kv_cache, seq_ids, block_tables, positions)]
    cuda[0], cuda[1] = cuda[0].bfloat16(), cuda[1].bfloat16()
    return cuda


def _check_attention_rows(attend, cache, seq_lens, chunk_ends, generator):
    """attend(rows) -> [rows, H, 512] over the paged cache of seq_lens: every query close to
    the reference; each sequence's last token alone and the last tokens as one decode batch,
    sequence 0 in chunks ending at chunk_ends (across block and split boundaries) and a
    permutation give the whole call's bits. Returns (whole call, last tokens' rows)."""
    from moe_kernels.attention import mla_attention_ref

    q, kv_cache, seq_ids, tables, positions = cache
    full = attend(torch.arange(q.shape[0], device="cuda"))
    expected = mla_attention_ref(
        q, kv_cache, seq_ids, tables, positions, scale=192**-0.5, v_dim=512, tile_rows=64
    )
    # bf16 probabilities times bf16 values, fp32 accumulation, bf16 output.
    torch.testing.assert_close(full.float(), expected.float(), atol=2e-2, rtol=2e-2)
    last = torch.tensor([sum(seq_lens[: i + 1]) - 1 for i in range(len(seq_lens))]).cuda()
    for row in last.tolist():
        assert torch.equal(attend(torch.tensor([row]).cuda()), full[row : row + 1]), row
    assert torch.equal(attend(last), full[last])
    for start, stop in zip((0, *chunk_ends), chunk_ends, strict=False):
        rows = torch.arange(start, stop, device="cuda")
        assert torch.equal(attend(rows), full[rows]), (start, stop)
    perm = torch.randperm(q.shape[0], generator=generator).cuda()
    assert torch.equal(attend(perm), full[perm])
    return full, last


def test_mla_attention_prefill_decode_and_batch_bitwise(generator):
    """DeepSeek-V2-Lite MLA: 16 heads, latent 512 + rope 64, cache blocks of 64 positions."""
    from moe_kernels.attention import mla_attention_fast
    from moe_kernels.attention_launch import SPLIT_BLOCKS, VALUE_SPLIT, split_count, value_split
    from moe_kernels.triton_attention import mla_attention_triton

    seq_lens = (1000, 70, 300, 5, 257)
    cache = _paged_cache(generator, seq_lens, 16, 576, 64)
    q, kv_cache, seq_ids, tables, positions = cache
    args = dict(scale=192**-0.5, v_dim=512)

    def attend(rows):
        return mla_attention_triton(
            q[rows], kv_cache, seq_ids[rows], tables, positions[rows], **args
        )

    full, last = _check_attention_rows(attend, cache, seq_lens, (63, 64, 300, 1000), generator)
    # A narrow table (one KV split per launch: no merge launch) for sequences 1 and 3.
    short = torch.cat([torch.arange(1000, 1070), torch.arange(1370, 1375)]).cuda()
    narrow = tables[:, :SPLIT_BLOCKS].contiguous()
    got = mla_attention_triton(q[short], kv_cache, seq_ids[short], narrow, positions[short], **args)
    assert torch.equal(got, full[short])
    # Engagement: the single-token and five-query launches above split their value columns,
    # the whole call does not (the launch shape follows the batch; the bits must not).
    num_splits = split_count(tables.shape[1], SPLIT_BLOCKS, 0)
    assert value_split(1, 512, num_splits) == value_split(5, 512, num_splits) == VALUE_SPLIT
    assert value_split(q.shape[0], 512, num_splits) == (1, None)
    # Negative control: the fast path's per-sequence matmuls see M = the query count.
    fast_full = mla_attention_fast(q, kv_cache, seq_ids, tables, positions, **args)
    fast_decode = mla_attention_fast(
        q[last], kv_cache, seq_ids[last], tables, positions[last], **args
    )
    assert not torch.equal(fast_decode, fast_full[last]), "fast attention matched: no control"


def test_mla_attention_wide_launch_batch_and_tp_bitwise(generator):
    """DeepSeek-V3 MLA: 128 heads take the wide launch (64 heads a program, the Gluon split
    kernel). Prefill, decode alone and batched, chunks and permutations give the same bits
    (sequence 0 spans three KV splits, so the merge runs, and its queries of 17, 18, 33 and 34
    blocks end in a tail: the last split takes them on); a TP rank's heads (64, 32 or 16 of
    them, whole_heads=128) give the whole model's bits for those heads; a query of one split
    gives the same bits from a table of one split and from a table of three; engagement: the
    Gluon kernel ran (the prefill and a decode batch), and the Triton wide kernel and the
    16-head launch make other adds; fast mode's batch shapes move its bits."""
    import moe_kernels.gluon_attention as gluon_attention
    from moe_kernels.attention import mla_attention_fast
    from moe_kernels.attention_launch import NARROW_LAUNCH, WIDE_LAUNCH, head_launch, split_count
    from moe_kernels.triton_attention import _attend, mla_attention_triton

    seq_lens = (2400, 70, 600, 5, 257)
    cache = _paged_cache(generator, seq_lens, 128, 576, 64)
    q, kv_cache, seq_ids, tables, positions = cache
    args = dict(scale=192**-0.5, v_dim=512)

    def attend(rows, heads=slice(None)):
        return mla_attention_triton(
            q[rows][:, heads].contiguous(), kv_cache, seq_ids[rows], tables, positions[rows],
            **args, whole_heads=128,
        )  # fmt: skip

    assert head_launch(128) == WIDE_LAUNCH
    kernel, grids = gluon_attention._mla_wide_split_kernel, []

    class Recorder:  # the Gluon launches' grids, then the real launch
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    gluon_attention._mla_wide_split_kernel = Recorder()
    try:
        full, last = _check_attention_rows(
            attend, cache, seq_lens, (63, 64, 600, 1024, 1100, 2100, 2200, 2400), generator
        )
    finally:
        gluon_attention._mla_wide_split_kernel = kernel
    # (head blocks x value parts, queries, splits): the prefill's launches and a decode batch
    # of 5, each a split launch over the table's three splits; the decode batch and the one
    # query launches with their value columns over two programs (wide_value_parts: at most 32
    # (query, split) pairs), compared above with the whole call's one part.
    split, tail = WIDE_LAUNCH.split_blocks, WIDE_LAUNCH.tail_blocks
    assert split_count(tables.shape[1], split, tail) == 3
    assert grids and all(g[0] in (2, 4) and g[2] == 3 for g in grids), grids
    assert (4, len(seq_lens), 3) in grids and (4, 1, 3) in grids, grids
    assert (2, len(seq_lens), 3) not in grids and any(g[0] == 2 for g in grids), grids
    launch = (split, WIDE_LAUNCH.num_warps, WIDE_LAUNCH.num_stages, WIDE_LAUNCH.block_h)
    # Queries of one split: written directly from a table of one split (the launch's one
    # split) and from the table of three (the kernel writes them itself, the merge skips
    # them): one form whatever the table's width.
    short = positions < (split + tail) * 64
    one_split = tables[:, : split + tail].contiguous()
    assert split_count(one_split.shape[1], split, tail) == 1 and short.sum() > 100
    direct = _attend(
        q[short], kv_cache, seq_ids[short], one_split, positions[short], 192**-0.5, 512,
        *launch, is_gluon=True, tail_blocks=tail,
    )  # fmt: skip
    assert torch.equal(direct, full[short]), "one-split queries differ with the table's width"
    with pytest.raises(ValueError, match="whole-query launch needs the Triton kernel"):
        _attend(
            q[last], kv_cache, seq_ids[last], tables, positions[last], 192**-0.5, 512, *launch,
            is_gluon=True, is_whole_query=True, tail_blocks=tail,
        )  # fmt: skip
    wide_triton = _attend(
        q, kv_cache, seq_ids, tables, positions, 192**-0.5, 512, *launch, tail_blocks=tail
    )
    assert not torch.equal(wide_triton, full), "the Gluon and Triton wide kernels agreed"
    # Engagement of the tail: without it only the queries whose last split took one on move
    # (17, 18, 33 and 34 blocks), and most do (a tail of one key below the running max
    # may fold to the same bits).
    no_tail = _attend(
        q, kv_cache, seq_ids, tables, positions, 192**-0.5, 512, *launch, is_gluon=True
    )
    moved = (no_tail != full).flatten(1).any(1)
    blocks = positions // 64 + 1
    in_tail = (blocks > split) & ((blocks - 1) % split < tail)
    assert not moved[~in_tail].any(), "queries past the tail's reach moved"
    assert moved[in_tail].float().mean() > 0.5, "the tail moved few queries"
    every = torch.arange(q.shape[0], device="cuda")
    for heads in (slice(0, 64), slice(64, 128), slice(32, 64), slice(112, 128)):
        assert torch.equal(attend(every, heads), full[:, heads]), heads
        assert torch.equal(attend(last, heads), full[last][:, heads]), heads
    # Engagement: the 16-head launch of the same call makes other adds (wgmma vs mma.sync,
    # another split); checked, not assumed, so the comparisons above compare wide launches.
    narrow = _attend(
        q, kv_cache, seq_ids, tables, positions, 192**-0.5, 512, NARROW_LAUNCH.split_blocks,
        NARROW_LAUNCH.num_warps, NARROW_LAUNCH.num_stages, NARROW_LAUNCH.block_h,
    )  # fmt: skip
    assert not torch.equal(narrow, full), "the wide and narrow launches agreed"
    fast_full = mla_attention_fast(q, kv_cache, seq_ids, tables, positions, **args)
    fast_decode = mla_attention_fast(
        q[last], kv_cache, seq_ids[last], tables, positions[last], **args
    )
    assert not torch.equal(fast_decode, fast_full[last]), "fast attention matched: no control"


@pytest.mark.parametrize("num_tokens", (1, 8, 32))
def test_mla_value_split_launches_give_the_same_bits(generator, num_tokens):
    """Every (v_parts, lat_chunk) the op may pick, at decode shapes (engine-wide tables, -1
    padding), gives the whole-head-block launch's bits; a different KV split (part of the
    merge order) is the control that the comparison can fail."""
    from moe_kernels.attention_launch import SPLIT_BLOCKS, VALUE_SPLIT
    from moe_kernels.triton_attention import _attend

    seq_lens = [1024] + [300 + 23 * i for i in range(num_tokens - 1)]  # 1 to 16 blocks
    q, kv_cache, seq_ids, tables, positions = _paged_cache(generator, seq_lens, 16, 576, 64)
    last = torch.tensor([sum(seq_lens[: i + 1]) - 1 for i in range(num_tokens)]).cuda()
    wide = torch.full((tables.shape[0], 128), -1, dtype=tables.dtype, device="cuda")
    wide[:, : tables.shape[1]] = tables
    args = (q[last], kv_cache, seq_ids[last], wide, positions[last], 192**-0.5, 512)
    whole = _attend(*args, SPLIT_BLOCKS, 4, 3)
    for v_parts, lat_chunk in (VALUE_SPLIT, (2, None)):  # the op's, and a split of two
        got = _attend(*args, SPLIT_BLOCKS, 4, 3, v_parts=v_parts, lat_chunk=lat_chunk)
        assert torch.equal(got, whole), (v_parts, lat_chunk)
    # The table read a block ahead (launches of few pairs: TABLE_AHEAD_MAX_PAIRS), whole head
    # blocks and the op's value split at three stages (two parts fit at two only).
    for v_parts, lat_chunk, stages in ((1, None, 3), (*VALUE_SPLIT, 3), (2, None, 2)):
        got = _attend(
            *args, SPLIT_BLOCKS, 4, stages, v_parts=v_parts, lat_chunk=lat_chunk,
            is_table_ahead=True,
        )  # fmt: skip
        assert torch.equal(got, whole), (v_parts, lat_chunk, "ahead")
    assert not torch.equal(_attend(*args, SPLIT_BLOCKS // 2, 4, 3), whole), "no control"


@pytest.mark.parametrize("num_tokens", (1, 8, 32))
def test_mla_wide_value_split_gives_the_same_bits(generator, num_tokens):
    """The 128-head Gluon kernel with each partition's value columns over two programs gives
    the one-part launch's bits at decode shapes: tables of one split (the kernel writes the
    output) and engine-wide ones (partials and the merge), 64 and 32 heads of the 128 (a TP
    rank's; 32 leave half the head block masked), NaN in unwritten slots; the op takes two
    parts up to WIDE_VALUE_SPLIT_MAX_PAIRS (query, split) pairs (engagement: its grid); a
    split of 8 blocks (part of the merge order) is the control that the comparison can
    fail."""
    import moe_kernels.gluon_attention as gluon_attention
    from moe_kernels.attention_launch import (
        WIDE_LAUNCH,
        WIDE_VALUE_SPLIT_MAX_PAIRS,
        wide_value_parts,
    )
    from moe_kernels.triton_attention import _attend, mla_attention_triton

    launch = (WIDE_LAUNCH.split_blocks, WIDE_LAUNCH.num_warps, WIDE_LAUNCH.num_stages, 64)
    # 1 to 18 blocks: within one split and its tail
    lengths = [1090] + [(97 * i) % 1150 + 1 for i in range(1, num_tokens)]
    kernel, grids = gluon_attention._mla_wide_split_kernel, []

    class Recorder:  # the op's Gluon launch grid, then the real launch
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    for width in (18, 128):
        q, kv_cache, seq_ids, tables, positions = _decode_step(generator, lengths, 128, width)
        num_splits = WIDE_LAUNCH.table_splits(width)  # the op's grid (with its long splits)
        for heads in (slice(None), slice(0, 64), slice(64, 96)):
            args = (q[:, heads].contiguous(), kv_cache, seq_ids, tables, positions, 192**-0.5, 512)
            one = _attend(*args, *launch, is_gluon=True, tail_blocks=2, v_parts=1)
            two = _attend(*args, *launch, is_gluon=True, tail_blocks=2, v_parts=2)
            assert torch.equal(two, one), (width, heads)
        grids.clear()
        gluon_attention._mla_wide_split_kernel = Recorder()
        try:
            op = mla_attention_triton(
                q, kv_cache, seq_ids, tables, positions, scale=192**-0.5, v_dim=512
            )
        finally:
            gluon_attention._mla_wide_split_kernel = kernel
        whole = _attend(
            q, kv_cache, seq_ids, tables, positions, 192**-0.5, 512, *launch, is_gluon=True,
            tail_blocks=2, v_parts=1,
        )  # fmt: skip
        assert torch.equal(op, whole), width
        parts = wide_value_parts(num_tokens, num_splits)
        assert parts == (2 if num_tokens * num_splits <= WIDE_VALUE_SPLIT_MAX_PAIRS else 1)
        assert grids == [(2 * parts, num_tokens, num_splits)], grids
    halved = (WIDE_LAUNCH.split_blocks // 2, *launch[1:])
    control = _attend(
        q, kv_cache, seq_ids, tables, positions, 192**-0.5, 512, *halved, is_gluon=True,
        tail_blocks=2, v_parts=2,
    )  # fmt: skip
    assert not torch.equal(control, whole), "another split gave the same bits: no control"


@pytest.mark.parametrize("long_blocks, long_split", ((20, 32), (64, 64)))
def test_mla_wide_long_splits_batch_and_tp_bitwise(generator, long_blocks, long_split):
    """The 128-head Gluon kernel with long splits (kernels.attention_long_blocks and
    attention_long_split_blocks through the op's arguments): a decode step of queries on both
    sides of long_blocks and of the long splits' ends with their tail of 2 (so some long
    queries are one split, written by the kernel, and some several, merged), in an
    engine-wide table, gives each query's bits alone in a table of its own blocks, with one
    and two value parts, and for a TP rank's 64 heads (whole_heads 128). Engagement: the op's
    Gluon grid has the table's split count with long splits; control: without them (long_blocks
    0) only the queries of at least long_blocks blocks move, and some do."""
    import moe_kernels.gluon_attention as gluon_attention
    from moe_kernels.attention_launch import WIDE_LAUNCH, table_split_count
    from moe_kernels.triton_attention import _attend, mla_attention_triton

    tail = WIDE_LAUNCH.tail_blocks
    edges = (long_blocks - 1, long_blocks, long_split, long_split + tail, long_split + tail + 1)
    block_counts = sorted({b for e in edges for b in (e - 1, e, e + 1) if 1 <= b <= 120} | {3})
    lengths = [64 * (b - 1) + 1 + (17 * i) % 64 for i, b in enumerate(block_counts)]
    width = 128
    q, kv_cache, seq_ids, tables, positions = _decode_step(generator, lengths, 128, width)
    long = dict(long_blocks=long_blocks, long_split_blocks=long_split)
    kernel, grids = gluon_attention._mla_wide_split_kernel, []

    class Recorder:  # the op's Gluon launch grid, then the real launch
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    gluon_attention._mla_wide_split_kernel = Recorder()
    try:
        full = mla_attention_triton(
            q, kv_cache, seq_ids, tables, positions, scale=192**-0.5, v_dim=512, **long
        )  # fmt: skip
    finally:
        gluon_attention._mla_wide_split_kernel = kernel
    num_splits = table_split_count(width, 16, tail, long_blocks, long_split)
    assert [g[1:] for g in grids] == [(len(lengths), num_splits)], grids
    assert not full.isnan().any()
    launch = (WIDE_LAUNCH.split_blocks, WIDE_LAUNCH.num_warps, WIDE_LAUNCH.num_stages, 64)
    args = (q, kv_cache, seq_ids, tables, positions, 192**-0.5, 512, *launch)
    for v_parts in (1, 2):
        got = _attend(*args, is_gluon=True, tail_blocks=tail, v_parts=v_parts, **long)
        assert torch.equal(got, full), v_parts
    for i, b in enumerate(block_counts):
        own = tables[i : i + 1, :b].contiguous()
        alone = mla_attention_triton(
            q[i : i + 1], kv_cache, seq_ids[:1] * 0, own, positions[i : i + 1],
            scale=192**-0.5, v_dim=512, **long,
        )  # fmt: skip
        assert torch.equal(alone[0], full[i]), (i, b)
    for heads in (slice(0, 64), slice(64, 128)):
        got = mla_attention_triton(
            q[:, heads].contiguous(), kv_cache, seq_ids, tables, positions, scale=192**-0.5,
            v_dim=512, whole_heads=128, **long,
        )  # fmt: skip
        assert torch.equal(got, full[:, heads]), heads
    short = mla_attention_triton(
        q, kv_cache, seq_ids, tables, positions, scale=192**-0.5, v_dim=512, long_blocks=0
    )  # fmt: skip
    moved = (short != full).flatten(1).any(1).cpu()
    is_long = torch.tensor(block_counts) >= long_blocks
    assert not moved[~is_long].any(), "queries below long_blocks moved"
    assert moved[is_long].any(), "long splits moved no long query"
    torch.testing.assert_close(full.float(), short.float(), atol=2e-2, rtol=2e-2)


def _decode_step(generator, lengths, num_heads, width):
    """(q, kv_cache, seq_ids, block_tables, positions) of a bf16 decode step: one query a
    sequence at the last of its `lengths` positions, each sequence in its own shuffled cache
    blocks of 64, NaN in every unwritten slot, tables padded with -1 to `width` blocks."""
    seq_lens = torch.tensor(lengths)
    blocks = (seq_lens + 63) // 64
    seed = int(torch.randint(1 << 30, (1,), generator=generator))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv_cache = torch.randn(int(blocks.sum()), 64, 576, device="cuda", generator=gen).bfloat16()
    order = torch.randperm(kv_cache.shape[0], device="cuda", generator=gen)
    tables = torch.full((len(lengths), width), -1, dtype=torch.int64, device="cuda")
    starts = torch.cumsum(blocks, 0) - blocks
    for i in range(len(lengths)):
        tables[i, : blocks[i]] = order[starts[i] : starts[i] + blocks[i]]
        kv_cache[tables[i, blocks[i] - 1], (seq_lens[i] - 1) % 64 + 1 :] = float("nan")
    q = torch.randn(len(lengths), num_heads, 576, device="cuda", generator=gen).bfloat16()
    return q, kv_cache, torch.arange(len(lengths), device="cuda"), tables, (seq_lens - 1).cuda()


def test_mla_whole_query_launch_gives_the_split_bits(generator):
    """16 heads (V2-Lite) at decode, engine-wide tables (128 columns, -1 padding), NaN in
    every unwritten slot: 256 queries at positions on both sides of every split boundary up to
    5900 give the same bits when each program walks a query's group of splits (two and three
    stages, the launches the op picks from 256 and 128 programs) as when the splits and the
    merge kernel run, with one group a query and with groups of 8 splits with and without a
    tail of one split (then a query of one to three groups: the two-level merge), and as each
    query alone; controls: one split over the whole table (no restarts) moves the bits, groups
    of 8 move exactly the queries past one group, and the tail only queries of three groups
    whose last one it absorbed."""
    from moe_kernels.attention_launch import (
        LONG_BLOCKS,
        NARROW_LAUNCH,
        SPLIT_BLOCKS,
        whole_query_stages,
    )
    from moe_kernels.triton_attention import _attend, mla_attention_triton

    boundary = 64 * SPLIT_BLOCKS
    # i % 24 boundaries, (i // 24) % 3 the side: 1 token before, at, 1 past every boundary.
    lengths = [max(1, boundary * (i % 24) + (i // 24) % 3 - 1) for i in range(1, 257)]
    blocks = (torch.tensor(lengths) + 63) // 64
    q, kv_cache, seq_ids, tables, positions = _decode_step(generator, lengths, 16, 128)
    args = (q, kv_cache, seq_ids, tables, positions, 192**-0.5, 512)
    results = {}
    # One group (every split folded in turn), groups of 8 splits, and with a tail of a split;
    # and the op's long splits (of NARROW_LAUNCH.long_split_blocks from its long_blocks).
    long = LONG_BLOCKS
    for group_splits, tail, long_blocks in ((0, 0, 0), (8, 0, 0), (8, 4, 0), (0, 0, long)):
        groups = dict(group_splits=group_splits, group_tail=tail, long_blocks=long_blocks)
        groups["long_split_blocks"] = NARROW_LAUNCH.long_split_blocks if long_blocks else 0
        split = _attend(*args, SPLIT_BLOCKS, 4, 3, **groups)
        for stages in (2, 3):  # a program a group (without groups: a query)
            whole = _attend(*args, SPLIT_BLOCKS, 4, stages, is_whole_query=True, **groups)
            assert torch.equal(whole, split), (group_splits, tail, long_blocks, stages)
        assert not split.isnan().any()
        results[group_splits, tail, long_blocks] = split
    is_past_group = (blocks > 8 * SPLIT_BLOCKS).cuda()  # the queries past one group of 8
    assert torch.equal(results[0, 0, 0][~is_past_group], results[8, 0, 0][~is_past_group])
    assert not torch.equal(results[0, 0, 0][is_past_group], results[8, 0, 0][is_past_group])
    # The tail moves only queries whose last group (one split) it joined to the one before,
    # and only from the third group: (g1 g2) s then becomes g1 (g2 s); (g1) s stays.
    is_in_tail = (blocks > 32) & ((blocks - 1) % 32 < 4)
    moved = (results[8, 0, 0] != results[8, 4, 0]).flatten(1).any(1).cpu()
    assert not moved[~is_in_tail | (blocks <= 64)].any()
    assert moved[is_in_tail & (blocks > 64)].any(), "the tail moved no query of three groups"
    # Long splits move only the long queries' bits (and move some).
    moved = (results[0, 0, 0] != results[0, 0, long]).flatten(1).any(1).cpu()
    assert not moved[blocks < long].any() and moved[blocks >= long].any()
    whole = results[NARROW_LAUNCH.group_splits, NARROW_LAUNCH.group_tail, NARROW_LAUNCH.long_blocks]
    # The op with long splits (kernels.attention_long_blocks) gives the long launches' bits.
    got = mla_attention_triton(*args[:5], scale=args[5], v_dim=512, long_blocks=long)
    assert torch.equal(got, results[0, 0, long])
    # Engagement: the op takes the two launches above at 256 and 128 queries, the split
    # launch below (the single queries further down).
    assert [whole_query_stages(n) for n in (256, 128, 127)] == [2, 3, None]
    assert torch.equal(mla_attention_triton(*args[:5], scale=args[5], v_dim=512), whole)
    half = slice(64, 192)
    got = mla_attention_triton(
        q[half], kv_cache, seq_ids[half], tables, positions[half], scale=args[5], v_dim=512
    )
    assert torch.equal(got, whole[half])
    for i in (0, 22, 23, 47, 255):
        rows = slice(i, i + 1)
        alone = mla_attention_triton(
            q[rows], kv_cache, seq_ids[rows], tables, positions[rows], scale=args[5], v_dim=512
        )
        assert torch.equal(alone, whole[rows]), i
    assert not torch.equal(_attend(*args, tables.shape[1], 4, 3), whole), "no control"


@pytest.mark.parametrize("num_heads", (16, 20, 128))
def test_mla_merge_gives_the_same_bits_at_any_heads_a_program(generator, monkeypatch, num_heads):
    """The merge launch folds a query's KV split partials for 1, 2, 8 or 16 heads a program
    (merge_heads picks 8 at 128 heads, 1 at 16 and 20; at 20 the last program's extra heads
    are masked) with the same bits, at decode shapes where every query has two to four splits
    (16 and 20 heads: splits of 4 blocks, the Triton split launch; 128: 16 blocks and a tail
    of 2, the Gluon kernel), 48 queries in an engine-wide table (-1 padding, NaN in every
    unwritten slot); the output is close to the reference. Engagement: the merge ran with each
    count's grid. Control: half the split size (another merge order) moves the bits, so the
    comparison can fail."""
    import moe_kernels.triton_attention as attention
    from moe_kernels.attention import mla_attention_ref
    from moe_kernels.attention_launch import head_launch, merge_heads, split_count

    launch = head_launch(num_heads)
    split_tokens = 64 * launch.split_blocks
    lengths = [
        split_tokens + 64 * launch.tail_blocks + 1 + i * 2 * split_tokens // 47 for i in range(48)
    ]
    blocks = (torch.tensor(lengths) + 63) // 64
    width = int(blocks.max()) + 2 * launch.split_blocks
    args = _decode_step(generator, lengths, num_heads, width)
    splits = [split_count(int(b), launch.split_blocks, launch.tail_blocks) for b in blocks]
    assert min(splits) == 2 and max(splits) == 4, splits
    grids, kernel = [], attention._mla_merge_kernel

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(attention, "_mla_merge_kernel", Recorder())
    results = {}
    for per_program in (1, 2, 8, 16):
        monkeypatch.setattr(attention, "merge_heads", lambda heads, n=per_program: n)
        results[per_program] = attention.mla_attention_triton(*args, scale=192**-0.5, v_dim=512)
        assert grids[-1] == (48, -(-num_heads // per_program)), (per_program, grids)
    assert merge_heads(num_heads) == (8 if num_heads == 128 else 1)
    for per_program in (2, 8, 16):
        assert torch.equal(results[per_program], results[1]), per_program
    assert not results[1].isnan().any()
    expected = mla_attention_ref(*args, scale=192**-0.5, v_dim=512, tile_rows=64)
    torch.testing.assert_close(results[1].float(), expected.float(), atol=2e-2, rtol=2e-2)
    halved = attention._attend(
        *args, 192**-0.5, 512, launch.split_blocks // 2, launch.num_warps, launch.num_stages,
        launch.block_h, is_gluon=launch.block_h == 64,
    )  # fmt: skip
    assert not torch.equal(halved, results[8]), "no control"


@pytest.mark.parametrize("method", ("v2_lite", "v3"))
def test_router_topk_bitwise_invariant_and_matches_ref(generator, method):
    from moe_kernels.router import router_topk_ref
    from moe_kernels.triton_router import router_topk_triton

    if method == "v2_lite":
        num_experts, bias = 64, None
        params = dict(top_k=6, num_groups=1, topk_group=1, scoring_func="softmax")
        params.update(topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0)
    else:
        num_experts = 256
        bias = (torch.rand(num_experts, generator=generator) * 0.1).cuda()
        params = dict(top_k=8, num_groups=8, topk_group=4, scoring_func="sigmoid")
        params.update(topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=2.5)
    logits = _randn(generator, 4096, num_experts, dtype=torch.float32, scale=2.0)
    ids, weights = router_topk_triton(logits, bias, **params)
    ref_ids, ref_weights = router_topk_ref(
        logits.cpu(), None if bias is None else bias.cpu(), **params, tile_rows=64
    )
    # Ids may differ only where two choice scores are within an fp32 ulp (GPU exp vs CPU's).
    same = (ids.cpu() == ref_ids).all(dim=1)
    assert same.float().mean() > 0.999
    torch.testing.assert_close(weights.cpu()[same], ref_weights[same], atol=1e-6, rtol=1e-5)
    for m in ROW_COUNTS:
        sub_ids, sub_weights = router_topk_triton(logits[:m], bias, **params)
        assert torch.equal(sub_ids, ids[:m]) and torch.equal(sub_weights, weights[:m]), m
    perm = torch.randperm(4096, generator=generator).cuda()
    perm_ids, perm_weights = router_topk_triton(logits[perm], bias, **params)
    assert torch.equal(perm_ids, ids[perm]) and torch.equal(perm_weights, weights[perm])
    # No torch control here: torch.topk/softmax over a 64- or 256-wide row run one row per
    # warp or block on CUDA, so they may well be invariant too; the kernel exists so that
    # the invariance is by construction, not by a library's launch heuristics.


def test_router_logits_upcast_in_registers_gives_the_copy_bits(generator):
    """bf16 x against the fp32 router weight == the fp32 linear of x.float(), bit for bit, in
    every row bucket (V2-Lite: 64 experts x 2048; V3: 256 x 7168)."""
    from moe_kernels.triton_linear import linear_triton
    from moe_kernels.triton_router import router_logits_triton

    for num_experts, hidden in ((64, 2048), (256, 7168)):
        x = _randn(generator, 4096, hidden)
        w = _randn(generator, num_experts, hidden, dtype=torch.float32, scale=hidden**-0.5)
        for m in (1, 8, 16, 17, 64, 65, 256, 4096):
            assert torch.equal(router_logits_triton(x[:m], w), linear_triton(x[:m].float(), w))


def test_moe_output_kernel_is_the_cast_and_two_adds(generator):
    """The fused epilogue == routed.to(bf16) + shared, then residual + that, bit for bit."""
    from moe_kernels.combine import moe_output_ref
    from moe_kernels.triton_moe_output import moe_output_triton

    routed = _randn(generator, 256, 2048, dtype=torch.float32, scale=3.0)
    shared = _randn(generator, 256, 2048)
    residual = _randn(generator, 256, 2048, scale=30.0)
    for routed_in in (routed, routed.bfloat16()):  # fp32 combine; TP's gathered bf16 rows
        for shared_in in (shared, None):
            got = moe_output_triton(routed_in, shared_in, residual)
            assert torch.equal(got, moe_output_ref(routed_in, shared_in, residual))


def _v2_lite_moe_layer():
    """One DeepSeek-V2-Lite MoE layer (hidden 2048, 64 experts top-6 greedy softmax, 1408 per
    expert, 2 shared experts) on the GPU with random weights, and its invariant op table."""
    from moe_kernels import KernelConfig, build_op_table
    from moe_runtime.model.layers import NO_TP
    from moe_runtime.model.moe import MoE

    cfg = load_config(
        Path(__file__).resolve().parent.parent / "launch" / "configs" / "v2_lite_gpu.yaml"
    ).model
    ops = build_op_table(KernelConfig(), "cuda")
    with torch.device("cuda"):
        moe = MoE(cfg, ops, torch.bfloat16, cfg.n_routed_experts, NO_TP)
    cuda_generator = torch.Generator("cuda").manual_seed(0)
    for name, param in moe.named_parameters():
        scale = param.shape[-1] ** -0.5 * (4.0 if name.startswith("gate.") else 1.0)
        param.copy_(torch.randn(param.shape, generator=cuda_generator, device="cuda") * scale)
    return cfg, ops, moe


def _moe_layer_before_fusion(cfg, ops, moe, h, x):
    """The MoE layer as it ran before its launches were fused, op by op: the router's logits
    (its own launch), the replica map, the sort's order, the gather x[order // K], gate_up,
    silu * up and down as three launches, the combine deriving order's inverse, then
    routed.to(bf16) + shared and the residual add as three launches."""
    from moe_kernels.triton_combine import moe_combine_triton

    logits = ops.router_logits(h, moe.gate.weight)
    topk_ids, topk_weights = ops.router_topk(
        logits,
        None,
        top_k=cfg.num_experts_per_tok,
        num_groups=cfg.n_group,
        topk_group=cfg.topk_group,
        scoring_func=cfg.scoring_func,
        topk_method=cfg.topk_method,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )
    flat = moe.replica_row[topk_ids].reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=cfg.n_routed_experts)
    experts = moe.experts
    gate_up = ops.grouped_linear(h[order // cfg.num_experts_per_tok], experts.gate_up_proj, counts)
    hidden = ops.silu_mul(*gate_up.chunk(2, dim=-1))
    rows = ops.grouped_linear(hidden, experts.down_proj, counts)
    routed = moe_combine_triton(rows, order, topk_weights)
    return x + (routed.to(h.dtype) + moe.shared_experts(h)), topk_ids


@pytest.mark.parametrize("num_tokens", (1, 8, 64, 256, 1024, 8192))
def test_moe_layer_fused_launches_give_the_unfused_bits(generator, num_tokens):
    """The MoE layer (fused layout outputs, rows read through the token index, gate_up with
    silu * up, the combine with the epilogue) == the unfused composition it replaced, bit for
    bit, eagerly and replayed from a CUDA graph; from 1024 tokens the sort's layout, at 8192
    the grouped GEMM's TMA tiles."""
    cfg, ops, moe = _v2_lite_moe_layer()
    h = _randn(generator, num_tokens, cfg.hidden_size)
    x = _randn(generator, num_tokens, cfg.hidden_size, scale=10.0)
    want, want_ids = _moe_layer_before_fusion(cfg, ops, moe, h, x)
    got = moe(h, residual=x)
    assert torch.equal(moe.last_topk_ids, want_ids)
    assert torch.equal(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe(h, residual=x)
    graph.replay()
    assert torch.equal(captured, want)


# Row counts of the fused-kernel checks: decode sizes, one prefill tile and past it.
FUSED_ROW_COUNTS = (1, 7, 64, 300)


def test_write_latent_cache_fused_equals_unfused_bitwise(generator):
    """The one-launch latent norm + rope + cache write: the unfused Triton norm, rope, cat and
    index copy's bits, V2-Lite and tiny shapes, bf16 and fp32, shuffled mid-block slots."""
    from tests.test_triton_fused import assert_latent_cache_fused_equals_unfused

    assert_latent_cache_fused_equals_unfused(generator, "cuda", FUSED_ROW_COUNTS)


def test_write_latent_cache_replays_in_a_graph(generator):
    """Captured once, replayed with new rows, positions and slots written into its inputs."""
    from moe_kernels.triton_latent_cache import write_latent_cache_triton
    from tests.test_triton_fused import latent_inputs

    args = latent_inputs(generator, 64, 512, 64, 64, torch.bfloat16, "cuda")
    kv_a, weight, eps, positions, cos, sin, cache, slots = args
    write_latent_cache_triton(kv_a, weight, eps, positions, cos, sin, True, cache, slots)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_latent_cache_triton(kv_a, weight, eps, positions, cos, sin, True, cache, slots)
    for _ in range(2):
        fresh = latent_inputs(generator, 64, 512, 64, 64, torch.bfloat16, "cuda")
        kv_a.copy_(fresh[0]), positions.copy_(fresh[3]), slots.copy_(fresh[7])
        cache.fill_(float("nan"))
        graph.replay()
        want = torch.full_like(cache, float("nan"))
        write_latent_cache_triton(kv_a, weight, eps, positions, cos, sin, True, want, slots)
        assert torch.equal(cache.view(-1, 576)[slots], want.view(-1, 576)[slots])


def test_write_latent_cache_rotates_the_query_bitwise(generator):
    """The query's rope folded into the cache write's launch: rope_triton's bits in q_rot (a
    slice of the query buffer, the rest untouched), bf16 and fp32, positions up to 4095, 16 and
    3 heads; the cache rows the unfused launch's."""
    from moe_kernels.triton_latent_cache import write_latent_cache_triton
    from moe_kernels.triton_rope import rope_triton
    from tests.test_triton_fused import assert_query_rope_rides_along

    assert_query_rope_rides_along(
        generator,
        write_latent_cache_triton,
        rope_triton,
        "cuda",
        FUSED_ROW_COUNTS,
        (torch.bfloat16, torch.float32),
    )


def test_add_rms_norm_fused_equals_unfused_bitwise(generator):
    """The residual add + post-attention norm in one launch: torch's bf16 add and the Triton
    norm's bits, both outputs, at the V2-Lite and tiny hidden sizes."""
    from tests.test_triton_fused import assert_add_rms_norm_fused_equals_unfused

    assert_add_rms_norm_fused_equals_unfused(generator, "cuda", FUSED_ROW_COUNTS)


def test_query_built_in_place_equals_cat_bitwise(generator):
    """W_UK's batched GEMM and the q_pe rope writing into slices of one query buffer: the bits
    of the cat of their own outputs (strided stores only)."""
    from tests.test_triton_fused import assert_query_in_place_equals_cat

    assert_query_in_place_equals_cat(generator, "cuda", FUSED_ROW_COUNTS)


# (hidden D, whole intermediate I) of the gated MLPs: V2-Lite's shared experts and dense MLP,
# V3's shared experts (their separate [I, D] halves split K in 8, the joint [2I, D] does not).
GATED_MLP_SHAPES = ((2048, 2816), (2048, 10944), (7168, 2048))


@pytest.mark.parametrize("hidden, intermediate", GATED_MLP_SHAPES)
def test_joint_gate_up_linear_same_bits_for_every_batch_and_tp_slice(
    generator, hidden, intermediate
):
    """GatedMLP's one gate/up launch: the two separate linears' bits side by side wherever
    their fixed K split agrees with the joint weight's, and at every row count and every TP
    rank's slice (its gate rows + its up rows, with whole_out_dim = 2I) the TP-1 bits."""
    from moe_kernels.triton_linear import linear_triton
    from moe_kernels.triton_linear_config import k_split_count

    whole = 2 * intermediate
    x = _randn(generator, 300, hidden)
    gate = _randn(generator, intermediate, hidden, scale=hidden**-0.5)
    up = _randn(generator, intermediate, hidden, scale=hidden**-0.5)
    joint_weight = torch.cat([gate, up])
    joint = linear_triton(x, joint_weight, whole_out_dim=whole)
    torch.testing.assert_close(joint.float(), x.float() @ joint_weight.float().t(), **BF16_TOL)
    apart = torch.cat([linear_triton(x, gate), linear_triton(x, up)], dim=-1)

    def splits(out_dim: int) -> int:
        return k_split_count(out_dim, hidden, x.dtype)

    # A changed K split changes bits (the control): V3's shared experts, 8 splits -> 1.
    assert torch.equal(joint, apart) == (splits(intermediate) == splits(whole))
    for tp_size in (1, 2, 4, 8):
        local = intermediate // tp_size
        for tp_rank in range(tp_size):
            rows = slice(tp_rank * local, (tp_rank + 1) * local)
            weight = torch.cat([gate[rows], up[rows]])
            want = torch.cat([joint[:, rows], joint[:, intermediate:][:, rows]], dim=-1)
            for m in (1, 7, 64, 300):
                got = linear_triton(x[:m], weight, whole_out_dim=whole)
                assert torch.equal(got, want[:m]), (tp_size, tp_rank, m)
        if splits(2 * local) != splits(whole):
            # Control: without whole_out_dim the slice takes its own split and other bits.
            assert not torch.equal(linear_triton(x, weight), want), tp_size


@pytest.mark.parametrize("num_experts, top_k", ((64, 6), (256, 8)))
def test_router_topk_id_map_is_the_gather_exactly(generator, num_experts, top_k):
    """The MoE's logical -> physical map folded into the top-k launch: the mapped ids equal
    replica_row[topk_ids] exactly, at every row count, and ids and weights keep their bits."""
    from moe_kernels.triton_router import router_topk_triton

    params = dict(top_k=top_k, num_groups=1, topk_group=1, scoring_func="softmax")
    params.update(topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0)
    logits = _randn(generator, 300, num_experts, dtype=torch.float32, scale=2.0)
    # A replica row: every logical expert's slot among 2E physical ones, replicas included.
    replica_row = torch.randperm(2 * num_experts, generator=generator)[:num_experts].cuda()
    ids, weights = router_topk_triton(logits, None, **params)
    for m in (0, 1, 7, 64, 300):
        got_ids, got_weights, slot_ids = router_topk_triton(
            logits[:m], None, **params, id_map=replica_row
        )
        assert torch.equal(got_ids, ids[:m]) and torch.equal(got_weights, weights[:m]), m
        assert torch.equal(slot_ids, replica_row[ids[:m]]), m
