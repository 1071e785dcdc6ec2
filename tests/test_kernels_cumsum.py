"""The sampler's cumsum: an exact integer scan, the same bits in any association order and on any
device, prefix-invariant; and its fast control.

Measured on an H200 (torch 2.11): torch.cumsum of one fp32 row of V = 102400 gave other bits
in 50 of 50 repeats, and cumsum(x[:V-1]) differed from cumsum(x)[:V-1] (CUB's look-back scan
associates by which tile finished first); at V = 1000 neither happened. The GPU test below is
the control there. On the CPU, torch.cumsum of an fp32 row is one sequential loop, fixed-order
but not exact: close to the reference, not always its bits.
"""

import pytest
import torch

from moe_kernels.cumsum import MASS_BITS, cumsum_fast, cumsum_ref

LENGTHS = (1, 2, 31, 1000, 102400)


def _probs(generator, length: int, device="cpu") -> torch.Tensor:
    """A sorted-looking probability row with a long tail, as top-p sees it."""
    p = torch.rand(length, generator=generator) ** 8
    return (p / p.sum()).sort(descending=True).values.to(device)


def _exact_scan(x: torch.Tensor) -> torch.Tensor:
    """The reference's contract in Python integers: each value cut to 2**-MASS_BITS steps,
    added exactly, each prefix rounded to the nearest double, scaled back, then to x's dtype."""
    total, prefixes = 0, []
    for value in x.double().tolist():
        total += int(value * 2**MASS_BITS)  # exact scaling, truncated as int64 casts truncate
        prefixes.append(float(total) * 2.0**-MASS_BITS)
    return torch.tensor(prefixes, dtype=torch.float64).to(x.dtype)


@pytest.mark.parametrize("length", LENGTHS)
def test_cumsum_ref_is_the_exact_fixed_point_scan(generator, length):
    x = _probs(generator, length)
    out = cumsum_ref(x)
    assert out.dtype == torch.float32 and out.shape == x.shape
    if length <= 1000:
        assert torch.equal(out, _exact_scan(x))
    torch.testing.assert_close(out[-1], torch.tensor(1.0), rtol=0, atol=1e-5)


def test_cumsum_ref_same_bits_in_any_association_order(generator):
    """What lets CUDA's CUB scan give the CPU's bits: the sums are of integers. Scanning the row
    as blocks (block-local scans, then each block's total carried in) gives the same output;
    the same blocks in fp32 (the float association a tiled scan makes) do not."""
    x = _probs(generator, 102400)
    full = cumsum_ref(x)
    blocks = x.view(100, 1024)
    steps = (blocks.double() * 2.0**MASS_BITS).to(torch.int64)
    local = torch.cumsum(steps, -1)
    carried = torch.cumsum(local[:, -1], 0) - local[:, -1]
    tiled = ((local + carried[:, None]).double() * 2.0**-MASS_BITS).float().view(-1)
    assert torch.equal(tiled, full)
    local_f = torch.cumsum(blocks, -1)  # control: the same tiling on the floats
    carried_f = torch.cumsum(local_f[:, -1], 0) - local_f[:, -1]
    assert not torch.equal((local_f + carried_f[:, None]).view(-1), full), "no control"


def test_cumsum_ref_prefix_and_row_invariant(generator):
    x = _probs(generator, 5000)
    full = cumsum_ref(x)
    for m in (1, 2, 3, 255, 256, 257, 4999):
        assert torch.equal(cumsum_ref(x[:m]), full[:m]), m
    rows = torch.stack([_probs(generator, 5000), x, x.flip(0)])
    assert torch.equal(cumsum_ref(rows)[1], full)


def test_cumsum_fast_close_to_ref(generator):
    x = _probs(generator, 200_000)
    torch.testing.assert_close(cumsum_fast(x), cumsum_ref(x), rtol=0, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_cumsum_ref_fixed_and_fast_run_dependent(generator):
    x = _probs(generator, 102400, "cuda")
    ref = cumsum_ref(x)
    assert ref.device == x.device and torch.equal(ref.cpu(), cumsum_ref(x.cpu()))
    assert all(torch.equal(cumsum_ref(x), ref) for _ in range(5))
    assert torch.equal(cumsum_ref(x[:-1]), ref[:-1])
    fast = cumsum_fast(x)
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-5)
    # Control: CUB's look-back scan associates by which tile finished first.
    repeats = [cumsum_fast(x) for _ in range(20)]
    assert any(not torch.equal(r, fast) for r in repeats), "CUDA torch.cumsum was run-stable"
