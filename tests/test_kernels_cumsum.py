"""The sampler's cumsum: a fixed-order scan, bitwise prefix-invariant, and its fast control.

Measured on the 2-core CPU machine (torch 2.13, 1 and 2 threads, fp32 rows of 50 to 200k
probabilities): torch.cumsum of one fp32 row is already one sequential loop accumulating in
fp64 (bitwise equal to cumsum of the fp64 row rounded to fp32, and prefix-invariant), so on CPU
the fast op has the reference's bits and no control can fail here; the op exists for CUDA,
where torch.cumsum is a CUB scan. Measured on an H200 (torch 2.11): at V = 102400 the same row
gave other bits in 50 of 50 repeats, and cumsum(x[:V-1]) differed from cumsum(x)[:V-1]; at
V = 1000 neither happened. The GPU test below is the control there.
"""

import pytest
import torch

from kernels.cumsum import cumsum_fast, cumsum_ref

LENGTHS = (1, 2, 31, 1000, 102400)


def _probs(generator, length: int, device="cpu") -> torch.Tensor:
    """A sorted-looking probability row with a long tail, as top-p sees it."""
    p = torch.rand(length, generator=generator) ** 8
    return (p / p.sum()).sort(descending=True).values.to(device)


@pytest.mark.parametrize("length", LENGTHS)
def test_cumsum_ref_is_the_fp64_sequential_scan(generator, length):
    x = _probs(generator, length)
    out = cumsum_ref(x)
    assert out.dtype == torch.float32 and out.shape == x.shape
    if length <= 1000:  # the scan written out, in index order
        acc, expected = 0.0, []
        for value in x.double().tolist():
            acc += value
            expected.append(acc)
        assert torch.equal(out, torch.tensor(expected, dtype=torch.float64).float())
    torch.testing.assert_close(out[-1], torch.tensor(1.0), rtol=0, atol=1e-5)


def test_cumsum_ref_prefix_invariant(generator):
    x = _probs(generator, 5000)
    full = cumsum_ref(x)
    for m in (1, 2, 3, 255, 256, 257, 4999):
        assert torch.equal(cumsum_ref(x[:m]), full[:m]), m


@pytest.mark.parametrize("num_threads", (1, 2))
def test_cpu_torch_cumsum_is_already_fixed_order(generator, restore_num_threads, num_threads):
    # The measurement the module docstring states: on CPU, fast == ref bit for bit.
    torch.set_num_threads(num_threads)
    x = _probs(generator, 200_000)
    assert torch.equal(cumsum_fast(x), cumsum_ref(x))


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
