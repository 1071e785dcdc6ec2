"""RMSNorm: HF-semantics closeness, bitwise row invariance, multi-thread fast-path control."""

import pytest
import torch

from moe_kernels import rmsnorm
from moe_kernels.rmsnorm import rms_norm_fast, rms_norm_ref
from tests.test_kernels_shapes import spy_input_shapes

EPS = 1e-6
TILE_SIZES = (4, 16)
# Row widths: a DeepSeek-V3 hidden size plus an odd tail, and one where torch splits a lone
# row's sum between 2 threads but not a batch's rows (the negative control's width).
WIDTHS = (7168 + 5, 2**16)


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


def _assert_rows_bitwise_invariant(norm, tile_rows, width, generator):
    """norm(x [40, width]) row by row: the same bits in every prefix, each row alone, permuted,
    and behind other rows."""
    x = torch.randn(40, width, generator=generator)
    weight = torch.rand(width, generator=generator)
    full = norm(x, weight)
    for m in _prefix_sizes(tile_rows):
        assert torch.equal(norm(x[:m], weight), full[:m]), m
    for i in range(len(x)):
        assert torch.equal(norm(x[i : i + 1], weight), full[i : i + 1]), f"row {i} alone"
    perm = torch.randperm(40, generator=generator)
    assert torch.equal(norm(x[perm], weight), full[perm])
    mixed = torch.cat([torch.randn(3, width, generator=generator), x[7:8]])
    assert torch.equal(norm(mixed, weight)[3], full[7])


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("num_threads", (1, 2))
@pytest.mark.parametrize("tile_rows", TILE_SIZES)
def test_rms_norm_ref_rows_bitwise_invariant(
    generator, monkeypatch, restore_num_threads, tile_rows, num_threads, width
):
    torch.set_num_threads(num_threads)
    tiles = spy_input_shapes(monkeypatch, rmsnorm, "rms_norm_fast")
    _assert_rows_bitwise_invariant(
        lambda x, weight: rms_norm_ref(x, weight, EPS, tile_rows=tile_rows),
        tile_rows,
        width,
        generator,
    )
    assert set(tiles) == {(tile_rows, width)}, sorted(set(tiles))  # engagement: whole tiles only


def test_rms_norm_fast_rows_differ_where_torch_splits_a_row(generator, restore_num_threads):
    """Negative control, the same assertions on the untiled norm: with 2 threads torch splits the
    reduction of a lone long row across threads but gives each of many rows to one thread
    (measured: D >= 40000 on this CPU), so a row's mean differs alone; rsqrt absorbs most such
    differences, but not in all 40 rows. At 1 thread, or at D = 7173, torch is invariant too."""
    torch.set_num_threads(2)
    with pytest.raises(AssertionError):
        _assert_rows_bitwise_invariant(
            lambda x, weight: rms_norm_fast(x, weight, EPS), 4, 2**16, generator
        )
