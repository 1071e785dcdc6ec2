"""Seeds: the one way a request's seed becomes per-sample and per-position noise seeds.

Shared by the driver (a fresh seed for a request without one, a derived seed per sample when
n > 1) and the worker's sampler (a seed per output position). Pure functions of ints.
"""

from __future__ import annotations

import secrets

import numpy as np

SEED_BITS = 63
MAX_SEED = 2**SEED_BITS - 1  # a request's seed; the sampler's noise takes it as an int64


def derive_seed(*parts: int) -> int:
    """A stable 63-bit seed from non-negative ints, e.g. (request seed, sample index)."""
    if not parts or any(not isinstance(p, int) or p < 0 for p in parts):
        raise ValueError(f"derive_seed needs one or more ints >= 0, got {parts!r}")
    state = np.random.SeedSequence(parts).generate_state(1, dtype=np.uint64)[0]
    return int(state) >> (64 - SEED_BITS)


def from_signed_seed(seed: int) -> int:
    """OpenAI's seed, a signed 64-bit int, as a request seed: one >= 0 as it is, a negative one
    hashed from its two's complement (derive_seed(2**64 + seed)) into the 63-bit seeds, rather
    than folded onto the one it shares its low 63 bits with (-1 would be 2**63 - 1)."""
    if not -(2**63) <= seed <= MAX_SEED:
        raise ValueError(f"seed must be a signed 64-bit int, got {seed}")
    return seed if seed >= 0 else derive_seed(2**64 + seed)


def resolve_seed(seed: int | None) -> int:
    """The given seed as is; None draws a fresh one, which the engine records."""
    return secrets.randbits(SEED_BITS) if seed is None else seed


def sample_seeds(request_seed: int, num_samples: int) -> list[int]:
    """The seed of each of a request's n samples: the request seed itself when n == 1, else
    derive_seed(request seed, sample index), so one sample can be replayed alone."""
    if num_samples == 1:
        return [request_seed]
    return [derive_seed(request_seed, i) for i in range(num_samples)]
