"""Rotary position embedding for the MLA rope channels, with optional YaRN scaling.

cos/sin are tabulated once per absolute position, so a token's rotation depends on its
position only (elementwise, batch-invariant). Layouts: interleaved pairs (x0, x1), (x2, x3)...
as DeepSeek checkpoints store them, or rotate-half pairs (x_i, x_{i+R/2}). This module owns
the tables and the layout; the rotation is the op table's (write_latent_cache rotates k_pe and
q_pe, moe_kernels/latent_cache.py).
"""

from __future__ import annotations

import math

import torch


class RotaryEmbedding:
    def __init__(
        self,
        rope_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None,
        is_interleaved: bool,
    ) -> None:
        inv_freq, attention_factor = _inv_freq(rope_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.cos = freqs.cos() * attention_factor  # [S, R/2]
        self.sin = freqs.sin() * attention_factor
        self.is_interleaved = is_interleaved

    def to(self, device: torch.device) -> RotaryEmbedding:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self


def softmax_scale(qk_head_dim: int, scaling: dict | None) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's rule)."""
    scale = qk_head_dim**-0.5
    if scaling and scaling.get("mscale_all_dim"):
        mscale = _yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _inv_freq(dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    base_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return 1.0 / base_freqs, 1.0
    factor = scaling["factor"]
    original_max = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if scaling.get("attention_factor") is not None:
        attention_factor = scaling["attention_factor"]
    elif mscale and mscale_all_dim:
        attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * base_freqs)) * (1 - extrapolation) + (
        1.0 / base_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)
