"""The sampler's Gumbel noise on CUDA: the Triton kernel (moe_kernels/triton_noise.py, what
gumbel_noise runs on CUDA) against the torch forms it replaced, at R rows of a 102,400-token
vocabulary, median µs of triton.testing.do_bench; and how many of the kernel's values differ
from the fp64 torch form (libdevice's logs in both, the same integers: expected none).

    python bench/sampler_noise.py [--vocab 102400] [--rows 1 8 64 256]

Forms: "torch 23-bit" (the sampler before the forty-second session: u on a 2**-23 grid in
fp32, noise topping out at 16.6), "torch fp64" (the same 52-bit draw and fp64 transform as the
kernel, as torch ops over [32, V] chunks: ~25 passes over int64 / fp64 temporaries), "triton"
(one launch, each element in registers, one fp32 store). GPU only.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moe_runtime.worker import sampler  # noqa: E402


def torch_noise(seeds: list[int], positions: list[int], vocab: int, is_23_bit: bool):
    """The torch forms, rows hashed 32 at a time as the sampler hashed them on CUDA."""
    device = torch.device("cuda")
    counters = sampler.host_to_device(positions, device) + 1
    keys = sampler._mix(sampler.host_to_device(seeds, device) + sampler._GOLDEN * counters)
    steps = sampler._GOLDEN * torch.arange(1, vocab + 1, device=device)
    parts = []
    for start in range(0, len(seeds), 32):
        mixed = sampler._mix(keys[start : start + 32, None] + steps)
        if is_23_bit:
            u = (sampler._shift_right(mixed, 41).float() + 0.5) * 2.0**-23
            parts.append(-torch.log(-torch.log(u)))
        else:
            bits = sampler._shift_right(mixed, 64 - sampler.NOISE_BITS)
            parts.append(sampler.noise_from_bits(bits))
    return torch.cat(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=102400)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sampler_noise needs a CUDA device")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    print(
        "| rows | torch 23-bit µs | torch fp64 µs | triton µs | values differing (triton vs fp64) |"
    )
    print("|---|---|---|---|---|")
    for rows in args.rows:
        seeds, positions = list(range(1000, 1000 + rows)), list(range(rows))
        kernel = sampler.gumbel_noise(seeds, positions, args.vocab, torch.device("cuda"))
        differ = int((kernel != torch_noise(seeds, positions, args.vocab, False)).sum())
        forms = (
            partial(torch_noise, seeds, positions, args.vocab, True),
            partial(torch_noise, seeds, positions, args.vocab, False),
            partial(sampler.gumbel_noise, seeds, positions, args.vocab, torch.device("cuda")),
        )
        times = [
            triton.testing.do_bench(fn, warmup=10, rep=200, return_mode="median") * 1e3
            for fn in forms
        ]
        cells = " | ".join(f"{t:.1f}" for t in times)
        print(f"| {rows} | {cells} | {differ} of {kernel.numel()} |")


if __name__ == "__main__":
    main()
