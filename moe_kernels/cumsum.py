"""Prefix sum of one row: the sampler's top-p mass, exact and plain.

`cumsum_ref` adds in integers: each value (a probability: in [0, 1], a row summing to about 1)
is cut to a whole number of 2**-MASS_BITS steps, exactly, and the integers are added. Integer
adds are exact, so every association order gives the same prefix sums: CUDA's cumsum (a CUB
decoupled look-back scan, whose float association depends on which tile finished first) gives
the CPU's integers, on the row's own device and without a host round trip. Each prefix is then
converted back and rounded to the input dtype once. The cut drops at most 2**-MASS_BITS a
value (~2e-14 over a 102400-token vocabulary, far below an fp32 ulp of the mass).
`cumsum_fast` is torch.cumsum on the row's own device.
"""

from __future__ import annotations

import torch

# Steps of 2**-62: a row's integers sum below 2**63 while its mass stays under 2 (the
# probabilities of a softmax sum to 1 within a few fp32 ulps).
MASS_BITS = 62


def cumsum_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., V] of values in [0, 1] with row sums below 2 -> [..., V] along the last dim:
    out[i] = (n[0] + ... + n[i]) * 2**-MASS_BITS rounded to x's dtype, n[j] = x[j] * 2**MASS_BITS
    cut to an integer; on x's device, the same bits on every device and for any row prefix."""
    steps = (x.double() * 2.0**MASS_BITS).to(torch.int64)  # exact scaling, then the cut
    return (torch.cumsum(steps, -1).double() * 2.0**-MASS_BITS).to(x.dtype)


def cumsum_fast(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, -1)
