"""SiLU: the invariant form is shape-blind bit for bit; F.silu is not (negative control)."""

import torch
import torch.nn.functional as F

from moe_kernels.activation import silu_fast, silu_ref


def _row_alone_vs_in_batch(fn, x: torch.Tensor) -> int:
    """Rows whose bits differ between fn(x) and fn applied to each row alone."""
    batched = fn(x)
    return sum(not torch.equal(fn(x[i : i + 1]), batched[i : i + 1]) for i in range(x.shape[0]))


def test_silu_ref_close_to_torch(generator):
    x = torch.randn(37, 53, generator=generator) * 4
    torch.testing.assert_close(silu_ref(x), F.silu(x), atol=1e-6, rtol=1e-6)  # stated tolerance


def test_silu_ref_is_shape_invariant_and_fast_is_not(generator):
    # Odd widths put elements of one row in the vectorised body or in the scalar tail
    # depending on the rows before it.
    x = torch.randn(64, 37, generator=generator) * 3
    assert _row_alone_vs_in_batch(silu_ref, x) == 0
    perm = torch.randperm(64, generator=generator)
    assert torch.equal(silu_ref(x[perm]), silu_ref(x)[perm])
    assert _row_alone_vs_in_batch(silu_fast, x) > 0, "F.silu was shape-blind: control cannot fail"
