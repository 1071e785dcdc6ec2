"""Triton kernels on CPU under TRITON_INTERPRET=1: closeness to the torch oracles, bit-exact
row invariance of the kernels themselves, and the wrappers' input checks.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. at import of the kernel
module, and other test modules may import those modules first (through the op table). So
the interpreted checks run together in one fresh interpreter process (tests/interpreted.py) and
each test asserts on its own check's outcome.
The interpreter's tl.dot is numpy's BLAS, whose rounding depends on a row's position inside
the [BLOCK_M, BLOCK_K] tile, a property of the CPU emulation and not of the kernel. Here the
linear checks move rows only by whole tiles (offset kept); arbitrary permutations are
checked bitwise on the GPU (tests/test_gpu_kernels.py).
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from tests import interpreted

SEED = 0
EPS = 1e-6
LINEAR_ROWS = (1, 2, 63, 64, 65, 130)  # both sides of BLOCK_M = 64, and two full tiles
NORM_ROWS = (1, 2, 7, 33)
# fp32 with exact (ieee) products vs fp64, K <= 160, weights ~ 1/sqrt(K): a few fp32 ulps.
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
# bf16 outputs: the kernel and the oracle may round one bf16 ulp (2**-8 relative) apart.
BF16_TOL = {"atol": 1e-2, "rtol": 1e-2}
# RMSNorm in bf16 rounds twice (normalised row, then times weight): up to two ulps apart.
BF16_NORM_TOL = {"atol": 2e-2, "rtol": 2e-2}
DTYPES = (torch.float32, torch.bfloat16)


def _tol(dtype: torch.dtype) -> dict:
    return FP32_TOL if dtype == torch.float32 else BF16_TOL


def check_linear(generator: torch.Generator) -> None:
    from moe_kernels.triton_linear import linear_triton

    for dtype in DTYPES:
        x = torch.randn(130, 160, generator=generator).to(dtype)
        w = (torch.randn(96, 160, generator=generator) / 160**0.5).to(dtype)
        full = linear_triton(x, w)
        assert full.dtype == dtype and full.shape == (130, 96)
        expected = (x.double() @ w.double().t()).to(dtype)
        torch.testing.assert_close(full, expected, **_tol(dtype))
        for m in LINEAR_ROWS:
            assert torch.equal(linear_triton(x[:m], w), full[:m]), (dtype, m)
        assert linear_triton(x[:0], w).shape == (0, 96)
        # Tiles swapped, and row 5 among fresh neighbours in another tile at offset 5.
        perm = torch.cat([torch.arange(64, 128), torch.arange(64), torch.arange(128, 130)])
        assert torch.equal(linear_triton(x[perm], w), full[perm]), dtype
        others = torch.randn(70, 160, generator=generator).to(dtype)
        mixed = torch.cat([others[:69], x[5:6], others[69:]])
        assert torch.equal(linear_triton(mixed, w)[69], full[5]), dtype


def check_linear_k_split(generator: torch.Generator) -> None:
    """The fixed K split (a weight-shape property): a row's bits ignore the row count and the
    launch's row chunks; close to fp64."""
    import moe_kernels.triton_split_k as triton_split_k
    from moe_kernels.triton_linear import _launch
    from moe_kernels.triton_linear_config import LinearConfig, k_split_chunk, k_split_count
    from moe_kernels.triton_split_k import arrival_counts, launch_split_k

    x = torch.randn(130, 2048, generator=generator).to(torch.bfloat16)
    w = (torch.randn(96, 2048, generator=generator) / 2048**0.5).to(torch.bfloat16)
    assert k_split_count(96, 2048, w.dtype) == 4 and k_split_chunk(2048, 4) == 512
    assert k_split_count(102400, 2048, w.dtype) == 1 and k_split_count(96, 160, w.dtype) == 1
    assert k_split_count(2048, 10944, w.dtype) == 8 and k_split_chunk(10944, 8) == 1408
    assert k_split_count(3072, 2048, w.dtype) == 1  # wider than SPLIT_MAX_OUT: no split
    config = LinearConfig(16, 32, 64, 8, 4, 4)
    full = _launch(x, w, x.new_empty((130, 96)), 130, config)
    assert torch.equal(_launch(x[:64], w, x.new_empty((64, 96)), 64, config), full[:64])
    chunk = triton_split_k.SPLIT_ROW_CHUNK
    try:
        triton_split_k.SPLIT_ROW_CHUNK = 48  # three launches of 48, 48 and 34 rows
        assert torch.equal(_launch(x, w, x.new_empty((130, 96)), 130, config), full)
    finally:
        triton_split_k.SPLIT_ROW_CHUNK = chunk
    expected = (x.double() @ w.double().t()).to(torch.bfloat16)
    torch.testing.assert_close(full, expected, **BF16_TOL)
    # The finishing program's adds (an fp32 out: the interpreter's own bf16 rounding is not
    # torch's): each chunk's fp32 sum alone (a one-chunk launch), added in chunk order; the
    # folded launches (<= 16 rows) leave the arrival counts they are given at zero.
    sums = []
    for c in range(4):
        cols = slice(c * 512, (c + 1) * 512)
        part = torch.empty((130, 96), dtype=torch.float32)
        sums.append(
            launch_split_k(x[:, cols], w[:, cols].contiguous(), part, 512, config, is_tree=False)
        )
    total = launch_split_k(x, w, torch.empty((130, 96)), 512, config, is_tree=False)
    assert torch.equal(total, ((sums[0] + sums[1]) + sums[2]) + sums[3])
    assert not torch.equal(total, ((sums[3] + sums[2]) + sums[1]) + sums[0])  # order matters
    arrivals = arrival_counts("cpu")
    for _ in range(2):  # the second launch finds the counts the first left
        few = launch_split_k(x[:9], w, torch.empty((9, 96)), 512, config, is_tree=False,
                             arrivals=arrivals)  # fmt: skip
        assert torch.equal(few, total[:9]) and not arrivals.any()


def check_grouped_linear(generator: torch.Generator) -> None:
    from moe_kernels.linear import grouped_linear_ref
    from moe_kernels.triton_grouped_linear import grouped_linear_triton

    sizes = [9, 0, 70, 1]
    for dtype in DTYPES:
        x = torch.randn(80, 96, generator=generator).to(dtype)
        w = (torch.randn(4, 64, 96, generator=generator) / 96**0.5).to(dtype)
        out = grouped_linear_triton(x, w, sizes)
        expected = grouped_linear_ref(x.double(), w.double(), sizes, tile_rows=8).to(dtype)
        torch.testing.assert_close(out, expected, **_tol(dtype))
        # Group 2 receives fewer tokens: each of its rows keeps its bits.
        rows = x[9:79]
        for m in LINEAR_ROWS[:-1]:
            sub = grouped_linear_triton(rows[:m], w, [0, 0, m, 0])
            assert torch.equal(sub, out[9 : 9 + m]), (dtype, m)
        # Other experts receive other counts: group 2's rows keep their bits.
        moved = grouped_linear_triton(torch.cat([x[:3], rows, x[:5]]), w, [3, 0, 70, 5])
        assert torch.equal(moved[3:73], out[9:79]), dtype


def check_grouped_linear_device_counts(generator: torch.Generator) -> None:
    """Counts as a tensor (the capturable path, tiles found in the kernel): the host-list bits,
    rows past the counts' sum never written, and the reference's values for many groups
    (empty ones included) over several tile sizes and tile bounds."""
    from moe_kernels.linear import grouped_linear_ref
    from moe_kernels.triton_grouped_linear import grouped_linear_triton, grouped_tile_bound

    sizes = [9, 0, 70, 1]
    for dtype in DTYPES:
        x = torch.randn(80, 96, generator=generator).to(dtype)
        w = (torch.randn(4, 64, 96, generator=generator) / 96**0.5).to(dtype)
        out = grouped_linear_triton(x, w, torch.tensor(sizes))
        assert torch.equal(out, grouped_linear_triton(x, w, sizes))
        # Counts 8 rows short of N: the first 72 rows are the same GEMM's.
        counts = torch.tensor([9, 0, 62, 1])
        short = grouped_linear_triton(x, w, counts)
        assert torch.equal(short[:72], grouped_linear_triton(x[:72], w, [9, 0, 62, 1]))
    assert grouped_tile_bound(80, 4, 64) == 2 + 4 and grouped_tile_bound(3, 4, 64) == 3
    for num_groups, rows in ((3, 40), (64, 6), (64, 300), (100, 700)):
        counts = torch.zeros(num_groups, dtype=torch.int64)
        picks = torch.randint(0, num_groups, (rows,), generator=generator)
        counts.index_add_(0, picks, torch.ones_like(picks))
        x = torch.randn(rows, 32, generator=generator)
        w = torch.randn(num_groups, 16, 32, generator=generator) / 32**0.5
        expected = grouped_linear_ref(x, w, counts.tolist(), tile_rows=8)
        torch.testing.assert_close(grouped_linear_triton(x, w, counts), expected, **FP32_TOL)


def check_grouped_linear_gather(generator: torch.Generator) -> None:
    """Rows read through an index (the MoE layer's token_of_row): the bits of the gathered
    copy's GEMM, host and device counts, repeated and unsorted tokens, the reference too."""
    from moe_kernels.linear import grouped_linear_ref
    from moe_kernels.triton_grouped_linear import grouped_linear_triton

    sizes = [9, 0, 70, 1]
    for dtype in DTYPES:
        x = torch.randn(30, 96, generator=generator).to(dtype)
        w = (torch.randn(4, 64, 96, generator=generator) / 96**0.5).to(dtype)
        index = torch.randint(0, 30, (80,), generator=generator)
        copied = grouped_linear_triton(x[index], w, sizes)
        for counts in (sizes, torch.tensor(sizes)):
            got = grouped_linear_triton(x, w, counts, row_index=index)
            assert got.shape == (80, 64) and torch.equal(got, copied), dtype
        # Another index over the same rows reads other rows: the index is really used.
        other = grouped_linear_triton(x, w, sizes, row_index=index.flip(0))
        assert not torch.equal(other, copied), dtype
        ref = grouped_linear_ref(x, w, sizes, tile_rows=8, row_index=index)
        assert torch.equal(ref, grouped_linear_ref(x[index], w, sizes, tile_rows=8)), dtype


def check_grouped_linear_tma(generator: torch.Generator) -> None:
    """The persistent TMA grouped GEMM (prefill sizes; small tiles here): close to fp64, a
    group's rows keep their bits whatever the other groups hold (the bits against the
    pointer kernel are the GPU's to check: tests/test_gpu_kernels.py), rows read through an
    index, counts short of x's rows."""
    from moe_kernels.linear import grouped_linear_ref
    from moe_kernels.triton_grouped_linear import _grouped
    from moe_kernels.triton_linear_config import LinearConfig

    config = LinearConfig(16, 32, 64, 8, 4, 3, is_persistent=True)
    for dtype in DTYPES:
        x = torch.randn(80, 96, generator=generator).to(dtype)
        w = (torch.randn(4, 64, 96, generator=generator) / 96**0.5).to(dtype)
        out = _grouped(x, w, torch.tensor([9, 0, 70, 1]), None, is_gated=False, config=config)
        want = grouped_linear_ref(x.double(), w.double(), [9, 0, 70, 1], tile_rows=8)
        torch.testing.assert_close(out, want.to(dtype), **_tol(dtype))
        moved = torch.cat([x[:3], x[9:79], x[:5]])
        other = _grouped(moved, w, torch.tensor([3, 0, 70, 5]), None, is_gated=False, config=config)
        assert torch.equal(other[3:73], out[9:79]), dtype
        index = torch.randperm(80, generator=generator)
        gathered = _grouped(x, w, torch.tensor([9, 0, 70, 1]), index, is_gated=False, config=config)
        plain = _grouped(
            x[index], w, torch.tensor([9, 0, 70, 1]), None, is_gated=False, config=config
        )
        assert torch.equal(gathered, plain), dtype
        # Counts short of x's rows: the rows they cover are the same GEMM's.
        short = _grouped(x, w, torch.tensor([9, 0, 60, 1]), None, is_gated=False, config=config)
        assert torch.equal(short[:69], out[:69]), dtype


def check_linear_chain_tma(generator: torch.Generator) -> None:
    """The persistent TMA kernel's fixed K split (NUM_CHUNKS, the chain of chunk sums): close
    to the fp64 sum, a row's bits wherever it sits in the batch; control: the plain K loop
    over the same K (NUM_CHUNKS 1) gives other fp32 bits. (Its bits against the pointer
    kernel's chain are the GPU's to check: tests/test_gpu_kernels.py; here the interpreter's
    products follow the operands' memory layout, which TMA and pointer loads lay out apart.)"""
    from moe_kernels.triton_linear import _launch_persistent
    from moe_kernels.triton_linear_config import LinearConfig, block_k_of

    for dtype in DTYPES:
        tma = LinearConfig(16, 32, block_k_of(dtype), 8, 4, 3, is_persistent=True)
        x = torch.randn(37, 512, generator=generator).to(dtype)
        w = (torch.randn(64, 512, generator=generator) / 512**0.5).to(dtype)
        got = _launch_persistent(x, w, x.new_empty((37, 64)), tma, 4)
        want = x.double() @ w.double().t()
        torch.testing.assert_close(got, want.to(dtype), **_tol(dtype))
        moved = _launch_persistent(x[5:].clone(), w, x.new_empty((32, 64)), tma, 4)
        assert torch.equal(moved, got[5:]), dtype
        if dtype == torch.float32:  # (bf16 outputs round most fp32 differences away)
            plain = _launch_persistent(x, w, x.new_empty((37, 64)), tma, 1)
            assert not torch.equal(plain, got)


def check_batched_linear_tma(generator: torch.Generator) -> None:
    """The persistent TMA kernel's batched form (3-d descriptors over strided views, as MLA's
    W_UK reads q_nope out of the projected query and writes into the query buffer): close to
    the fp64 products, each product's rows keep their bits with other rows around them, and
    each product is its own (a batch of one gives product b's bits). Its bits against the
    pointer kernel are the GPU's to check (tests/test_gpu_kernels.py)."""
    from moe_kernels.triton_dot import tma_ok
    from moe_kernels.triton_linear import _launch
    from moe_kernels.triton_linear_config import LinearConfig, block_k_of

    heads, rows, nope, width = 3, 37, 64, 96
    for dtype in DTYPES:
        tma = LinearConfig(16, 32, block_k_of(dtype), 8, 4, 3, is_persistent=True)
        q = torch.randn(rows, heads, width, generator=generator).to(dtype)
        x = q[..., :nope].transpose(0, 1)  # [H, T, nope], rows `heads * width` apart
        w = (torch.randn(heads, 48, nope, generator=generator) / nope**0.5).to(dtype)
        buffer = torch.zeros(rows, heads, 80, dtype=dtype)
        out = buffer[..., :48].transpose(0, 1)  # [H, T, 48] inside a wider row
        assert tma_ok(x, w, out)  # engagement: the TMA kernel takes these views
        _launch(x, w, out, rows, tma)
        want = torch.einsum("htk,hnk->htn", x.double(), w.double())
        torch.testing.assert_close(out, want.to(dtype), **_tol(dtype))
        assert not buffer[..., 48:].any()  # nothing written past the view
        moved = x[:, 5:].contiguous()
        got = _launch(moved, w, moved.new_empty((heads, rows - 5, 48)), rows - 5, tma)
        assert torch.equal(got, out[:, 5:]), dtype
        one = _launch(x[1:2], w[1:2], x.new_empty((1, rows, 48)), rows, tma)
        assert torch.equal(one[0], out[1]), dtype


def check_grouped_gated_linear(generator: torch.Generator) -> None:
    """gate_up and silu * up in one launch: the bits of the grouped GEMM's gate and up columns
    through the silu kernel (here; on the GPU in tests/test_gpu_kernels.py), host and device
    counts, rows through an index; a swapped gate / up half gives other values."""
    from moe_kernels.triton_activation import silu_mul_triton
    from moe_kernels.triton_grouped_linear import (
        GATED_MAX_MEAN_ROWS,
        grouped_gated_linear_triton,
        grouped_linear_triton,
    )

    sizes = [9, 0, 70, 1]
    for dtype in DTYPES:
        x = torch.randn(30, 96, generator=generator).to(dtype)
        w = (torch.randn(4, 2 * 40, 96, generator=generator) / 96**0.5).to(dtype)
        index = torch.randint(0, 30, (80,), generator=generator)
        gate, up = grouped_linear_triton(x, w, sizes, row_index=index).chunk(2, dim=-1)
        want = silu_mul_triton(gate, up)
        for counts in (sizes, torch.tensor(sizes)):
            got = grouped_gated_linear_triton(x, w, counts, row_index=index)
            assert got.shape == (80, 40) and torch.equal(got, want), dtype
        assert torch.equal(grouped_gated_linear_triton(x[index], w, sizes), want), dtype
        swapped = torch.cat([w[:, 40:], w[:, :40]], dim=1)
        assert not torch.equal(grouped_gated_linear_triton(x[index], swapped, sizes), want)
    # Past GATED_MAX_MEAN_ROWS a group the op takes the two launches: the same values.
    many = GATED_MAX_MEAN_ROWS * 2 + 1
    x = torch.randn(many, 32, generator=generator)
    w = torch.randn(2, 2 * 16, 32, generator=generator) / 32**0.5
    gate, up = grouped_linear_triton(x, w, [many, 0]).chunk(2, dim=-1)
    assert torch.equal(grouped_gated_linear_triton(x, w, [many, 0]), silu_mul_triton(gate, up))


def check_batched_linear(generator: torch.Generator) -> None:
    """The MLA's absorbed products: one launch over heads, each head linear_triton's bits,
    from strided [H, T, K] views of [T, H, K] activations."""
    from moe_kernels.triton_linear import batched_linear_triton, linear_triton

    for dtype in DTYPES:
        for rows in (1, 5, 70):
            q = torch.randn(rows, 3, 40, generator=generator).to(dtype)
            w = (torch.randn(3, 48, 32, generator=generator) / 32**0.5).to(dtype)
            x = q[:, :, :32].transpose(0, 1)  # [H, T, 32], row stride 120, head stride 40
            out = batched_linear_triton(x, w)
            assert out.shape == (3, rows, 48) and out.dtype == dtype
            for h in range(3):
                assert torch.equal(out[h], linear_triton(x[h].contiguous(), w[h])), (dtype, h)


def check_moe_combine(generator: torch.Generator) -> None:
    """One kernel, slot order: here (no FMA in the interpreter) the torch reference's bits;
    a token's row ignores the other tokens, the arrival order and absent slots."""
    from moe_kernels.combine import moe_combine_ref
    from moe_kernels.triton_combine import moe_combine_triton

    num_tokens, top_k, dim = 7, 3, 600  # two column blocks, the second masked
    rows = torch.randn(num_tokens * top_k, dim, generator=generator).to(torch.bfloat16)
    weights = torch.rand(num_tokens, top_k, generator=generator)
    slots = torch.randperm(num_tokens * top_k, generator=generator)
    out = moe_combine_triton(rows, slots, weights)
    assert torch.equal(out, moe_combine_ref(rows, slots, weights))
    keep = slots // top_k != 2  # token 2's rows all absent (e.g. its experts elsewhere)
    partial = moe_combine_triton(rows[keep], slots[keep], weights)
    assert torch.equal(partial[2], torch.zeros(dim)) and torch.equal(partial[3:], out[3:])
    # Token 4 alone, its rows arriving in another order, at another offset.
    mine = (slots // top_k == 4).nonzero()[:, 0].flip(0)
    alone = moe_combine_triton(rows[mine], slots[mine] % top_k, weights[4:5])
    assert torch.equal(alone[0], out[4])
    # The inverse handed in (as the dispatch layout does): the same bits, absent slots too.
    inverse = torch.full((num_tokens * top_k,), -1, dtype=torch.int64)
    inverse[slots[keep]] = torch.arange(int(keep.sum()))
    given = moe_combine_triton(rows[keep], slots[keep], weights, row_of_slot=inverse)
    assert torch.equal(given, partial)


def check_moe_combine_output(generator: torch.Generator) -> None:
    """The combine and the MoE output in one launch == the two kernels it replaces (here and,
    where FMAs and bf16 casts are the GPU's, in tests/test_gpu_kernels.py), with and without
    shared experts and the layout's inverse, absent slots too."""
    from moe_kernels.triton_combine import moe_combine_output_triton, moe_combine_triton
    from moe_kernels.triton_moe_output import moe_output_triton

    num_tokens, top_k, dim = 7, 3, 600
    for dtype in DTYPES:
        rows = torch.randn(num_tokens * top_k, dim, generator=generator).to(dtype)
        weights = torch.rand(num_tokens, top_k, generator=generator)
        slots = torch.randperm(num_tokens * top_k, generator=generator)
        keep = slots // top_k != 2
        shared = torch.randn(num_tokens, dim, generator=generator).to(dtype)
        residual = (torch.randn(num_tokens, dim, generator=generator) * 4).to(dtype)
        inverse = torch.full((num_tokens * top_k,), -1, dtype=torch.int64)
        inverse[slots[keep]] = torch.arange(int(keep.sum()))
        for shared_in in (shared, None):
            for row_of_slot in (None, inverse):
                routed = moe_combine_triton(rows[keep], slots[keep], weights, row_of_slot)
                want = moe_output_triton(routed, shared_in, residual)
                got = moe_combine_output_triton(
                    rows[keep], slots[keep], weights, shared_in, residual, row_of_slot
                )
                assert got.dtype == dtype and torch.equal(got, want), (dtype, shared_in is None)
        assert not torch.equal(got, residual)  # the routed rows were really added


def check_moe_output(generator: torch.Generator) -> None:
    """The MoE epilogue in one launch == the cast and two adds it replaces (fp32 bitwise here;
    bf16 roundings bitwise on the GPU: the interpreter's bf16 casts are not the GPU's), with
    and without shared experts, routed in fp32 or already rounded (TP's gathered rows)."""
    from moe_kernels.combine import moe_output_ref
    from moe_kernels.triton_moe_output import moe_output_triton

    for dtype in DTYPES:
        routed = torch.randn(5, 1500, generator=generator)  # two blocks of 1024, one masked
        shared = torch.randn(5, 1500, generator=generator).to(dtype)
        residual = (torch.randn(5, 1500, generator=generator) * 4).to(dtype)
        for routed_in in (routed, routed.to(dtype)):
            for shared_in in (shared, None):
                got = moe_output_triton(routed_in, shared_in, residual)
                want = moe_output_ref(routed_in, shared_in, residual)
                assert got.dtype == dtype and got.shape == (5, 1500)
                if dtype == torch.float32:
                    assert torch.equal(got, want)
                else:  # three bf16 roundings, each up to an ulp off here (2**-8 relative)
                    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
        full = moe_output_triton(routed, shared, residual)
        assert torch.equal(moe_output_triton(routed[:2], shared[:2], residual[:2]), full[:2])


def check_silu_mul(generator: torch.Generator) -> None:
    from moe_kernels.activation import silu_mul_ref
    from moe_kernels.triton_activation import silu_mul_triton

    for dtype in DTYPES:
        x = (torch.randn(33, 2 * 1100, generator=generator) * 3).to(dtype)
        gate, up = x.chunk(2, dim=-1)  # two column blocks, the second masked
        full = silu_mul_triton(gate, up)
        assert full.dtype == dtype and full.shape == (33, 1100)
        # Against fp64 (bf16 rounds twice, silu then the product: up to two ulps apart). Why
        # not silu_mul_ref's fp32: once in many loaded CI runs one side came back with 4084
        # elements ~1e-4 off (10-bit-mantissa sized), never alone; the message says which.
        g64, up64 = gate.double(), up.double()
        want = g64 / (1.0 + torch.exp(-g64)) * up64
        tol = FP32_TOL if dtype == torch.float32 else BF16_NORM_TOL
        ref_err = (silu_mul_ref(gate, up).double() - want).abs().max().item()
        note = f"{dtype}: silu_mul_ref is {ref_err:.3g} from fp64"
        torch.testing.assert_close(
            full.double(), want, **tol, msg=lambda m, note=note: f"{m}\n{note}"
        )
        for m in NORM_ROWS:
            assert torch.equal(silu_mul_triton(gate[:m], up[:m]), full[:m]), (dtype, m)


def check_rope(generator: torch.Generator) -> None:
    """One launch per call, the reference's bits in fp32 (each product and sum rounded as
    torch's eager ops round it; bf16 bitwise in tests/test_gpu_kernels.py), on the strided
    q_pe view the model passes."""
    from moe_kernels.rope import rope_ref
    from moe_kernels.triton_rope import rope_triton

    cos, sin = torch.randn(50, 32, generator=generator), torch.randn(50, 32, generator=generator)
    positions = torch.tensor([0, 7, 49, 3, 3])
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(5, 16, 192, generator=generator).to(dtype)
        for x in (q[..., 128:], q[:, :1, 128:]):  # 16 heads, and one (the k_pe shape)
            for is_interleaved in (True, False):
                want = rope_ref(x, positions, cos, sin, is_interleaved)
                got = rope_triton(x, positions, cos, sin, is_interleaved)
                if dtype == torch.float32:
                    assert torch.equal(got, want), (x.shape, is_interleaved)
                else:  # the interpreter's bf16 casts don't round as the GPU's: bits on the GPU
                    torch.testing.assert_close(got, want, atol=0.2, rtol=0.05)


def check_expert_layout(generator: torch.Generator) -> None:
    """The dispatch layout in one launch: the stable sort's order, the counts, order // K and
    order's inverse, exactly (the torch composition the dispatchers ran before)."""
    from moe_kernels.triton_layout import expert_layout_triton

    cases = ((0, 6, 8), (1, 6, 64), (6, 1, 64), (13, 10, 8), (64, 6, 64), (70, 10, 256))
    for num_tokens, top_k, num_experts in cases:
        ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=generator)
        order, counts, token_of_row, row_of_slot = expert_layout_triton(ids, num_experts)
        want = torch.sort(ids.reshape(-1), stable=True).indices
        inverse = torch.empty_like(want)
        inverse[want] = torch.arange(want.numel())
        case = (num_tokens, top_k, num_experts)
        assert torch.equal(order, want), case
        assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=num_experts)), case
        assert torch.equal(token_of_row, want // top_k), case
        assert torch.equal(row_of_slot, inverse), case


def assert_rows_invariant(op, x: torch.Tensor, generator: torch.Generator, full=None) -> None:
    """op's rows (full: op(x), where computed already) bitwise the same in the first m rows of
    the batch, for every m of NORM_ROWS, and in a shuffled batch.
    test_the_row_check_catches_a_batch_dependent_row_op is its negative control."""
    full = op(x) if full is None else full
    for m in NORM_ROWS:
        assert torch.equal(op(x[:m]), full[:m]), m
    perm = torch.randperm(x.shape[0], generator=generator)
    assert torch.equal(op(x[perm]), full[perm])


def check_rms_norm(generator: torch.Generator) -> None:
    from moe_kernels.rmsnorm import rms_norm_ref
    from moe_kernels.triton_rmsnorm import rms_norm_triton

    for dtype in DTYPES:
        for dim in (96, 5000):  # one block, and two blocks of 4096 with a masked tail
            x = (torch.randn(33, dim, generator=generator) * 3).to(dtype)
            weight = (torch.rand(dim, generator=generator) + 0.5).to(dtype)
            full = rms_norm_triton(x, weight, EPS)
            expected = rms_norm_ref(x, weight, EPS, tile_rows=4)
            assert full.dtype == expected.dtype
            tol = FP32_TOL if dtype == torch.float32 else BF16_NORM_TOL
            torch.testing.assert_close(full, expected, **tol)
            norm = functools.partial(rms_norm_triton, weight=weight, eps=EPS)
            assert_rows_invariant(norm, x, generator, full)
    # Mixed dtypes follow torch promotion (bf16 activations, fp32 weight -> fp32).
    x = torch.randn(3, 96, generator=generator).to(torch.bfloat16)
    weight = torch.rand(96, generator=generator)
    assert rms_norm_triton(x, weight, EPS).dtype == torch.float32


def check_softmax(generator: torch.Generator) -> None:
    from moe_kernels.triton_softmax import PART_V, SPLIT_MIN_V, log_softmax_triton, softmax_triton

    for op, fp64_op in ((softmax_triton, torch.softmax), (log_softmax_triton, torch.log_softmax)):
        for dtype in DTYPES:
            for dim in (1003, 5000):
                x = (torch.randn(33, dim, generator=generator) * 4).to(dtype)
                full = op(x)
                assert full.dtype == torch.float32
                expected = fp64_op(x.double(), dim=-1).float()
                # fp32 exp/log and a V-term sum: a few fp32 ulps of the largest values.
                torch.testing.assert_close(full, expected, atol=1e-5, rtol=1e-5)
                assert_rows_invariant(op, x, generator, full)
        # -inf logits (masked vocab) give probability 0 / log-probability -inf, no NaN; in
        # the split launch whole parts are -inf.
        x = torch.randn(2, 300, generator=generator)
        x[:, 7:250] = float("-inf")
        torch.testing.assert_close(op(x), fp64_op(x.double(), dim=-1).float())
        wide = torch.randn(5, SPLIT_MIN_V + 3000, generator=generator) * 4
        full = op(wide)
        torch.testing.assert_close(
            full, fp64_op(wide.double(), dim=-1).float(), atol=1e-5, rtol=1e-5
        )
        assert torch.equal(op(wide[2:3]), full[2:3]) and torch.equal(op(wide[[4, 0]]), full[[4, 0]])
        wide[:, 9 : PART_V * 3 + 5] = float("-inf")
        torch.testing.assert_close(op(wide), fp64_op(wide.double(), dim=-1).float())


def _paged_cache(generator, seq_lens, num_heads, v_dim, rope_dim, block_size):
    """NaN-filled cache with the sequences written into shuffled blocks, one q per token."""
    cache_dim = v_dim + rope_dim
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    kv_cache = torch.full((num_blocks, block_size, cache_dim), float("nan"))
    block_tables = torch.full((len(seq_lens), max(seq_lens) // block_size + 2), -1)
    free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
    for seq_id, seq_len in enumerate(seq_lens):
        for j in range(-(-seq_len // block_size)):
            block_tables[seq_id, j] = free_blocks.pop()
        for pos in range(seq_len):
            block = block_tables[seq_id, pos // block_size]
            kv_cache[block, pos % block_size] = torch.randn(cache_dim, generator=generator)
    seq_ids = torch.cat([torch.full((n,), s) for s, n in enumerate(seq_lens)])
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    q = torch.randn(len(seq_ids), num_heads, cache_dim, generator=generator)
    return q, kv_cache, seq_ids, block_tables, positions


def check_mla_attention(generator: torch.Generator) -> None:
    from moe_kernels.attention import mla_attention_ref
    from moe_kernels.attention_launch import SPLIT_BLOCKS
    from moe_kernels.triton_attention import mla_attention_triton

    # 70 positions at block size 16 = 5 blocks: two KV splits of SPLIT_BLOCKS (4) blocks.
    assert SPLIT_BLOCKS == 4
    q, kv_cache, seq_ids, tables, positions = _paged_cache(generator, (40, 5, 70), 4, 32, 8, 16)
    args = dict(scale=40**-0.5, v_dim=32)
    for dtype in DTYPES:
        q_d, kv_d = q.to(dtype), kv_cache.to(dtype)
        full = mla_attention_triton(q_d, kv_d, seq_ids, tables, positions, **args)
        assert full.dtype == dtype and full.shape == (115, 4, 32)
        expected = mla_attention_ref(
            q_d.double(), kv_d.double(), seq_ids, tables, positions, **args, tile_rows=8
        )
        # fp32: exact products, online softmax; bf16: bf16 probabilities times bf16 values.
        tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
        torch.testing.assert_close(full.double(), expected, **tol)
        # Decode (one query), a chunk of a prompt, and a permuted batch: the same bits.
        for rows in ([114], [44, 45, 46], list(range(45, 115))):
            rows = torch.tensor(rows)
            got = mla_attention_triton(
                q_d[rows], kv_d, seq_ids[rows], tables, positions[rows], **args
            )
            assert torch.equal(got, full[rows]), (dtype, rows[:3])
        perm = torch.randperm(115, generator=generator)
        got = mla_attention_triton(q_d[perm], kv_d, seq_ids[perm], tables, positions[perm], **args)
        assert torch.equal(got, full[perm]), dtype
        # A table of SPLIT_BLOCKS columns: one split, the output written without a merge.
        narrow = tables[:, :SPLIT_BLOCKS].contiguous()
        got = mla_attention_triton(q_d[:45], kv_d, seq_ids[:45], narrow, positions[:45], **args)
        assert torch.equal(got, full[:45]), dtype
        assert mla_attention_triton(
            q_d[:0], kv_d, seq_ids[:0], tables, positions[:0], **args
        ).shape == (0, 4, 32)


def check_mla_attention_default_dtype(generator: torch.Generator) -> None:
    """The split partials are fp32 whatever torch's default dtype is: a caller with a bf16
    default gets the bits of one at torch's default (they were allocated in the default dtype:
    bf16 partials here, a merge kernel that failed to compile on the GPU)."""
    from moe_kernels.triton_attention import mla_attention_triton

    # 70 positions at block size 16: two KV splits, so the partials and the merge run.
    q, kv_cache, seq_ids, tables, positions = _paged_cache(generator, (70, 5), 4, 32, 8, 16)
    args = (q, kv_cache, seq_ids, tables, positions)
    expected = mla_attention_triton(*args, scale=40**-0.5, v_dim=32)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        got = mla_attention_triton(*args, scale=40**-0.5, v_dim=32)
    finally:
        torch.set_default_dtype(default)
    assert torch.equal(got, expected)


def check_mla_attention_whole_query(generator: torch.Generator) -> None:
    """A program a query (its splits folded in the program) gives the bits of the split
    launch and its merge kernel: queries at the first and last positions of one to three
    splits (blocks of 16, splits of 4), fp32 and bf16, a wide table with -1 padding; and
    so with a tail (the last split taking up to 2 blocks more: 5 blocks are one split, 9
    two). Controls: one split spanning the whole table (an online softmax that
    never restarts), and the splits without the tail, make other bits, so the comparisons
    see the split boundaries. The merge launch gives the same bits at any heads a program."""
    from moe_kernels.attention import mla_attention_ref
    from moe_kernels.attention_launch import SPLIT_BLOCKS
    from moe_kernels.triton_attention import _attend

    q, kv_cache, seq_ids, tables, positions = _paged_cache(generator, (140, 30), 4, 40, 8, 16)
    rows = torch.tensor([0, 15, 16, 63, 64, 65, 127, 128, 139, 150, 169])  # 0-139; 10, 29
    q, seq_ids, positions = q[rows], seq_ids[rows], positions[rows]
    wide = torch.full((tables.shape[0], 12), -1, dtype=tables.dtype)
    wide[:, : tables.shape[1]] = tables
    results = {}
    for dtype in DTYPES:
        for tail in (0, 2):
            args = (q.to(dtype), kv_cache.to(dtype), seq_ids, wide, positions, 40**-0.5, 32)
            split = _attend(*args, SPLIT_BLOCKS, 4, 3, tail_blocks=tail)
            whole = _attend(*args, SPLIT_BLOCKS, 4, 3, is_whole_query=True, tail_blocks=tail)
            assert torch.equal(whole, split), (dtype, tail)
            # The merge a program a head, and 8 a program (4 of them masked): the same bits.
            for per_program in (1, 8):
                merged = _attend(
                    *args, SPLIT_BLOCKS, 4, 3, tail_blocks=tail,
                    merge_heads_per_program=per_program,
                )  # fmt: skip
                assert torch.equal(merged, split), (dtype, tail, per_program)
            results[dtype, tail] = split
    # The controls in fp32 (bf16 outputs of these widths may round the difference away).
    args = (q, kv_cache, seq_ids, wide, positions, 40**-0.5, 32)
    unsplit = _attend(*args, wide.shape[1], 4, 3)
    assert not torch.equal(unsplit, results[torch.float32, 0]), "no control"
    split, tailed = results[torch.float32, 0], results[torch.float32, 2]
    # Rows 4-5 (5 blocks) and 7-8 (9 blocks) end in a tail: the others keep their bits, and
    # these may not (a tail split of one key below the running max folds to the same bits).
    same = [torch.equal(split[i], tailed[i]) for i in range(len(rows))]
    assert all(same[:4]) and same[6] and all(same[9:]), same
    assert not all(same[4:6] + same[7:9]), "the tail moved nothing"
    expected = mla_attention_ref(
        q.double(), kv_cache.double(), seq_ids, tables, positions, scale=40**-0.5, v_dim=32,
        tile_rows=8,
    )  # fmt: skip
    for tail in (0, 2):
        torch.testing.assert_close(results[torch.float32, tail].double(), expected, **FP32_TOL)


def check_mla_attention_groups(generator: torch.Generator) -> None:
    """A query's splits folded in groups, then the groups (group_splits): a program a query's
    group (the group folded in the program, the groups merged) gives the bits of the split
    launch whose merge folds the same two levels, at one to three groups (splits of 2 blocks
    of 16, groups of 2 splits: positions 0-169 are one to 11 blocks), fp32 and bf16, a wide
    table with -1 padding, and with a table one group wide (no merge launch). Control: the
    one-level order (group_splits 0) makes other bits where a query has two groups or more,
    and only there, so the comparisons see the groups."""
    from moe_kernels.attention import mla_attention_ref
    from moe_kernels.triton_attention import _attend

    q, kv_cache, seq_ids, tables, positions = _paged_cache(generator, (140, 30), 4, 40, 8, 16)
    rows = torch.tensor([0, 31, 32, 63, 64, 65, 127, 128, 139, 150, 169])
    q, seq_ids, positions = q[rows], seq_ids[rows], positions[rows]
    wide = torch.full((tables.shape[0], 12), -1, dtype=tables.dtype)
    wide[:, : tables.shape[1]] = tables
    results = {}
    for dtype in DTYPES:
        args = (q.to(dtype), kv_cache.to(dtype), seq_ids, wide, positions, 40**-0.5, 32, 2, 4, 3)
        for tail in (0, 2):  # the last group taking up to one more split
            split = _attend(*args, group_splits=2, group_tail=tail)
            for per_program in (1, 8):  # the two-level merge, a head or 8 (masked) a program
                merged = _attend(
                    *args, group_splits=2, group_tail=tail, merge_heads_per_program=per_program
                )  # fmt: skip
                assert torch.equal(merged, split), (dtype, tail, per_program)
            for stages in (2, 3):
                whole = _attend(
                    *args[:-1], stages, is_whole_query=True, group_splits=2, group_tail=tail
                )
                assert torch.equal(whole, split), (dtype, tail, stages)
            results[dtype, tail] = split
        # Queries of at most one group (4 blocks) with a table 4 blocks wide: written directly.
        short = positions < 64
        narrow = (wide[:, :4].contiguous(), positions[short])
        got = _attend(
            args[0][short], args[1], seq_ids[short], narrow[0], narrow[1], *args[5:],
            is_whole_query=True, group_splits=2,
        )  # fmt: skip
        assert torch.equal(got, results[dtype, 0][short]), dtype
    args = (q, kv_cache, seq_ids, wide, positions, 40**-0.5, 32, 2, 4, 3)
    one_level = _attend(*args)
    grouped = results[torch.float32, 0]
    same = [torch.equal(one_level[i], grouped[i]) for i in range(len(rows))]
    # Rows 0-4 are at most 4 blocks (one group); rows 5-10 have two or three groups.
    assert all(same[:5]), same
    assert not all(same[5:]), "the groups changed no bits"
    # With the tail a query's bits can move only where its last group of one or two blocks
    # joins the group before (5, 9 and 10 blocks here: rows 4, 5, 7, 8, 9), and do only from
    # a third group (9 blocks: (g1 g2) s becomes g1 (g2 s); with 5, (g1) s stays).
    tailed = results[torch.float32, 2]
    num_blocks = positions // 16 + 1
    in_tail = (num_blocks % 4 > 0) & (num_blocks % 4 <= 2) & (num_blocks > 4)
    moved = [not torch.equal(tailed[i], grouped[i]) for i in range(len(rows))]
    assert not any(m for m, t in zip(moved, in_tail.tolist(), strict=True) if not t), moved
    assert any(moved), "the group tail moved nothing"
    expected = mla_attention_ref(
        q.double(), kv_cache.double(), seq_ids, tables, positions, scale=40**-0.5, v_dim=32,
        tile_rows=8,
    )  # fmt: skip
    torch.testing.assert_close(grouped.double(), expected, **FP32_TOL)
    torch.testing.assert_close(tailed.double(), expected, **FP32_TOL)
    try:
        _attend(*args, group_splits=2, tail_blocks=1)
    except ValueError as e:
        assert "tail_blocks 1" in str(e), e
    else:
        raise AssertionError("no ValueError for group_splits with tail blocks")


def check_mla_attention_long_splits(generator: torch.Generator) -> None:
    """Long queries with longer splits (long_blocks: from 5 blocks of 16, splits of 4 blocks
    instead of 2; and with a split tail of 1 block, splits of 5 where the last takes up to one
    more, as the wide launch's): the split launch, its merge at a head or 8 a program, and a
    program a whole query (2 and 3 stages) give the same bits, fp32 and bf16, in a wide table
    with -1 padding; each query alone in a table as wide as its own blocks gives its bits in
    the batch (the launch's splits counted from any width). Controls: without long splits
    (long_blocks 0, the same tail) queries below 5 blocks keep their bits and some from 5
    blocks do not, so the comparisons see the longer splits; with the tail against without
    it, only long queries whose last long split took the tail move, and some do. Long splits
    with groups, or no longer than a split, are refused."""
    from moe_kernels.attention import mla_attention_ref
    from moe_kernels.triton_attention import _attend

    q, kv_cache, seq_ids, tables, positions = _paged_cache(generator, (140, 30), 4, 40, 8, 16)
    # Positions 0-139 of the first sequence (1 to 9 blocks), 10 and 29 of the second.
    rows = torch.tensor([0, 15, 16, 63, 64, 65, 80, 87, 95, 127, 128, 139, 150, 169])
    q, seq_ids, positions = q[rows], seq_ids[rows], positions[rows]
    wide = torch.full((tables.shape[0], 12), -1, dtype=tables.dtype)
    wide[:, : tables.shape[1]] = tables
    num_blocks = (positions // 16 + 1).tolist()
    is_long = [blocks >= 5 for blocks in num_blocks]
    expected = mla_attention_ref(
        q.double(), kv_cache.double(), seq_ids, tables, positions, scale=40**-0.5, v_dim=32,
        tile_rows=8,
    )  # fmt: skip
    for tail, long_split in ((0, 4), (1, 5)):
        long = dict(tail_blocks=tail, long_blocks=5, long_split_blocks=long_split)
        results = {}
        for dtype in DTYPES:
            args = (q.to(dtype), kv_cache.to(dtype), seq_ids, wide, positions, 40**-0.5, 32, 2, 4)
            split = _attend(*args, 3, **long)
            for per_program in (1, 8):
                merged = _attend(*args, 3, **long, merge_heads_per_program=per_program)
                assert torch.equal(merged, split), (tail, dtype, per_program)
            for stages in (2, 3):
                whole = _attend(*args, stages, is_whole_query=True, **long)
                assert torch.equal(whole, split), (tail, dtype, stages)
            for i, blocks in enumerate(num_blocks):
                own = wide[seq_ids[i], :blocks].unsqueeze(0).contiguous()
                alone = _attend(
                    args[0][i : i + 1], args[1], torch.zeros(1, dtype=seq_ids.dtype), own,
                    positions[i : i + 1], *args[5:], 3, **long,
                )  # fmt: skip
                assert torch.equal(alone[0], split[i]), (tail, dtype, i, blocks)
            results[dtype] = split
        args = (q, kv_cache, seq_ids, wide, positions, 40**-0.5, 32, 2, 4, 3)
        short = _attend(*args, tail_blocks=tail)
        same = [torch.equal(short[i], results[torch.float32][i]) for i in range(len(rows))]
        assert all(s for s, is_l in zip(same, is_long, strict=True) if not is_l), (tail, same)
        assert not all(s for s, is_l in zip(same, is_long, strict=True) if is_l), "no control"
        torch.testing.assert_close(results[torch.float32].double(), expected, **FP32_TOL)
        if tail:  # the tail's control: the same long splits without it
            untailed = _attend(*args, long_blocks=5, long_split_blocks=long_split)
            fp32 = results[torch.float32]
            moved = [not torch.equal(untailed[i], fp32[i]) for i in range(len(rows))]
            # A long query's last split took the tail where its blocks pass whole splits by 1.
            took = [b >= 5 and b > long_split and b % long_split == 1 for b in num_blocks]
            assert not any(m for m, t in zip(moved, took, strict=True) if not t), moved
            assert any(moved), "the tail of the long splits moved nothing"
    args = (q, kv_cache, seq_ids, wide, positions, 40**-0.5, 32, 2, 4, 3)
    for bad, message in (
        (dict(group_splits=2, long_split_blocks=4), "long_blocks 5 must be >= 0, and 0 with gr"),
        (dict(long_split_blocks=2), "long_split_blocks 2 must be above split_blocks 2"),
    ):  # fmt: skip
        try:
            _attend(*args, long_blocks=5, **bad)
        except ValueError as e:
            assert message in str(e), e
        else:
            raise AssertionError(f"no ValueError for long_blocks with {bad}")


def check_mla_attention_wide_launch(generator: torch.Generator) -> None:
    """A model of 64 heads takes the wide launch (64 heads a program, WIDE_LAUNCH's split and
    tail: with 2 tail blocks the second sequence's 17 and 18 blocks of 16 are one split, its
    19 to 22 two, so the merge runs); a TP rank holding 16 or 32 of them keeps it
    (whole_heads) and gives the heads' bits of the whole model's call; the launches differ
    (engagement: the wide one ran), and without the tail only queries whose tail it absorbed
    move (and some do: it ran too)."""
    import moe_kernels.triton_attention as attention
    from moe_kernels.attention import mla_attention_ref
    from moe_kernels.attention_launch import NARROW_LAUNCH, WIDE_LAUNCH

    assert attention.head_launch(64) == WIDE_LAUNCH
    assert attention.head_launch(16) == NARROW_LAUNCH
    wide = WIDE_LAUNCH
    assert wide.split_blocks + wide.tail_blocks < 21 <= 2 * wide.split_blocks
    q, kv_cache, seq_ids, tables, positions = _paged_cache(generator, (40, 340), 64, 48, 8, 16)
    args = dict(scale=56**-0.5, v_dim=48)
    launches = []
    attend = attention._attend

    def recorded(*call, **kwargs):
        # split_blocks, num_warps, num_stages, tail_blocks
        launches.append((*call[7:10], kwargs.get("tail_blocks")))
        return attend(*call, **kwargs)

    attention._attend = recorded
    try:
        full = attention.mla_attention_triton(q, kv_cache, seq_ids, tables, positions, **args)
        for heads in (slice(0, 16), slice(16, 48), slice(48, 64)):
            got = attention.mla_attention_triton(
                q[:, heads], kv_cache, seq_ids, tables, positions, **args, whole_heads=64
            )
            assert torch.equal(got, full[:, heads]), heads
        narrow = attention.mla_attention_triton(
            q[:, :16], kv_cache, seq_ids, tables, positions, **args
        )
    finally:
        attention._attend = attend
    assert launches[0] == (
        wide.split_blocks, wide.num_warps, wide.num_stages, wide.tail_blocks
    ), launches  # fmt: skip
    assert launches[-1][0] == NARROW_LAUNCH.split_blocks != wide.split_blocks, launches
    expected = mla_attention_ref(q, kv_cache, seq_ids, tables, positions, **args, tile_rows=8)
    torch.testing.assert_close(full, expected, **FP32_TOL)
    torch.testing.assert_close(narrow, full[:, :16], **FP32_TOL)
    late = positions >= 12 * 16  # (the second sequence's queries from block 13 on)
    no_tail = attend(
        q[late], kv_cache, seq_ids[late], tables, positions[late], 56**-0.5, 48,
        wide.split_blocks, wide.num_warps, wide.num_stages, wide.block_h,
    )  # fmt: skip
    moved = (no_tail != full[late]).flatten(1).any(1)
    num_blocks = positions[late] // 16 + 1
    last_whole = wide.split_blocks
    in_tail = (num_blocks > last_whole) & (num_blocks <= last_whole + wide.tail_blocks)
    assert not moved[~in_tail].any(), "queries past the tail's reach moved"
    assert moved[in_tail].any(), "the tail moved nothing"
    try:
        attention.mla_attention_triton(
            q, kv_cache, seq_ids, tables, positions, **args, whole_heads=16
        )
    except ValueError as exc:
        assert "whole_heads 16" in str(exc)
    else:
        raise AssertionError("whole_heads below q's heads was accepted")


def check_mla_attention_wide_long_splits(generator: torch.Generator) -> None:
    """The wide launch (64 heads a program, WIDE_LAUNCH's split of 16 blocks and tail of 2)
    with long splits through the op's arguments (kernels.attention_long_blocks and
    attention_long_split_blocks): from 19 blocks of 16, splits of 20, so queries of 19 to 22
    blocks are one split where the launch alone gives them two. Each query alone in a table of
    its own blocks, and a TP rank's 16 or 48 heads (whole_heads 64), give the batch's bits;
    control: without long splits (long_blocks 0) queries below 19 blocks keep their bits and
    some from 19 do not."""
    from moe_kernels.attention import mla_attention_ref
    from moe_kernels.attention_launch import WIDE_LAUNCH
    from moe_kernels.triton_attention import mla_attention_triton

    q, kv_cache, seq_ids, tables, positions = _paged_cache(generator, (40, 352), 64, 48, 8, 16)
    rows = torch.tensor([3, 39, 40 + 200, 40 + 287, 40 + 288, 40 + 300, 40 + 320, 40 + 351])
    q, seq_ids, positions = q[rows], seq_ids[rows], positions[rows]
    num_blocks = (positions // 16 + 1).tolist()  # 1, 3, 13, 18, 19, 19, 21, 22
    assert WIDE_LAUNCH.split_blocks == 16 and WIDE_LAUNCH.tail_blocks == 2
    args = dict(scale=56**-0.5, v_dim=48)
    long = dict(long_blocks=19, long_split_blocks=20)
    full = mla_attention_triton(q, kv_cache, seq_ids, tables, positions, **args, **long)
    for heads in (slice(0, 16), slice(16, 64)):
        got = mla_attention_triton(
            q[:, heads], kv_cache, seq_ids, tables, positions, **args, whole_heads=64, **long
        )  # fmt: skip
        assert torch.equal(got, full[:, heads]), heads
    for i, blocks in enumerate(num_blocks):
        own = tables[seq_ids[i], :blocks].unsqueeze(0).contiguous()
        alone = mla_attention_triton(
            q[i : i + 1], kv_cache, torch.zeros(1, dtype=seq_ids.dtype), own,
            positions[i : i + 1], **args, **long,
        )  # fmt: skip
        assert torch.equal(alone[0], full[i]), (i, blocks)
    short = mla_attention_triton(q, kv_cache, seq_ids, tables, positions, **args, long_blocks=0)
    same = [torch.equal(short[i], full[i]) for i in range(len(rows))]
    is_long = [blocks >= 19 for blocks in num_blocks]
    assert all(s for s, is_l in zip(same, is_long, strict=True) if not is_l), same
    assert not all(s for s, is_l in zip(same, is_long, strict=True) if is_l), "no control"
    expected = mla_attention_ref(q, kv_cache, seq_ids, tables, positions, **args, tile_rows=8)
    torch.testing.assert_close(full, expected, **FP32_TOL)


def check_router_logits(generator: torch.Generator) -> None:
    """bf16 x against the fp32 router weight, upcast in registers: the bits of the fp32 linear
    of x.float() (the copy launch it replaces), on both sides of the row buckets and of the
    folded launch (K 2048: sixteen chunks of 128 in the binary tree); the subtrees a program
    sums at prefill sizes give the same bits, and chunk order does not (the control)."""
    from moe_kernels.router import router_logits_ref
    from moe_kernels.triton_linear import linear_triton
    from moe_kernels.triton_linear_config import k_split_chunk, k_split_count, linear_config
    from moe_kernels.triton_router import router_logits_triton
    from moe_kernels.triton_split_k import launch_split_k

    x = torch.randn(70, 2048, generator=generator).to(torch.bfloat16)
    w = torch.randn(64, 2048, generator=generator) / 2048**0.5
    for m in (1, 16, 17, 64, 65, 70):
        got = router_logits_triton(x[:m], w)
        assert got.dtype == torch.float32
        assert torch.equal(got, linear_triton(x[:m].float(), w)), m
    torch.testing.assert_close(got, router_logits_ref(x, w, tile_rows=8), **FP32_TOL)
    assert k_split_count(64, 2048, w.dtype) == 16 and k_split_chunk(2048, 16) == 128
    config = linear_config(64, 2048, w.dtype, 70)
    for per_program in (2, 4, 16):
        subtrees = launch_split_k(
            x, w, torch.empty(70, 64), 128, config, is_tree=True, chunks_per_program=per_program
        )
        assert torch.equal(subtrees, got), per_program
    in_order = launch_split_k(x, w, torch.empty(70, 64), 128, config, is_tree=False)
    assert not torch.equal(in_order, got)  # the adds' order reaches the bits


def check_router_topk(generator: torch.Generator) -> None:
    from moe_kernels.router import router_topk_ref
    from moe_kernels.triton_router import router_topk_triton
    from tests.test_kernels_router import METHODS, NUM_EXPERTS

    for method, params in METHODS.items():
        logits = torch.randn(37, NUM_EXPERTS, generator=generator) * 2
        bias = torch.rand(NUM_EXPERTS, generator=generator) * 0.1
        bias = bias if method == "noaux_tc" else None
        ids, weights = router_topk_triton(logits, bias, **params)
        ref_ids, ref_weights = router_topk_ref(logits, bias, **params, tile_rows=4)
        assert torch.equal(ids, ref_ids), method
        # fp32 exp, one division or a sum of <= E terms in another order: a few fp32 ulps.
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)
        for m in NORM_ROWS:
            sub_ids, sub_weights = router_topk_triton(logits[:m], bias, **params)
            assert torch.equal(sub_ids, ids[:m]) and torch.equal(sub_weights, weights[:m])
        perm = torch.randperm(37, generator=generator)
        perm_ids, perm_weights = router_topk_triton(logits[perm], bias, **params)
        assert torch.equal(perm_ids, ids[perm]) and torch.equal(perm_weights, weights[perm])
        # Ties: lower group and lower expert ids win, as in the reference.
        tied = torch.full((2, NUM_EXPERTS), -3.0)
        tied[:, 6:12] = tied[:, 18:24] = torch.tensor([0.5, 2.0, 1.0, 2.0, 2.0, -1.0])
        zero_bias = None if bias is None else torch.zeros(NUM_EXPERTS)
        tied_ids, _ = router_topk_triton(tied, zero_bias, **params)
        assert torch.equal(tied_ids, router_topk_ref(tied, zero_bias, **params, tile_rows=4)[0])
        # The id map (logical -> physical slot, replicas included) is gathered in the launch.
        id_map = torch.randperm(NUM_EXPERTS + 8, generator=generator)[:NUM_EXPERTS]
        map_ids, map_weights, slot_ids = router_topk_triton(logits, bias, **params, id_map=id_map)
        assert torch.equal(map_ids, ids) and torch.equal(map_weights, weights), method
        assert torch.equal(slot_ids, id_map[ids]), method
        for m in (0, 1, 7):
            assert torch.equal(
                router_topk_triton(logits[:m], bias, **params, id_map=id_map)[2], slot_ids[:m]
            )


def check_bad_inputs(generator: torch.Generator) -> None:
    from moe_kernels.triton_attention import mla_attention_triton
    from moe_kernels.triton_combine import moe_combine_output_triton, moe_combine_triton
    from moe_kernels.triton_grouped_linear import grouped_gated_linear_triton, grouped_linear_triton
    from moe_kernels.triton_layout import expert_layout_triton
    from moe_kernels.triton_linear import linear_triton
    from moe_kernels.triton_moe_output import moe_output_triton
    from moe_kernels.triton_rmsnorm import rms_norm_triton
    from moe_kernels.triton_router import router_topk_triton
    from moe_kernels.triton_softmax import log_softmax_triton

    q, kv = torch.randn(2, 4, 24, generator=generator), torch.randn(3, 16, 24, generator=generator)
    ids = torch.zeros(2, dtype=torch.int64)
    from tests.test_kernels_router import V2_GREEDY

    route = {**V2_GREEDY, "top_k": 2}
    x, w = torch.randn(4, 8, generator=generator), torch.randn(6, 8, generator=generator)
    cases = [
        (lambda: linear_triton(x.long(), w), "torch.int64"),
        (lambda: linear_triton(x, w.double()), "torch.float64"),
        (lambda: linear_triton(x, w[:, :7]), "7"),
        (lambda: linear_triton(x[0], w), r"\(8,\)"),
        (lambda: grouped_linear_triton(x, w[None], [3]), "group_sizes"),
        (lambda: rms_norm_triton(x, torch.ones(9), EPS), r"\(9,\)"),
        (lambda: log_softmax_triton(x.half().long()), "torch.int64"),
        (
            lambda: mla_attention_triton(q, kv.half(), ids, ids[None], ids, scale=1.0, v_dim=16),
            "dtype",
        ),
        (
            lambda: mla_attention_triton(q[0], kv, ids, ids[None], ids, scale=1.0, v_dim=16),
            r"\[T, H, C\]",
        ),
        (lambda: mla_attention_triton(q, kv, ids, ids[None], ids, scale=1.0, v_dim=25), "v_dim"),
        (lambda: router_topk_triton(x.half(), None, **route), "fp32"),
        (lambda: router_topk_triton(x, torch.zeros(7), **route), "bias"),
        (lambda: router_topk_triton(x, None, **route, id_map=torch.arange(3)), "id_map"),
        (lambda: expert_layout_triton(ids, 8), r"\[T, K\] int64"),
        (lambda: moe_output_triton(x[:3], None, x), r"routed must be \(4, 8\)"),
        (lambda: moe_output_triton(x, x.half(), x), "shared must be torch.float32"),
        (lambda: moe_output_triton(x.half(), None, x.bfloat16()), "torch.float16"),
        (lambda: moe_combine_triton(x, ids, w[:2, :3], ids), r"row_of_slot must be \[6\]"),
        (
            lambda: moe_combine_output_triton(x, ids, w[:3, :2], None, x),
            r"residual must be \[3, 8\]",
        ),
        (lambda: moe_combine_output_triton(x, ids, w[:4, :2], x.half(), x), "shared must be"),
        (lambda: grouped_linear_triton(x, w[None, :, :8], [2], row_index=ids.int()), "row_index"),
        (lambda: grouped_gated_linear_triton(x, w[None, :5], [4]), r"\[L, 2I, IN\]"),
    ]
    for call, pattern in cases:
        try:
            call()
        except ValueError as err:
            assert re.search(pattern, str(err)), (pattern, str(err))
        else:
            raise AssertionError(f"no ValueError for {pattern}")


def check_gumbel_noise(generator: torch.Generator) -> None:
    """The Triton noise kernel (CUDA's form) gives the torch form's bits for rows of seeds and
    positions at the ends of their ranges, at a vocabulary off the kernel's block, a row alone
    the same as among others; the interpreter's fp64 logs are numpy's, as the CPU form's are
    libm's (on the GPU libdevice's: within an fp32 ulp, tests/test_sampler.py)."""
    from moe_kernels.triton_noise import NOISE_BLOCK, gumbel_noise_triton
    from moe_runtime.worker import sampler

    cpu, vocab = torch.device("cpu"), NOISE_BLOCK + 37
    seeds = [0, 123456789, (1 << 63) - 1] + torch.randint(
        1 << 62, (3,), generator=generator
    ).tolist()
    positions = [0, 5, 1000, 1, 2, 3]
    keys = sampler._mix(
        sampler.host_to_device(seeds, cpu)
        + sampler._GOLDEN * (sampler.host_to_device(positions, cpu) + 1)
    )
    got = gumbel_noise_triton(keys, vocab, sampler.NOISE_BITS)
    assert torch.equal(got, sampler.gumbel_noise(seeds, positions, vocab, cpu))
    assert torch.equal(gumbel_noise_triton(keys[2:3], vocab, sampler.NOISE_BITS)[0], got[2])


CHECKS = {
    "gumbel_noise": check_gumbel_noise,
    "linear": check_linear,
    "linear_k_split": check_linear_k_split,
    "grouped_linear": check_grouped_linear,
    "grouped_linear_device_counts": check_grouped_linear_device_counts,
    "grouped_linear_gather": check_grouped_linear_gather,
    "grouped_gated_linear": check_grouped_gated_linear,
    "grouped_linear_tma": check_grouped_linear_tma,
    "linear_chain_tma": check_linear_chain_tma,
    "batched_linear_tma": check_batched_linear_tma,
    "batched_linear": check_batched_linear,
    "moe_combine": check_moe_combine,
    "moe_combine_output": check_moe_combine_output,
    "moe_output": check_moe_output,
    "silu_mul": check_silu_mul,
    "rope": check_rope,
    "expert_layout": check_expert_layout,
    "rms_norm": check_rms_norm,
    "softmax": check_softmax,
    "mla_attention": check_mla_attention,
    "mla_attention_wide_launch": check_mla_attention_wide_launch,
    "mla_attention_whole_query": check_mla_attention_whole_query,
    "mla_attention_groups": check_mla_attention_groups,
    "mla_attention_long_splits": check_mla_attention_long_splits,
    "mla_attention_wide_long_splits": check_mla_attention_wide_long_splits,
    "mla_attention_default_dtype": check_mla_attention_default_dtype,
    "router_logits": check_router_logits,
    "router_topk": check_router_topk,
    "bad_inputs": check_bad_inputs,
}


@pytest.fixture(scope="module")
def interpreted_results() -> dict:
    return interpreted.interpreted_results("tests.test_triton_kernels", SEED)


@pytest.mark.parametrize("name", list(CHECKS))
def test_triton_kernel_interpreted(interpreted_results, name):
    assert interpreted_results[name] == "", interpreted_results[name]


def test_the_noise_kernel_compiles_for_sm90_with_unsigned_shifts_and_fp64_logs():
    """The sampler's CUDA noise kernel (checked above under the interpreter, whose numpy
    integers wrap and shift as the hash wants) compiles for sm_90 from this machine's Triton
    as the hash wants it too: logical shifts of unsigned 64-bit ints (an arithmetic shift
    would smear the sign bit into the draw), the draw converted from unsigned to fp64, and
    libdevice's fp64 log."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moe_kernels.triton_noise import NOISE_BLOCK, _gumbel_noise_kernel
    from moe_runtime.worker.sampler import NOISE_BITS

    signature = {"keys_ptr": "*i64", "out_ptr": "*fp32", "vocab_size": "i32"}
    consts = {"NOISE_BITS": NOISE_BITS, "BLOCK": NOISE_BLOCK}
    source = ASTSource(
        _gumbel_noise_kernel, {**signature, **dict.fromkeys(consts, "constexpr")}, consts, {}
    )
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={}).asm["ptx"]
    assert "shr.u64" in ptx and "shr.s64" not in ptx
    assert "cvt.rn.f64.u64" in ptx and "__nv_log" in ptx and "cvt.rn.f32.f64" in ptx


def test_the_row_check_catches_a_batch_dependent_row_op(generator):
    """The negative control of the row-invariance check the interpreted rms_norm and softmax
    checks run: a softmax whose row sum is split at a column that follows the batch size."""

    def split_sum_softmax(x: torch.Tensor) -> torch.Tensor:
        e = x.float().exp()
        split = 1 + x.shape[0] % (x.shape[1] - 1)
        return e / (e[:, :split].sum(-1, keepdim=True) + e[:, split:].sum(-1, keepdim=True))

    x = torch.randn(33, 1003, generator=generator) * 4
    with pytest.raises(AssertionError):
        assert_rows_invariant(split_sum_softmax, x, generator)


def test_compiled_wrappers_refuse_cpu_and_bad_inputs(generator):
    # In this process the kernels are compiled (no interpreter), so CPU tensors are refused.
    from moe_kernels.triton_grouped_linear import grouped_linear_triton
    from moe_kernels.triton_linear import linear_triton
    from moe_kernels.triton_moe_output import moe_output_triton
    from moe_kernels.triton_rmsnorm import rms_norm_triton
    from moe_kernels.triton_softmax import softmax_triton

    x, w = torch.randn(4, 8, generator=generator), torch.randn(6, 8, generator=generator)
    with pytest.raises(ValueError, match="cpu"):
        linear_triton(x, w)
    with pytest.raises(ValueError, match="cpu"):
        rms_norm_triton(x, torch.ones(8), EPS)
    with pytest.raises(ValueError, match="cpu"):
        softmax_triton(x)
    with pytest.raises(ValueError, match="cpu"):
        moe_output_triton(x, None, x)
    meta_x, meta_w = x.to("meta"), w.to("meta")
    with pytest.raises(ValueError, match="meta"):
        grouped_linear_triton(meta_x, meta_w[None], [4])


def test_every_linear_config_keeps_its_dtypes_one_k_step():
    """The tile configs move work between programs only: every row bucket of every weight
    shape, the chunk launches and the in-program tree take the dtype's one BLOCK_K, so each
    output element is the same chain of K steps at any row count (bits: the GPU tests)."""
    from moe_kernels.triton_chunk_tree import CHAIN_CONFIG_16BIT, TREE_CONFIG
    from moe_kernels.triton_linear_config import (
        POINTER_CONFIG_16BIT,
        batched_config,
        block_k_of,
        linear_config,
    )
    from moe_kernels.triton_tp_linear import chunk_launch

    rows = (1, 16, 17, 64, 65, 128, 129, 256, 512, 513, 1023, 1024, 4096, 16384)
    shapes = (
        (64, 2048), (256, 7168), (576, 2048), (2048, 2048), (2048, 10944), (102400, 2048),
        (2048, 16384), (512, 128), (128, 512),
    )  # fmt: skip
    tiles = set()
    for dtype in (torch.float32, torch.bfloat16):
        for out_dim, in_dim in shapes:
            for m in rows:
                assert linear_config(out_dim, in_dim, dtype, m).block_k == block_k_of(dtype)
                assert chunk_launch(out_dim, in_dim, dtype, m)[0].block_k == block_k_of(dtype)
                for batch in (1, 16, 128):
                    config = batched_config(out_dim, in_dim, dtype, m, batch)
                    assert config.block_k == block_k_of(dtype)
                    tiles.add((config.block_m, config.block_n))
    assert {(64, 64), (128, 128)} <= tiles  # engagement: the batched tiles were taken
    configs = (CHAIN_CONFIG_16BIT, TREE_CONFIG, POINTER_CONFIG_16BIT)
    assert {c.block_k for c in configs} == {block_k_of(torch.bfloat16)}


def _sm90_ptx(kernel, signature: dict, consts: dict, **options) -> str:
    """kernel's PTX for sm_90 from this machine's Triton, debug lines left out."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(kernel, {**signature, **dict.fromkeys(consts, "constexpr")}, consts, {})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    return "\n".join(line for line in ptx.splitlines() if not re.match(r"\s*(\.loc|//)", line))


def test_the_attention_kernels_with_long_splits_compile_for_sm90():
    """The 16-head attention's split kernel (split launch and a program a whole query) and its
    merge compile for sm_90 with long splits (LONG_BLOCKS 64, checked above under the
    interpreter), and to other code than without them, so the switch reaches the kernels."""
    from moe_kernels.triton_attention import _mla_merge_kernel, _mla_split_kernel

    signature = dict.fromkeys(("q_ptr", "kv_ptr"), "*bf16") | {
        **dict.fromkeys(("seq_ids_ptr", "tables_ptr", "positions_ptr"), "*i64"),
        **dict.fromkeys(("acc_ptr", "stats_ptr"), "*fp32"),
        "scale": "fp32",
        **dict.fromkeys(("num_heads", "num_splits", "table_width"), "i32"),
    }
    launch = dict(
        C=576, V=512, BS=64, BLOCK_S=64, BLOCK_H=16, BLOCK_V=512, BLOCK_R=64, SPLIT_BLOCKS=4,
        TAIL_BLOCKS=0, INPUT_PRECISION="tf32", UPCAST_DOT=False, V_PARTS=1, LAT_CHUNK=512,
        TABLE_AHEAD=True, GROUP_BLOCKS=0, GROUP_TAIL=0, PDL=False,
    )  # fmt: skip
    short_splits = {"LONG_BLOCKS": 0, "LONG_SPLIT_BLOCKS": 0}
    long_splits = {"LONG_BLOCKS": 64, "LONG_SPLIT_BLOCKS": 8}
    for whole in (False, True):
        consts = {**launch, "WRITE_OUT": whole, "WHOLE_QUERY": whole}
        ptx = [
            _sm90_ptx(_mla_split_kernel, signature, {**consts, **long}, num_warps=4)
            for long in (short_splits, long_splits)
        ]
        assert ".visible .entry" in ptx[1] and ptx[0] != ptx[1], whole
    merge_signature = {
        **dict.fromkeys(("acc_ptr", "stats_ptr"), "*fp32"),
        "positions_ptr": "*i64",
        "out_ptr": "*bf16",
        **dict.fromkeys(("num_heads", "num_splits"), "i32"),
    }
    merge = dict(
        V=512, BS=64, BLOCK_V=512, SPLIT_BLOCKS=4, TAIL_BLOCKS=0, GROUP_SLOTS=0, GROUP_TAIL=0,
        ONE_SPLIT_WRITTEN=False, MERGE_HEADS=1, PDL=False,
    )  # fmt: skip
    ptx = [
        _sm90_ptx(_mla_merge_kernel, merge_signature, {**merge, **long}, num_warps=4)
        for long in (short_splits, long_splits)
    ]
    assert ".visible .entry" in ptx[1] and ptx[0] != ptx[1]
