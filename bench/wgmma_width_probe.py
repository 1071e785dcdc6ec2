"""Whether a Hopper warpgroup MMA gives each output column the same bits at every N: the question
a value split of the 128-head attention kernel rests on (BENCHMARKS.md, "The 128-head price at
B = 1 taken apart").

The 128-head Gluon kernel multiplies a block's probabilities (64 x 64, bf16, from registers) into
a 64 x 256 fp32 accumulator of value columns (one warpgroup MMA of N = 256 a block, after the
accumulator is rescaled by the online softmax's alpha). A value split would give each program a
share of those columns: the same products at N = 128 or 64. This probe runs that chain (rescale,
then acc += P @ V, block after block) in Triton at BLOCK_N = 256, 128 and 64 over the same 512
columns and compares the results bit for bit; the PTX is searched for the MMA shape each width
compiled to (engagement: wgmma m64nNk16 at each N). The control computes the same sums with
each block's 64 keys in reverse order (P's columns and V's rows reversed together: the same
products, summed in another order), which must change some bits: the probe sees a reordered
sum. (Adding each block's product after its own rounding is no control: Triton folds the add
into the MMA's accumulator, the same bits.)

    python bench/wgmma_width_probe.py [--blocks 17] [--seeds 8]

GPU only (sm_90).
"""

from __future__ import annotations

import argparse
import re

import torch
import triton
import triton.language as tl

V_COLS = 512  # the MLA latent's value columns
BS = 64  # cache rows a block
ROWS = 64  # heads a program (one warpgroup MMA's M)


@triton.jit
def _value_chain(s_ptr, v_ptr, alpha_ptr, acc_ptr, out_ptr, num_blocks, REVERSED: tl.constexpr,
                 V_COLS: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr):  # fmt: skip
    """Columns [pid * BLOCK_N, + BLOCK_N) of: acc = acc * alpha_b + bf16(exp(s_b)) @ V_b for each
    block b (its keys in reverse order where REVERSED), the probabilities made in registers as
    the kernel's are."""
    rows = tl.arange(0, ROWS)
    keys = tl.arange(0, BS)
    if REVERSED:
        keys = BS - 1 - keys
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.load(acc_ptr + rows[:, None] * V_COLS + cols[None, :])
    for b in range(num_blocks):
        alpha = tl.load(alpha_ptr + b * ROWS + rows)
        s = tl.load(s_ptr + b * ROWS * BS + rows[:, None] * BS + keys[None, :])
        p = tl.exp(s).to(tl.bfloat16)
        v = tl.load(v_ptr + b * BS * V_COLS + keys[:, None] * V_COLS + cols[None, :])
        acc = tl.dot(p, v, acc * alpha[:, None])
    tl.store(out_ptr + rows[:, None] * V_COLS + cols[None, :], acc)


def run(inputs, block_n: int, reversed_keys: bool = False):
    """The chain over all 512 columns in programs of block_n columns; (output, MMA shapes in
    the PTX)."""
    s, v, alpha, acc = inputs
    out = torch.empty_like(acc)
    kernel = _value_chain[(V_COLS // block_n,)](
        s, v, alpha, acc, out, s.shape[0], REVERSED=reversed_keys, V_COLS=V_COLS, BS=BS, ROWS=ROWS,
        BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    shapes = sorted(
        set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", kernel.asm["ptx"]))
    )
    return out, shapes


def make_inputs(num_blocks: int, seed: int, device: str):
    """Scores with a wide spread (probabilities from 1 down to ~1e-9, so products span many
    exponents), bf16 values, alphas <= 1 as an online softmax's are, a nonzero accumulator."""
    g = torch.Generator(device=device).manual_seed(seed)
    s = -torch.rand(num_blocks, ROWS, BS, generator=g, device=device) * 20
    v = torch.randn(num_blocks, BS, V_COLS, generator=g, device=device).to(torch.bfloat16)
    alpha = torch.rand(num_blocks, ROWS, generator=g, device=device) * 0.5 + 0.5
    acc = torch.randn(ROWS, V_COLS, generator=g, device=device) * 4
    return s, v, alpha, acc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=17, help="cache blocks a chain (B = 1's 17)")
    parser.add_argument("--seeds", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("wgmma_width_probe needs an sm_90 GPU")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    widths = (256, 128, 64)
    unequal = {n: 0 for n in widths[1:]}
    control_unequal = 0
    for seed in range(args.seeds):
        inputs = make_inputs(args.blocks, seed, "cuda")
        base, base_shapes = run(inputs, widths[0])
        for n in widths[1:]:
            out, shapes = run(inputs, n)
            differ = int((out.view(torch.int32) != base.view(torch.int32)).sum())
            unequal[n] += differ
            if seed == 0:
                print(f"BLOCK_N {n}: MMA {shapes} against BLOCK_N 256: MMA {base_shapes}")
        rev, _ = run(inputs, widths[0], reversed_keys=True)
        control_unequal += int((rev.view(torch.int32) != base.view(torch.int32)).sum())
    total = args.seeds * ROWS * V_COLS
    for n, differ in unequal.items():
        print(f"N = {n} vs 256: {differ} of {total} fp32 outputs differ in their bits")
    print(f"control (keys reversed) at N = 256: {control_unequal} of {total} differ")
    if control_unequal == 0:
        raise SystemExit("the control found no difference: the probe cannot see a reordered sum")


if __name__ == "__main__":
    main()
