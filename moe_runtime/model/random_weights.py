"""Random weights as a pure function of (seed, tensor name, element index): a counter-based
uniform draw (splitmix64 of the index), the same bits on CPU and CUDA, in any layout.

Why not torch.Generator: its streams differ between devices and depend on how many values were
drawn before, so a TP rank's slice or an EP rank's subset of experts could not get the values
world size 1 draws.
"""

from __future__ import annotations

import hashlib

import torch

CHUNK_NUMEL = 1 << 26  # elements drawn at once: the int64 temporaries stay under ~2 GiB

# splitmix64 (Steele et al.) constants, as the signed int64 values torch stores.
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def weight_key(seed: int, name: str) -> int:
    """The signed 64-bit stream key of one tensor: a hash of (seed, name), equal in every process
    (Python's own hash() is salted per process)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def uniform_from_index(key: int, ids: torch.Tensor) -> torch.Tensor:
    """ids int64 (overwritten) -> fp32 in [-1, 1), multiples of 2^-23: the top 24 bits of
    splitmix64(key + (id + 1) * gamma).

    Why: only wrapping int64 add/multiply, xor, masked (logical) right shifts and exact
    int -> float steps, so CPU and CUDA give the same bits; torch.Generator streams differ.
    """
    z = ids.add_(1).mul_(_GAMMA).add_(key)
    z.bitwise_xor_(_shift_right(z, 30)).mul_(_MIX1)
    z.bitwise_xor_(_shift_right(z, 27)).mul_(_MIX2)
    z.bitwise_xor_(_shift_right(z, 31))
    top = _shift_right(z, 40)  # [0, 2^24)
    return top.sub_(1 << 23).float().mul_(2.0**-23)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64: torch's >> sign-extends, so the copied sign bits are masked."""
    return (z >> bits).bitwise_and_((1 << (64 - bits)) - 1)


def fill_uniform(
    out: torch.Tensor,
    key: int,
    bound: float,
    chunk_numel: int = CHUNK_NUMEL,
    first: int = 0,
    full_cols: int | None = None,
) -> None:
    """out (contiguous, any dtype) <- bound * uniform_from_index(key, element ids), drawn on
    out's device in chunks of chunk_numel elements.

    Local element (r, c) has id `first + r * full_cols + c`: the index of the same element in
    the full tensor when `out` is a TP rank's slice of it (`_shard_start`).
    """
    flat, cols = out.view(-1), out.shape[-1] if out.dim() else 1
    full_cols = full_cols or cols
    # Rounded to fp32 here: one fp32 multiply, correctly rounded on every device.
    scale = float(torch.tensor(bound, dtype=torch.float32))
    for start in range(0, flat.numel(), chunk_numel):
        stop = min(start + chunk_numel, flat.numel())
        ids = torch.arange(start, stop, dtype=torch.int64, device=out.device)
        if full_cols != cols:
            ids = ids // cols * full_cols + ids % cols
        flat[start:stop].copy_(uniform_from_index(key, ids.add_(first)).mul_(scale))
