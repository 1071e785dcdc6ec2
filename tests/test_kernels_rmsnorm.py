"""RMSNorm: HF-semantics closeness, bitwise row invariance, multi-thread fast-path control."""

import pytest
import torch

from moe_kernels.rmsnorm import rms_norm_fast, rms_norm_ref

EPS = 1e-6
TILE_SIZES = (4, 16)


def _prefix_sizes(tile_rows):
    return sorted({1, 2, 3, 7, tile_rows - 1, tile_rows, tile_rows + 1, 2 * tile_rows + 3} - {0})


def _fp64_rms_norm(x, weight):
    x64 = x.double()
    return weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)


@pytest.mark.parametrize("tile_rows", TILE_SIZES)
def test_rms_norm_ref_close_to_fp64_and_fast(generator, tile_rows):
    x = torch.randn(40, 512, generator=generator) * 3
    weight = torch.rand(512, generator=generator) + 0.5
    out = rms_norm_ref(x, weight, EPS, tile_rows=tile_rows)
    # fp32 statistics over D = 512: a few ulps of fp32.
    torch.testing.assert_close(out, _fp64_rms_norm(x, weight).float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, rms_norm_fast(x, weight, EPS), atol=1e-6, rtol=1e-6)


def test_rms_norm_bf16_matches_hf_semantics(generator):
    x = torch.randn(6, 64, generator=generator).to(torch.bfloat16)
    weight = torch.rand(64, generator=generator).to(torch.bfloat16)
    out = rms_norm_ref(x, weight, EPS, tile_rows=4)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, rms_norm_fast(x, weight, EPS), atol=0, rtol=0)


@pytest.mark.parametrize("num_threads", (1, 2))
@pytest.mark.parametrize("tile_rows", TILE_SIZES)
def test_rms_norm_ref_rows_bitwise_invariant(
    generator, restore_num_threads, tile_rows, num_threads
):
    torch.set_num_threads(num_threads)
    x = torch.randn(40, 7168 + 5, generator=generator)
    weight = torch.rand(x.shape[1], generator=generator)
    full = rms_norm_ref(x, weight, EPS, tile_rows=tile_rows)
    for m in _prefix_sizes(tile_rows):
        assert torch.equal(rms_norm_ref(x[:m], weight, EPS, tile_rows=tile_rows), full[:m]), m
    perm = torch.randperm(40, generator=generator)
    assert torch.equal(rms_norm_ref(x[perm], weight, EPS, tile_rows=tile_rows), full[perm])
    mixed = torch.cat([torch.randn(3, x.shape[1], generator=generator), x[7:8]])
    assert torch.equal(rms_norm_ref(mixed, weight, EPS, tile_rows=tile_rows)[3], full[7])


def test_rms_norm_long_row_ref_invariant_fast_not(generator, restore_num_threads):
    # Negative control: with 2 threads torch splits the reduction of a lone long row across
    # threads but gives each of many rows to one thread (measured: D >= 40000 on this CPU).
    torch.set_num_threads(2)
    # The mean differs in about half the rows; rsqrt absorbs some, so take 32 rows.
    x = torch.randn(32, 2**16, generator=generator)
    weight = torch.ones(2**16)
    full_fast = rms_norm_fast(x, weight, EPS)
    alone_fast = torch.cat([rms_norm_fast(x[i : i + 1], weight, EPS) for i in range(32)])
    assert not torch.equal(alone_fast, full_fast)
    full_ref = rms_norm_ref(x, weight, EPS, tile_rows=4)
    alone_ref = torch.cat([rms_norm_ref(x[i : i + 1], weight, EPS, tile_rows=4) for i in range(32)])
    assert torch.equal(alone_ref, full_ref)
