"""Linear / grouped linear: closeness to fp64, bitwise row invariance, fast-path control."""

import pytest
import torch

from moe_kernels.linear import grouped_linear_fast, grouped_linear_ref, linear_fast, linear_ref

ATOL = RTOL = 1e-5  # fp32 vs fp64 for K = 256 with unit-variance inputs, weights ~ 1/sqrt(K)
TILE_SIZES = (4, 16)


def _inputs(generator, num_rows=40, in_dim=256, out_dim=96, num_groups=None):
    x = torch.randn(num_rows, in_dim, generator=generator)
    shape = (out_dim, in_dim) if num_groups is None else (num_groups, out_dim, in_dim)
    return x, torch.randn(shape, generator=generator) / in_dim**0.5


def _prefix_sizes(tile_rows):
    return sorted({1, 2, 3, 7, tile_rows - 1, tile_rows, tile_rows + 1, 2 * tile_rows + 3} - {0})


@pytest.mark.parametrize("tile_rows", TILE_SIZES)
def test_linear_ref_close_to_fp64_and_fast(generator, tile_rows):
    x, w = _inputs(generator)
    out = linear_ref(x, w, tile_rows=tile_rows)
    torch.testing.assert_close(out, (x.double() @ w.double().t()).float(), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out, linear_fast(x, w), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("tile_rows", TILE_SIZES)
def test_linear_ref_rows_bitwise_invariant(generator, tile_rows, dtype):
    x, w = (t.to(dtype) for t in _inputs(generator))
    full = linear_ref(x, w, tile_rows=tile_rows)
    for m in _prefix_sizes(tile_rows):
        assert torch.equal(linear_ref(x[:m], w, tile_rows=tile_rows), full[:m]), m
    perm = torch.randperm(x.shape[0], generator=generator)
    assert torch.equal(linear_ref(x[perm], w, tile_rows=tile_rows), full[perm])
    # Row 5 placed among freshly drawn neighbours, at another offset in its tile.
    others = torch.randn(9, x.shape[1], generator=generator).to(dtype)
    mixed = torch.cat([others[:6], x[5:6], others[6:]])
    assert torch.equal(linear_ref(mixed, w, tile_rows=tile_rows)[6], full[5])


def test_linear_empty_input(generator):
    _, w = _inputs(generator)
    assert linear_ref(torch.zeros(0, 256), w, tile_rows=4).shape == (0, 96)


def test_linear_fast_is_not_row_invariant(generator):
    # Negative control: CPU BLAS takes another path for M <= 3 than for M >= 7.
    x, w = _inputs(generator)
    full = linear_fast(x, w)
    assert any(not torch.equal(linear_fast(x[:m], w)[0], full[0]) for m in (1, 2, 3))


@pytest.mark.parametrize("tile_rows", TILE_SIZES)
def test_grouped_linear_ref_close_and_row_invariant(generator, tile_rows):
    x, w = _inputs(generator, num_rows=50, num_groups=4)
    sizes = [9, 0, 40, 1]
    out = grouped_linear_ref(x, w, sizes, tile_rows=tile_rows)
    group_of_row = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))
    expected = torch.einsum("ni,noi->no", x.double(), w.double()[group_of_row]).float()
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out, grouped_linear_fast(x, w, sizes), atol=ATOL, rtol=RTOL)
    # Group 2 receives a different number of tokens, in another order: each row keeps its bits.
    rows = x[9:49]
    for m in _prefix_sizes(tile_rows):
        sub = grouped_linear_ref(rows[:m], w, [0, 0, m, 0], tile_rows=tile_rows)
        assert torch.equal(sub, out[9 : 9 + m]), m
    perm = torch.randperm(40, generator=generator)
    shuffled = grouped_linear_ref(
        torch.cat([x[:9], rows[perm]]), w, [9, 0, 40, 0], tile_rows=tile_rows
    )
    assert torch.equal(shuffled[9:], out[9:49][perm])


def test_grouped_linear_rejects_bad_group_sizes(generator):
    x, w = _inputs(generator, num_rows=5, num_groups=2)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_linear_ref(x, w, [2, 2], tile_rows=4)


def test_grouped_linear_fast_is_not_row_invariant(generator):
    # Negative control: the expert's bits for a token depend on how many tokens it received.
    x, w = _inputs(generator, num_rows=16, num_groups=2)
    full = grouped_linear_fast(x, w, [0, 16])
    assert any(
        not torch.equal(grouped_linear_fast(x[:m], w, [0, m])[0], full[0]) for m in (1, 2, 3)
    )
