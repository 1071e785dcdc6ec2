"""Fast mode's kernels from elsewhere wait for the Triton kernel before them (GPU, sm90).

The repo's Triton kernels launch with PDL and let the next kernel launch as they start
(moe_kernels/triton_pdl.py). In a step, fast mode follows them with kernels it does not own:
cuBLAS (linears, the batched W_UK / W_UV products, the router logits), torch's grouped GEMM
(the experts), SDPA (the multi-head prefill: cuDNN or FlashAttention) and FlashMLA (decode; its
fence is tested in tests/test_fast_attention.py). Each op is run on an input that a
PDL-launched Triton kernel stores only after a busy loop (tests/late_write.py): it must give
the bits of the same op on the input written long before. FlashMLA's kernel did not wait and
read half-written queries until it was fenced (BENCHMARKS.md, twenty-ninth session).
Control: a kernel launched with PDL that does not wait, in the same probe, reads the NaN.
Skipped without CUDA or PDL.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.late_write import read_without_waiting, written_late

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HEADS, NOPE, ROPE, LORA, V = 128, 128, 64, 512, 128  # V3's attention at V2-Lite's latent


def _bf16(*shape, scale=1.0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()


def _equal_after_a_late_write(op, src: torch.Tensor) -> bool:
    """Whether op(input written late) has the bits of op(src); src contiguous, op a function of
    it (views taken inside)."""
    want = op(src)
    torch.cuda.synchronize()
    got = op(written_late(src))
    torch.cuda.synchronize()
    return torch.equal(got, want)


def _linear(rows):
    from moe_kernels.linear import linear_fast

    weight = _bf16(3072, 2048, scale=2048**-0.5, seed=1)
    return (lambda x: linear_fast(x, weight)), _bf16(rows, 2048)


def _router(rows):
    from moe_kernels.router import router_logits_fast

    weight = _bf16(64, 2048, scale=2048**-0.5, seed=1)
    return (lambda x: router_logits_fast(x, weight)), _bf16(rows, 2048)


def _w_uk(rows):
    """The query's nope part [T, H, 192][..., :128] through W_UK into a strided view of the
    query buffer, as the attention layer does (moe_runtime/model/mla.py)."""
    from moe_kernels.linear import batched_linear_fast

    w_uk_t = _bf16(HEADS, LORA, NOPE, scale=NOPE**-0.5, seed=1)

    def op(q):
        query = q.new_zeros(rows, HEADS, LORA + ROPE)
        nope = q.view(rows, HEADS, NOPE + ROPE)[..., :NOPE]
        batched_linear_fast(nope.transpose(0, 1), w_uk_t, out=query[..., :LORA].transpose(0, 1))
        return query

    return op, _bf16(rows, HEADS * (NOPE + ROPE))


def _w_uv(rows):
    from moe_kernels.linear import batched_linear_fast

    w_uv = _bf16(HEADS, V, LORA, scale=LORA**-0.5, seed=1)
    op = lambda x: batched_linear_fast(x.view(rows, HEADS, LORA).transpose(0, 1), w_uv)  # noqa: E731
    return op, _bf16(rows, HEADS * LORA)


def _experts(rows):
    from moe_kernels.linear import grouped_linear_cuda_fast

    experts = 8
    weight = _bf16(experts, 1408, 2048, scale=2048**-0.5, seed=1)
    sizes = torch.full((experts,), rows // experts, device="cuda")
    return (lambda x: grouped_linear_cuda_fast(x, weight, sizes)), _bf16(rows, 2048)


def _prefill(rows, backends=None):
    """Fast mode's multi-head prefill of one prompt of `rows` queries (SDPA: cuDNN's attention
    where it is enabled, else FlashAttention on values padded to the query's head dim; backends
    limits SDPA's), the query [T, H, nope + R] written late as the engine's cache write stores
    its rope part last."""
    from moe_kernels.mla_prefill import MhaPrefill, _pads_values

    block = 64
    blocks = -(-rows // block)
    kv_cache = _bf16(blocks, block, LORA + ROPE, seed=1)
    tables = torch.arange(blocks, device="cuda")[None]
    seq_ids = torch.zeros(rows, dtype=torch.int64, device="cuda")
    positions = torch.arange(rows, device="cuda")
    kv_b = _bf16(HEADS * (NOPE + V), LORA, scale=LORA**-0.5, seed=3)
    prefill = MhaPrefill()
    assert prefill.takes(seq_ids, positions, tables, HEADS)

    def op(query):
        with sdpa_kernel(backends) if backends else contextlib.nullcontext():
            # Engagement: with cuDNN's attention off the values reach SDPA padded.
            assert not backends or _pads_values(query)
            return prefill(
                query.view(rows, HEADS, NOPE + ROPE), kv_cache, seq_ids, tables, positions,
                kv_b, scale=(NOPE + ROPE) ** -0.5, v_dim=V,
            )  # fmt: skip

    return op, _bf16(rows, HEADS * (NOPE + ROPE))


PROBES = {
    "linear": (_linear, (1, 8, 256)),
    "router_logits": (_router, (1, 256)),
    "w_uk": (_w_uk, (1, 64)),
    "w_uv": (_w_uv, (1, 64)),
    "grouped_linear": (_experts, (64, 1024)),
    "multi_head_prefill": (_prefill, (256,)),
    "multi_head_prefill_flash": (
        lambda rows: _prefill(rows, [SDPBackend.FLASH_ATTENTION]),
        (256,),
    ),
}


@pytest.mark.parametrize(
    "name, rows", [(name, rows) for name, (_, sizes) in PROBES.items() for rows in sizes]
)
def test_gpu_fast_ops_wait_for_a_pdl_kernel_before_them(name, rows):
    make, _ = PROBES[name]
    op, src = make(rows)
    assert _equal_after_a_late_write(op, src), f"{name} at {rows} rows read its input early"
    # Control: the same probe sees a kernel that does not wait (the NaN it read).
    assert not _equal_after_a_late_write(lambda x: op(read_without_waiting(x)), src)
