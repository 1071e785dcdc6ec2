"""Writing a step's MLA latents into the paged cache, as one op of the op table.

A token's cache row is its kv_a output with the first kv_lora channels RMS-normalised (the
latent norm's weight) and the last rope channels rotated by its position; optionally the
query's rope channels are rotated by the same positions in the same op. This module holds
the unfused composition, the table's rms_norm and rope then an index copy into the token's
slot, exactly the steps the model took before the op existed; `write_latent_cache_ref` and
`write_latent_cache_fast` bind it to the CPU norms. moe_kernels/triton_latent_cache.py is the
same steps in one launch. Rows are independent: batch-invariant whenever the norm is.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from moe_kernels.rmsnorm import rms_norm_fast, rms_norm_ref
from moe_kernels.rope import rope_ref


def write_latent_cache_composed(
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
    rms_norm: Callable,
    rope: Callable,
    q_pe: torch.Tensor | None = None,
    q_rot: torch.Tensor | None = None,
) -> None:
    """kv_a [T, C] (C = kv_lora + R; row stride free), norm_weight [kv_lora], positions [T]
    int64, cos/sin tables [S, R/2] fp32, kv_cache [NB, BS, C], slot_mapping [T] int64 flat
    slots in [0, NB * BS) -> None; kv_cache row slot_mapping[t] = (rms_norm(latent_t),
    rope(k_pe_t)). rms_norm and rope: the table's ops (rms_norm_ref's and rope_ref's contracts).
    q_pe, q_rot [T, H, R] (both or neither; check_query_rope's contract): q_rot receives
    rope(q_pe) at the same positions.
    """
    lora, rope_dim = norm_weight.shape[0], kv_a.shape[1] - norm_weight.shape[0]
    has_query = check_query_rope(kv_a, rope_dim, q_pe, q_rot)
    latent, k_pe = kv_a.split([lora, rope_dim], -1)
    latent = rms_norm(latent.contiguous(), norm_weight, eps)
    k_pe = rope(k_pe[:, None, :], positions, cos_table, sin_table, is_interleaved)[:, 0]
    # Index assignment (no accumulation): the cache row of a token is exactly its latent.
    kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping] = torch.cat([latent, k_pe], dim=-1)
    if has_query:
        rope(q_pe, positions, cos_table, sin_table, is_interleaved, out=q_rot)


def check_query_rope(
    kv_a: torch.Tensor, rope_dim: int, q_pe: torch.Tensor | None, q_rot: torch.Tensor | None
) -> bool:
    """Whether the query's rope rides along with the cache write: q_pe and q_rot both given
    (True) or neither (False). Each must be [T, H, R] with kv_a's T, dtype and device, R =
    rope_dim, H >= 1, token and head strides free and a unit channel stride (rope_triton's
    `out` contract, so a CPU run refuses what the CUDA kernel would)."""
    if (q_pe is None) != (q_rot is None):
        given, missing = ("q_pe", "q_rot") if q_rot is None else ("q_rot", "q_pe")
        raise ValueError(f"q_pe and q_rot go together: {given} was given without {missing}")
    if q_pe is None:
        return False
    for name, x in (("q_pe", q_pe), ("q_rot", q_rot)):
        if x.device != kv_a.device:
            raise ValueError(f"{name} is on {x.device} but kv_a is on {kv_a.device}")
        if x.dtype != kv_a.dtype:
            raise ValueError(f"{name} must have kv_a's dtype {kv_a.dtype}, got {x.dtype}")
        if x.dim() != 3 or x.shape[0] != kv_a.shape[0] or x.shape[1] < 1 or x.shape[2] != rope_dim:
            raise ValueError(
                f"{name} must be [T={kv_a.shape[0]}, H, R={rope_dim}], got {tuple(x.shape)}"
            )
        if x.stride(2) != 1:
            raise ValueError(f"{name} needs a unit channel stride, got strides {x.stride()}")
    if q_rot.shape != q_pe.shape:
        raise ValueError(
            f"q_rot must have q_pe's shape {tuple(q_pe.shape)}, got {tuple(q_rot.shape)}"
        )
    return True


def write_latent_cache_ref(
    *args, tile_rows: int, q_pe: torch.Tensor | None = None, q_rot: torch.Tensor | None = None
) -> None:
    """write_latent_cache_composed's contract, with the tiled reference norm and rope_ref."""
    norm = partial(rms_norm_ref, tile_rows=tile_rows)
    write_latent_cache_composed(*args, rms_norm=norm, rope=rope_ref, q_pe=q_pe, q_rot=q_rot)


def write_latent_cache_fast(
    *args, q_pe: torch.Tensor | None = None, q_rot: torch.Tensor | None = None
) -> None:
    write_latent_cache_composed(
        *args, rms_norm=rms_norm_fast, rope=rope_ref, q_pe=q_pe, q_rot=q_rot
    )
