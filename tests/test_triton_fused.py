"""Fused Triton kernels on CPU under TRITON_INTERPRET=1: each one's bits equal the composition
of the unfused Triton kernels it replaces, on DeepSeek-V2-Lite and tiny-model shapes; its
wrapper's input checks. (The same comparison on CUDA: tests/test_gpu_kernels.py.)

Checks run in one fresh interpreter process (tests/interpreted.py), as in
tests/test_triton_kernels.py, and each test asserts on its own check's outcome.
"""

from __future__ import annotations

import itertools
import re
from functools import partial

import pytest
import torch

from tests import interpreted

SEED = 0
EPS = 1e-6
# (kv_lora_rank, rope_dim, cache block size): DeepSeek-V2-Lite, and launch/configs/tiny_cpu.yaml.
LATENT_SHAPES = ((512, 64, 64), (32, 8, 16))
ROW_COUNTS = (1, 7, 64)


def assert_each_refused(cases) -> None:
    """cases: (call, regex) pairs; each call must raise a ValueError whose text matches."""
    for fn, pattern in cases:
        try:
            fn()
        except ValueError as err:
            assert re.search(pattern, str(err)), (pattern, str(err))
        else:
            raise AssertionError(f"no ValueError for {pattern}")


def latent_inputs(generator, num_rows, lora, rope_dim, block_size, dtype, device="cpu"):
    """kv_a [T, C] as a strided view (the kv_a projection's column split), weight, eps,
    positions, tables, a NaN-filled cache, and T distinct slots in a shuffled order (most of
    them in the middle of a block) of a cache of about twice T slots."""
    cache_dim, num_blocks = lora + rope_dim, 2 + 2 * num_rows // block_size
    kv_a = (torch.randn(num_rows, cache_dim + 16, generator=generator) * 3)[:, :cache_dim]
    weight = torch.rand(lora, generator=generator) + 0.5
    cos = torch.randn(4096, rope_dim // 2, generator=generator)
    sin = torch.randn(4096, rope_dim // 2, generator=generator)
    positions = torch.randint(0, 4096, (num_rows,), generator=generator)
    cache = torch.full((num_blocks, block_size, cache_dim), float("nan"))
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_rows]
    return (
        kv_a.to(device, dtype),
        weight.to(device, dtype),
        EPS,
        positions.to(device),
        cos.to(device),
        sin.to(device),
        cache.to(device, dtype),
        slots.to(device),
    )


def assert_latent_cache_fused_equals_unfused(
    generator, device="cpu", row_counts=ROW_COUNTS
) -> None:
    """write_latent_cache_triton == the composition with rms_norm_triton and rope_triton,
    bitwise, and no other cache row written (also run on CUDA by tests/test_gpu_kernels.py)."""
    from moe_kernels.latent_cache import write_latent_cache_composed
    from moe_kernels.triton_latent_cache import write_latent_cache_triton
    from moe_kernels.triton_rmsnorm import rms_norm_triton
    from moe_kernels.triton_rope import rope_triton

    for lora, rope_dim, block_size in LATENT_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for num_rows in row_counts:
                kv_a, weight, eps, positions, cos, sin, cache, slots = latent_inputs(
                    generator, num_rows, lora, rope_dim, block_size, dtype, device
                )
                for is_interleaved in (True, False):
                    args = (kv_a, weight, eps, positions, cos, sin, is_interleaved)
                    fused, unfused = cache.clone(), cache.clone()
                    write_latent_cache_triton(*args, fused, slots)
                    write_latent_cache_composed(
                        *args, unfused, slots, rms_norm=rms_norm_triton, rope=rope_triton
                    )
                    case = (lora, dtype, num_rows, is_interleaved)
                    assert torch.equal(fused.isnan(), unfused.isnan()), case
                    written = fused.view(-1, lora + rope_dim)[slots]
                    assert not written.isnan().any(), case
                    assert torch.equal(written, unfused.view(-1, lora + rope_dim)[slots]), case


def check_latent_cache_fused_equals_unfused(generator: torch.Generator) -> None:
    assert_latent_cache_fused_equals_unfused(generator)


def check_latent_cache_close_to_reference(generator: torch.Generator) -> None:
    """fp32: the CPU reference's rope bits exactly, its norm within a few ulps."""
    from moe_kernels.latent_cache import write_latent_cache_ref
    from moe_kernels.triton_latent_cache import write_latent_cache_triton

    kv_a, weight, eps, positions, cos, sin, cache, slots = latent_inputs(
        generator, 7, 512, 64, 64, torch.float32
    )
    fused, ref = cache.clone(), cache.clone()
    write_latent_cache_triton(kv_a, weight, eps, positions, cos, sin, True, fused, slots)
    write_latent_cache_ref(kv_a, weight, eps, positions, cos, sin, True, ref, slots, tile_rows=4)
    got, want = fused.view(-1, 576)[slots], ref.view(-1, 576)[slots]
    assert torch.equal(got[:, 512:], want[:, 512:])
    torch.testing.assert_close(got[:, :512], want[:, :512], atol=1e-5, rtol=1e-5)


def check_latent_cache_bad_inputs(generator: torch.Generator) -> None:
    from moe_kernels.triton_latent_cache import write_latent_cache_triton

    kv_a, weight, eps, positions, cos, sin, cache, slots = latent_inputs(
        generator, 3, 32, 8, 16, torch.float32
    )

    def call(**changes):
        args = dict(
            kv_a=kv_a,
            norm_weight=weight,
            eps=eps,
            positions=positions,
            cos_table=cos,
            sin_table=sin,
            is_interleaved=True,
            kv_cache=cache,
            slot_mapping=slots,
        )
        return lambda: write_latent_cache_triton(**(args | changes))

    cases = [
        (call(kv_a=kv_a[:, :39]), r"kv_a \(3, 39\)"),
        (call(kv_a=kv_a[0]), r"kv_a \(40,\)"),
        (call(norm_weight=weight[:31]), r"norm_weight \(31,\)"),
        (call(kv_cache=cache[0]), r"kv_cache \(16, 40\)"),
        (call(positions=positions[:2]), r"positions \(2,\)"),
        (call(slot_mapping=slots[:2]), r"slot_mapping \(2,\)"),
        (call(slot_mapping=slots.int()), "slot_mapping must be int64"),
        (call(positions=positions.int()), "positions must be int64"),
        (call(cos_table=cos[:, :3]), r"cos_table must be fp32 \[S, 4\]"),
        (call(sin_table=sin.double()), "sin_table must be fp32"),
        (call(kv_cache=cache.bfloat16()), "one dtype"),
        (call(norm_weight=weight.double()), "one dtype"),
        (call(kv_a=kv_a.long(), norm_weight=weight.long(), kv_cache=cache.long()), "one dtype"),
        (call(kv_a=kv_a.t().contiguous().t()), "unit column stride"),
        (call(kv_cache=cache.transpose(0, 1)), "contiguous"),
        (call(slot_mapping=slots.to("meta")), "slot_mapping is on meta"),
        (call(kv_a=kv_a.to("meta")), "device of type"),
    ]
    assert_each_refused(cases)


# Query heads riding along with the cache write: V2-Lite's 16, and an odd count (BLOCK_H 4
# masks one head). NOPE_DIM precedes q_pe in each head's q row, so q_pe is a strided view.
QUERY_HEAD_COUNTS = (16, 3)
NOPE_DIM = 16


def query_rope_inputs(generator, num_rows, num_heads, lora, rope_dim, dtype, device="cpu"):
    """q_pe as MLA views it (q [T, H, nope + R] split) and the NaN-filled query buffer
    [T, H, lora + R] whose last R channels are q_rot."""
    q = torch.randn(num_rows, num_heads, NOPE_DIM + rope_dim, generator=generator)
    q_pe = q.to(device, dtype).split([NOPE_DIM, rope_dim], dim=-1)[1]
    query = torch.full((num_rows, num_heads, lora + rope_dim), float("nan"))
    return q_pe, query.to(device, dtype)


def assert_query_rope_rides_along(
    generator, write, rope, device="cpu", row_counts=ROW_COUNTS, dtypes=(torch.float32,)
) -> None:
    """write(..., q_pe=, q_rot=) == write(...) then rope(q_pe, ...) on its own: the cache and
    q_rot bitwise, q_rot a slice of the query buffer whose other channels stay untouched (also
    run on CUDA by tests/test_gpu_kernels.py)."""
    for lora, rope_dim, block_size in LATENT_SHAPES:
        for dtype in dtypes:
            for num_rows in row_counts:
                kv_a, weight, eps, positions, cos, sin, cache, slots = latent_inputs(
                    generator, num_rows, lora, rope_dim, block_size, dtype, device
                )
                for num_heads, is_interleaved in itertools.product(
                    QUERY_HEAD_COUNTS, (True, False)
                ):
                    q_pe, query = query_rope_inputs(
                        generator, num_rows, num_heads, lora, rope_dim, dtype, device
                    )
                    q_rot = query[..., lora:]
                    args = (kv_a, weight, eps, positions, cos, sin, is_interleaved)
                    fused, unfused = cache.clone(), cache.clone()
                    write(*args, fused, slots, q_pe=q_pe, q_rot=q_rot)
                    write(*args, unfused, slots)
                    want = rope(q_pe, positions, cos, sin, is_interleaved)
                    case = (lora, dtype, num_rows, num_heads, is_interleaved)
                    assert not q_rot.isnan().any(), case
                    assert torch.equal(q_rot, want), case
                    assert query[..., :lora].isnan().all(), case
                    assert torch.equal(fused.isnan(), unfused.isnan()), case
                    rows = fused.view(-1, lora + rope_dim)[slots]
                    assert torch.equal(rows, unfused.view(-1, lora + rope_dim)[slots]), case


def check_latent_cache_rotates_the_query(generator: torch.Generator) -> None:
    """The query's rope in the write's launch: rope_triton's bits. Why bf16 passes here too:
    both sides cast through the same interpreted helper, so they truncate alike."""
    from moe_kernels.triton_latent_cache import write_latent_cache_triton
    from moe_kernels.triton_rope import rope_triton

    assert_query_rope_rides_along(
        generator,
        write_latent_cache_triton,
        rope_triton,
        row_counts=(1, 7),
        dtypes=(torch.float32, torch.bfloat16),
    )


def query_rope_refusals(call, q_pe, q_rot) -> list:
    """(call, regex) cases for bad q_pe / q_rot of kv_a [3, 32 + 8] fp32, q_pe [3, 3, 8];
    call(**changes) -> the write with those keyword arguments."""
    return [
        (call(q_pe=q_pe), "q_pe was given without q_rot"),
        (call(q_rot=q_rot), "q_rot was given without q_pe"),
        (call(q_pe=q_pe[:2], q_rot=q_rot[:2]), r"q_pe must be \[T=3, H, R=8\], got \(2, 3, 8\)"),
        (call(q_pe=q_pe[..., :6], q_rot=q_rot), r"q_pe must be .*, got \(3, 3, 6\)"),
        (call(q_pe=q_pe[:, 0], q_rot=q_rot), r"q_pe must be .*, got \(3, 8\)"),
        (call(q_pe=q_pe[:, :0], q_rot=q_rot[:, :0]), r"q_pe must be .*, got \(3, 0, 8\)"),
        (call(q_pe=q_pe, q_rot=q_rot[:, :2]), r"q_rot must have q_pe's shape \(3, 3, 8\)"),
        (call(q_pe=q_pe, q_rot=q_rot.bfloat16()), "q_rot must have .*float32, got torch.bfloat16"),
        (call(q_pe=q_pe.double(), q_rot=q_rot), "q_pe must have kv_a's dtype"),
        (call(q_pe=q_pe, q_rot=q_rot.to("meta")), "q_rot is on meta"),
        (call(q_pe=q_pe.mT.contiguous().mT, q_rot=q_rot), "q_pe needs a unit channel stride"),
        (call(q_pe=q_pe, q_rot=q_rot.mT.contiguous().mT), "q_rot needs a unit channel stride"),
    ]


def check_latent_cache_refuses_bad_query(generator: torch.Generator) -> None:
    from moe_kernels.triton_latent_cache import write_latent_cache_triton

    kv_a, weight, eps, positions, cos, sin, cache, slots = latent_inputs(
        generator, 3, 32, 8, 16, torch.float32
    )
    q_pe, query = query_rope_inputs(generator, 3, 3, 32, 8, torch.float32)
    args = (kv_a, weight, eps, positions, cos, sin, True, cache, slots)
    call = partial(partial, write_latent_cache_triton, *args)
    assert_each_refused(query_rope_refusals(call, q_pe, query[..., 32:]))
    assert cache.isnan().all() and query.isnan().all()


# Residual add + norm widths: DeepSeek-V2-Lite's hidden size, and the tiny model's.
HIDDEN_SIZES = (2048, 64)


def assert_add_rms_norm_fused_equals_unfused(
    generator, device="cpu", row_counts=ROW_COUNTS, dtypes=(torch.float32, torch.bfloat16)
) -> None:
    """add_rms_norm_triton == torch's add then rms_norm_triton, both outputs bitwise (also run
    on CUDA by tests/test_gpu_kernels.py)."""
    from moe_kernels.rmsnorm import add_rms_norm_composed
    from moe_kernels.triton_rmsnorm import add_rms_norm_triton, rms_norm_triton

    for dim in HIDDEN_SIZES:
        for dtype in dtypes:
            for num_rows in row_counts:
                x = (torch.randn(num_rows, dim, generator=generator) * 3).to(device, dtype)
                delta = torch.randn(num_rows, dim, generator=generator).to(device, dtype)
                weight = (torch.rand(dim, generator=generator) + 0.5).to(device, dtype)
                total, normed = add_rms_norm_triton(x, delta, weight, EPS)
                want_total, want_normed = add_rms_norm_composed(
                    x, delta, weight, EPS, rms_norm=rms_norm_triton
                )
                case = (dim, dtype, num_rows)
                assert total.dtype == dtype and normed.dtype == dtype, case
                assert torch.equal(total, want_total), case
                assert torch.equal(normed, want_normed), case


def check_add_rms_norm_fused_equals_unfused(generator: torch.Generator) -> None:
    # Why fp32 only: the interpreter casts fp32 to bf16 by truncation, torch's add rounds to
    # nearest even (as the compiled kernel does); bf16 is checked bitwise on the GPU.
    assert_add_rms_norm_fused_equals_unfused(generator, dtypes=(torch.float32,))


def check_add_rms_norm_bf16_norms_its_own_sums(generator: torch.Generator) -> None:
    """bf16 under the interpreter: the norm is rms_norm_triton's bits on the kernel's sums, and
    the sums are torch's within the truncation (one bf16 ulp)."""
    from moe_kernels.triton_rmsnorm import add_rms_norm_triton, rms_norm_triton

    for dim in HIDDEN_SIZES:
        x = (torch.randn(7, dim, generator=generator) * 3).bfloat16()
        delta = torch.randn(7, dim, generator=generator).bfloat16()
        weight = (torch.rand(dim, generator=generator) + 0.5).bfloat16()
        total, normed = add_rms_norm_triton(x, delta, weight, EPS)
        assert torch.equal(normed, rms_norm_triton(total, weight, EPS)), dim
        torch.testing.assert_close(total, x + delta, atol=0, rtol=2**-7)


def check_add_rms_norm_bad_inputs(generator: torch.Generator) -> None:
    from moe_kernels.triton_rmsnorm import add_rms_norm_triton

    x, weight = torch.randn(3, 64, generator=generator), torch.ones(64)
    cases = [
        (lambda: add_rms_norm_triton(x, x[:2], weight, EPS), r"delta must match .*\(2, 64\)"),
        (lambda: add_rms_norm_triton(x, x.bfloat16(), weight, EPS), "torch.bfloat16"),
        (lambda: add_rms_norm_triton(x, x.to("meta"), weight, EPS), "meta"),
        (lambda: add_rms_norm_triton(x, x, weight[:9], EPS), r"\(9,\)"),
        (lambda: add_rms_norm_triton(x[0], x[0], weight, EPS), r"\[T, D\]"),
        (lambda: add_rms_norm_triton(x.long(), x.long(), weight, EPS), "torch.int64"),
    ]
    assert_each_refused(cases)


# MLA query shapes (heads, qk_nope, kv_lora_rank, rope_dim): DeepSeek-V2-Lite, tiny.
QUERY_SHAPES = ((16, 128, 512, 64), (4, 16, 32, 8))


def assert_query_in_place_equals_cat(generator, device="cpu", row_counts=ROW_COUNTS) -> None:
    """The MLA query written in place (W_UK's product and the rotated q_pe into slices of one
    buffer) == the old cat of the two ops' own outputs, bitwise (also run on CUDA)."""
    from moe_kernels.triton_linear import batched_linear_triton
    from moe_kernels.triton_rope import rope_triton

    for num_heads, nope, lora, rope_dim in QUERY_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            w_uk_t = (torch.randn(num_heads, lora, nope, generator=generator) / nope**0.5).to(
                device, dtype
            )
            cos = torch.randn(4096, rope_dim // 2, generator=generator).to(device)
            sin = torch.randn(4096, rope_dim // 2, generator=generator).to(device)
            for num_rows in row_counts:
                q = torch.randn(num_rows, num_heads, nope + rope_dim, generator=generator)
                q_nope, q_pe = q.to(device, dtype).split([nope, rope_dim], dim=-1)
                positions = torch.randint(0, 4096, (num_rows,), generator=generator).to(device)
                q_latent = batched_linear_triton(q_nope.transpose(0, 1), w_uk_t).transpose(0, 1)
                q_rot = rope_triton(q_pe, positions, cos, sin, True)
                want = torch.cat([q_latent, q_rot], dim=-1)
                query = torch.full_like(want, float("nan"))
                latent_out, rot_out = query.split([lora, rope_dim], dim=-1)
                batched_linear_triton(
                    q_nope.transpose(0, 1), w_uk_t, out=latent_out.transpose(0, 1)
                )
                rope_triton(q_pe, positions, cos, sin, True, out=rot_out)
                assert torch.equal(query, want), (num_heads, dtype, num_rows)


def check_query_in_place_equals_cat(generator: torch.Generator) -> None:
    # Why fewer rows: the interpreted 16-head GEMM is slow; 64 and 300 rows run on the GPU.
    assert_query_in_place_equals_cat(generator, row_counts=(1, 7))


def check_out_views_bad_inputs(generator: torch.Generator) -> None:
    from moe_kernels.triton_linear import batched_linear_triton
    from moe_kernels.triton_rope import rope_triton

    x, w = torch.randn(2, 3, 8, generator=generator), torch.randn(2, 6, 8, generator=generator)
    cos = sin = torch.randn(10, 4, generator=generator)
    q, positions = torch.randn(3, 2, 8, generator=generator), torch.zeros(3, dtype=torch.int64)
    cases = [
        (lambda: batched_linear_triton(x, w, out=x.new_empty(2, 3, 5)), r"\(2, 3, 5\)"),
        (lambda: batched_linear_triton(x, w, out=x.new_empty(2, 3, 6).double()), "float64"),
        (lambda: batched_linear_triton(x, w, out=x.new_empty(2, 6, 3).mT), "unit column"),
        (lambda: rope_triton(q, positions, cos, sin, True, out=q[:2]), r"\(2, 2, 8\)"),
        (lambda: rope_triton(q, positions, cos, sin, True, out=q.bfloat16()), "bfloat16"),
        (lambda: rope_triton(q, positions, cos, sin, True, out=q.mT.contiguous().mT), "unit"),
    ]
    assert_each_refused(cases)


CHECKS = {
    "latent_cache_fused_equals_unfused": check_latent_cache_fused_equals_unfused,
    "latent_cache_close_to_reference": check_latent_cache_close_to_reference,
    "latent_cache_bad_inputs": check_latent_cache_bad_inputs,
    "latent_cache_rotates_the_query": check_latent_cache_rotates_the_query,
    "latent_cache_refuses_bad_query": check_latent_cache_refuses_bad_query,
    "add_rms_norm_fused_equals_unfused": check_add_rms_norm_fused_equals_unfused,
    "add_rms_norm_bf16_norms_its_own_sums": check_add_rms_norm_bf16_norms_its_own_sums,
    "add_rms_norm_bad_inputs": check_add_rms_norm_bad_inputs,
    "query_in_place_equals_cat": check_query_in_place_equals_cat,
    "out_views_bad_inputs": check_out_views_bad_inputs,
}


@pytest.fixture(scope="module")
def interpreted_results() -> dict:
    return interpreted.interpreted_results("tests.test_triton_fused", SEED)


@pytest.mark.parametrize("name", list(CHECKS))
def test_fused_kernel_interpreted(interpreted_results, name):
    assert interpreted_results[name] == "", interpreted_results[name]


def test_compiled_fused_wrappers_refuse_cpu(generator):
    # Here the kernels are compiled (no interpreter), so CPU tensors are refused.
    from moe_kernels.triton_latent_cache import write_latent_cache_triton

    kv_a, weight, eps, positions, cos, sin, cache, slots = latent_inputs(
        generator, 3, 32, 8, 16, torch.float32
    )
    with pytest.raises(ValueError, match="cpu"):
        write_latent_cache_triton(kv_a, weight, eps, positions, cos, sin, True, cache, slots)
    from moe_kernels.triton_rmsnorm import add_rms_norm_triton

    with pytest.raises(ValueError, match="cpu"):
        add_rms_norm_triton(kv_a, kv_a, torch.ones(kv_a.shape[1]), EPS)


def test_write_latent_cache_ref_rotates_the_query(generator):
    """The composed op's query rope (the CPU table's): rope_ref's bits into q_rot, same cache."""
    from moe_kernels.latent_cache import write_latent_cache_ref
    from moe_kernels.rope import rope_ref

    write = partial(write_latent_cache_ref, tile_rows=4)
    assert_query_rope_rides_along(
        generator, write, rope_ref, dtypes=(torch.float32, torch.bfloat16)
    )


def test_write_latent_cache_ref_refuses_bad_query(generator):
    from moe_kernels.latent_cache import write_latent_cache_ref

    kv_a, weight, eps, positions, cos, sin, cache, slots = latent_inputs(
        generator, 3, 32, 8, 16, torch.float32
    )
    q_pe, query = query_rope_inputs(generator, 3, 3, 32, 8, torch.float32)
    args = (kv_a, weight, eps, positions, cos, sin, True, cache, slots)
    call = partial(partial, write_latent_cache_ref, *args, tile_rows=4)
    assert_each_refused(query_rope_refusals(call, q_pe, query[..., 32:]))
    # Checked before any store: a refused call leaves the cache and the query as they were.
    assert cache.isnan().all() and query.isnan().all()
