"""The sampler's Gumbel noise in one Triton launch (CUDA): each element's splitmix64 draw and its
fp64 transform in registers, one fp32 store, where the torch form makes a pass over an [R, V]
int64 or fp64 temporary for each of its ~25 operations.

The same integers as the torch form (moe_runtime/worker/sampler.py: gumbel_noise, whose
docstring defines the draw) and the same formula, -log(-log(u)) in fp64 rounded to fp32 once;
the logs are libdevice's, so an element may differ from the CPU's by an fp32 ulp where libm's and
libdevice's fp64 logs part across a rounding. Each element is a function of its own (key, vocab
id), so a row's noise is the same in every batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NOISE_BLOCK = 1024  # vocabulary ids a program


@triton.jit
def _gumbel_noise_kernel(keys_ptr, out_ptr, vocab_size, NOISE_BITS: tl.constexpr,
                         BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    # splitmix64: output number id + 1 of the generator seeded with the row's key (uint64
    # arithmetic wraps; >> on unsigned ints is logical).
    z = key + (ids + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    bits = (z >> (64 - NOISE_BITS)).to(tl.float64)
    u = bits * -(2.0**-NOISE_BITS) + (1.0 - 2.0 ** -(NOISE_BITS + 1))  # exact: 53 bits
    noise = -tl.log(-tl.log(u))
    tl.store(out_ptr + row.to(tl.int64) * vocab_size + ids, noise.to(tl.float32),
             mask=ids < vocab_size)  # fmt: skip


def gumbel_noise_triton(keys: torch.Tensor, vocab_size: int, noise_bits: int) -> torch.Tensor:
    """[R, vocab_size] fp32 noise of the rows' int64 keys [R] (the splitmix64 outputs the torch
    form computes from each row's seed and position)."""
    out = torch.empty((keys.shape[0], vocab_size), dtype=torch.float32, device=keys.device)
    if keys.shape[0]:
        grid = (keys.shape[0], triton.cdiv(vocab_size, NOISE_BLOCK))
        _gumbel_noise_kernel[grid](
            keys.contiguous(), out, vocab_size, NOISE_BITS=noise_bits, BLOCK=NOISE_BLOCK
        )
    return out
