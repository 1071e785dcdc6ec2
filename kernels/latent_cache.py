"""Writing a step's MLA latents into the paged cache, as one op of the op table.

A token's cache row is its kv_a output with the first kv_lora channels RMS-normalised (the
latent norm's weight) and the last rope channels rotated by its position. This module holds
the unfused composition, the table's rms_norm and rope then an index copy into the token's
slot, exactly the steps the model took before the op existed; `write_latent_cache_ref` and
`write_latent_cache_fast` bind it to the CPU norms. kernels/triton_latent_cache.py is the
same steps in one launch. Rows are independent: batch-invariant whenever the norm is.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from kernels.rmsnorm import rms_norm_fast, rms_norm_ref
from kernels.rope import rope_ref


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
) -> None:
    """kv_a [T, C] (C = kv_lora + R; row stride free), norm_weight [kv_lora], positions [T]
    int64, cos/sin tables [S, R/2] fp32, kv_cache [NB, BS, C], slot_mapping [T] int64 flat
    slots in [0, NB * BS) -> None; kv_cache row slot_mapping[t] = (rms_norm(latent_t),
    rope(k_pe_t)). rms_norm and rope: the table's ops (rms_norm_ref's and rope_ref's contracts).
    """
    latent, k_pe = kv_a.split([norm_weight.shape[0], kv_a.shape[1] - norm_weight.shape[0]], -1)
    latent = rms_norm(latent.contiguous(), norm_weight, eps)
    k_pe = rope(k_pe[:, None, :], positions, cos_table, sin_table, is_interleaved)[:, 0]
    # Index assignment (no accumulation): the cache row of a token is exactly its latent.
    kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping] = torch.cat([latent, k_pe], dim=-1)


def write_latent_cache_ref(*args, tile_rows: int) -> None:
    """write_latent_cache_composed's contract, with the tiled reference norm and rope_ref."""
    norm = partial(rms_norm_ref, tile_rows=tile_rows)
    write_latent_cache_composed(*args, rms_norm=norm, rope=rope_ref)


def write_latent_cache_fast(*args) -> None:
    write_latent_cache_composed(*args, rms_norm=rms_norm_fast, rope=rope_ref)
