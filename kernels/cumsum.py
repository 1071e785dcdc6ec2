"""Prefix sum of one row: the sampler's top-p mass, fixed-order and plain.

`cumsum_ref` is a sequential scan in fp64, each output rounded to the input dtype; it runs on
the CPU, where torch's scan of one row is one loop in index order, because CUDA's cumsum is a
CUB decoupled look-back scan whose association order depends on which tile finished first.
`cumsum_fast` is torch.cumsum on the row's own device.
"""

from __future__ import annotations

import torch


def cumsum_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [..., V] along the last dim: out[i] = x[0] + ... + x[i] added in index order
    in fp64, each row on its own; x's dtype and device."""
    # Host sync on CUDA: the rows go to the host and back once, however many there are.
    return torch.cumsum(x.cpu().double(), -1).to(device=x.device, dtype=x.dtype)


def cumsum_fast(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, -1)
