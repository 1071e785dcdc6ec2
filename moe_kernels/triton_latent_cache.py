"""`write_latent_cache_composed` (moe_kernels/latent_cache.py) with the Triton norm and rope as
one Triton kernel: one program per token normalises its latent, rotates its rope channels and
stores both straight into its cache row, instead of a copy, the norm, the rope, a cat and an
index copy (five launches); given the query's rope channels, the same program rotates those
too (rope_triton's launch, folded in).

Why the bits are the unfused kernels': the program calls the same jit helpers,
`rms_norm_row` (with `norm_launch_config`'s BLOCK_D and num_warps, so one reduction tree) and
`rope_row` (with rope_triton's BLOCK_H and BLOCK_R for the query), on the same values; the cat
and index copy are moves. Under TRITON_INTERPRET=1 it runs on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from moe_kernels.latent_cache import check_query_rope
from moe_kernels.triton_pdl import pdl_launch, pdl_start
from moe_kernels.triton_rmsnorm import norm_launch_config, rms_norm_row
from moe_kernels.triton_rope import rope_row

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _write_latent_cache_kernel(
    kv_a_ptr,
    w_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    cache_ptr,
    q_pe_ptr,
    q_rot_ptr,
    stride_kv_a,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    num_heads,
    LORA,
    eps,
    BLOCK_D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_INTERLEAVED: tl.constexpr,
    HAS_QUERY: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    kv_a_row = kv_a_ptr + t * stride_kv_a
    cache_row = cache_ptr + tl.load(slots_ptr + t) * (LORA + 2 * HALF)
    rms_norm_row(kv_a_row, w_ptr, cache_row, LORA, eps, BLOCK_D)
    position = tl.load(positions_ptr + t)
    rope_row(
        kv_a_row + LORA,
        0,
        position,
        cos_ptr,
        sin_ptr,
        cache_row + LORA,
        0,
        1,
        HALF,
        1,
        BLOCK_R,
        IS_INTERLEAVED,
    )
    if HAS_QUERY:
        rope_row(
            q_pe_ptr + t * stride_qt,
            stride_qh,
            position,
            cos_ptr,
            sin_ptr,
            q_rot_ptr + t * stride_ot,
            stride_oh,
            num_heads,
            HALF,
            BLOCK_H,
            BLOCK_R,
            IS_INTERLEAVED,
        )


def _check(kv_a, norm_weight, positions, cos_table, sin_table, kv_cache, slot_mapping) -> None:
    interpreted = isinstance(_write_latent_cache_kernel, InterpretedFunction)
    allowed = ("cpu", "cuda") if interpreted else ("cuda",)
    if kv_a.device.type not in allowed:
        raise ValueError(f"kv_a must be on a device of type {allowed}, got {kv_a.device}")
    tensors = {
        "norm_weight": norm_weight,
        "positions": positions,
        "cos_table": cos_table,
        "sin_table": sin_table,
        "kv_cache": kv_cache,
        "slot_mapping": slot_mapping,
    }
    for name, t in tensors.items():
        if t.device != kv_a.device:
            raise ValueError(f"{name} is on {t.device} but kv_a is on {kv_a.device}")
    lora = norm_weight.shape[0] if norm_weight.dim() == 1 else -1
    if (
        kv_a.dim() != 2
        or norm_weight.dim() != 1
        or kv_cache.dim() != 3
        or kv_cache.shape[2] != kv_a.shape[1]
        or not 0 < lora < kv_a.shape[1]
        or (kv_a.shape[1] - lora) % 2
        or positions.shape != (kv_a.shape[0],)
        or slot_mapping.shape != (kv_a.shape[0],)
    ):
        raise ValueError(
            "need kv_a [T, C], norm_weight [kv_lora] (kv_lora < C, C - kv_lora even), kv_cache "
            f"[NB, BS, C], positions and slot_mapping [T]; got kv_a {tuple(kv_a.shape)}, "
            f"norm_weight {tuple(norm_weight.shape)}, kv_cache {tuple(kv_cache.shape)}, "
            f"positions {tuple(positions.shape)}, slot_mapping {tuple(slot_mapping.shape)}"
        )
    half = (kv_a.shape[1] - lora) // 2
    for name, table in (("cos_table", cos_table), ("sin_table", sin_table)):
        if table.dim() != 2 or table.shape[1] != half or table.dtype != torch.float32:
            raise ValueError(
                f"{name} must be fp32 [S, {half}], got {table.dtype} {tuple(table.shape)}"
            )
    # Why one dtype: the unfused path rounds the norm and the rope to kv_a's dtype and copies
    # them into the cache; a second dtype would be a second rounding the kernel does not do.
    if kv_a.dtype not in _DTYPES or {norm_weight.dtype, kv_cache.dtype} != {kv_a.dtype}:
        raise ValueError(
            f"kv_a, norm_weight and kv_cache need one dtype of {_DTYPES}, got {kv_a.dtype}, "
            f"{norm_weight.dtype}, {kv_cache.dtype}"
        )
    for name, ids in (("positions", positions), ("slot_mapping", slot_mapping)):
        if ids.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {ids.dtype}")
    if kv_a.stride(1) != 1 or not kv_cache.is_contiguous() or not norm_weight.is_contiguous():
        raise ValueError("kv_a needs a unit column stride; kv_cache and norm_weight contiguous")


def write_latent_cache_triton(
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    is_interleaved: bool,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q_pe: torch.Tensor | None = None,
    q_rot: torch.Tensor | None = None,
) -> None:
    """write_latent_cache_composed's contract, all floats but the tables of one dtype, in one
    launch. Slots are not range-checked (that would be a host sync): no sync, so a CUDA graph
    can capture it. q_pe, q_rot: check_query_rope's contract; q_rot gets rope_triton(q_pe, ...)'s
    bits (the same rope_row call)."""
    _check(kv_a, norm_weight, positions, cos_table, sin_table, kv_cache, slot_mapping)
    lora, num_tokens = norm_weight.shape[0], kv_a.shape[0]
    has_query = check_query_rope(kv_a, kv_a.shape[1] - lora, q_pe, q_rot)
    if num_tokens == 0:
        return
    half = (kv_a.shape[1] - lora) // 2
    # Without a query: None pointers and zero strides, whose branch HAS_QUERY compiles away.
    num_heads = q_pe.shape[1] if has_query else 0
    q_strides = (*q_pe.stride()[:2], *q_rot.stride()[:2]) if has_query else (0, 0, 0, 0)
    _write_latent_cache_kernel[(num_tokens,)](
        kv_a,
        norm_weight,
        positions.contiguous(),
        cos_table.contiguous(),
        sin_table.contiguous(),
        slot_mapping.contiguous(),
        kv_cache,
        q_pe,
        q_rot,
        kv_a.stride(0),
        *q_strides,
        num_heads,
        lora,
        eps,
        HALF=half,
        BLOCK_R=triton.next_power_of_2(half),
        IS_INTERLEAVED=is_interleaved,
        HAS_QUERY=has_query,
        BLOCK_H=triton.next_power_of_2(max(num_heads, 1)),
        **norm_launch_config(lora),
        **pdl_launch(kv_a.device),
    )
