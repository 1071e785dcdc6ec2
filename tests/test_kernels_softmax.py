"""Softmax / log-softmax: closeness to fp64 and bitwise row invariance of the references.

Plain torch softmax was measured batch-invariant on this CPU (fp32 and bf16 inputs, V from 7
to 2**20, 1 and 2 threads), so the fast path cannot serve as the control. The control is a
softmax whose row sum is split at a point that follows the batch size, run through the same
assertion, which must catch it. A reference that stopped tiling would still pass the comparison
here; the engagement check catches it: the row op ran on [tile_rows, V] tiles only.
"""

import pytest
import torch

from moe_kernels import softmax
from moe_kernels.softmax import log_softmax_fast, log_softmax_ref, softmax_fast, softmax_ref
from tests.test_kernels_shapes import spy_input_shapes

TILE_SIZES = (4, 16)
WIDTH = 1003  # V of the row-invariance checks
OPS = [
    (softmax_ref, softmax_fast, torch.softmax),
    (log_softmax_ref, log_softmax_fast, torch.log_softmax),
]


def _prefix_sizes(tile_rows):
    return sorted({1, 2, 3, 7, tile_rows - 1, tile_rows, tile_rows + 1, 2 * tile_rows + 3} - {0})


@pytest.mark.parametrize("ref, fast, fp64_op", OPS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_softmax_ref_close_to_fp64_and_fast(generator, ref, fast, fp64_op, dtype):
    x = (torch.randn(37, 1000, generator=generator) * 4).to(dtype)
    out = ref(x, tile_rows=4)
    assert out.dtype == torch.float32
    expected = fp64_op(x.double(), dim=-1).float()
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)  # fp32 output, V = 1000
    torch.testing.assert_close(out, fast(x), atol=0, rtol=0)


def _split_sum_softmax(x, *, tile_rows):
    """Negative control: the row sum is split at a batch-dependent column, then added."""
    e = torch.exp(x - x.amax(-1, keepdim=True))
    split = 1 + x.shape[0] % (x.shape[1] - 1)
    return e / (e[:, :split].sum(-1, keepdim=True) + e[:, split:].sum(-1, keepdim=True))


def _assert_rows_bitwise_invariant(ref, tile_rows, generator):
    x = torch.randn(40, WIDTH, generator=generator) * 4
    full = ref(x, tile_rows=tile_rows)
    for m in _prefix_sizes(tile_rows):
        assert torch.equal(ref(x[:m], tile_rows=tile_rows), full[:m]), m
    perm = torch.randperm(40, generator=generator)
    assert torch.equal(ref(x[perm], tile_rows=tile_rows), full[perm])
    mixed = torch.cat([torch.randn(5, WIDTH, generator=generator), x[11:12]])
    assert torch.equal(ref(mixed, tile_rows=tile_rows)[5], full[11])


@pytest.mark.parametrize("ref, row_op", [op[:2] for op in OPS])
@pytest.mark.parametrize("tile_rows", TILE_SIZES)
def test_softmax_ref_rows_bitwise_invariant(generator, monkeypatch, ref, row_op, tile_rows):
    tiles = spy_input_shapes(monkeypatch, softmax, row_op.__name__)
    _assert_rows_bitwise_invariant(ref, tile_rows, generator)
    assert set(tiles) == {(tile_rows, WIDTH)}, sorted(set(tiles))  # engagement: whole tiles only


@pytest.mark.parametrize("tile_rows", TILE_SIZES)
def test_split_sum_control_is_caught(generator, tile_rows):
    with pytest.raises(AssertionError):
        _assert_rows_bitwise_invariant(_split_sum_softmax, tile_rows, generator)
