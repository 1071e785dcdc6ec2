"""Batch-invariant dense linear as Triton kernels (GPU path): `linear_triton` and the
batched products `batched_linear_triton`, with the persistent TMA kernel they take at prefill
sizes. The grouped (per-expert) linear is triton_grouped_linear.py's.

Each output tile is a plain tiled matmul: a program per [BLOCK_M, BLOCK_N] tile (the pointer
kernel, triton_pointer_linear.py) or a persistent program walking tiles with TMA loads (here)
walks K in steps of BLOCK_K, accumulating in fp32. BLOCK_K, the K loop order and the fixed K
split of narrow weights (chosen in triton_linear_config.py; run by triton_split_k.py's chunk
launch, or from CHAIN_MIN_ROWS rows by triton_chunk_tree.py's in-program chain) are functions
of the weight shape and dtype only, never of the row count: each output element is one fixed
sequence of fp32 multiply-adds whatever the other rows are. Oracle: `linear_ref`
(moe_kernels/linear.py). Under TRITON_INTERPRET=1 the kernels run on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moe_kernels.triton_chunk_tree import CHAIN_WIDE_CONFIG, chain_config, linear_chunk_tree
from moe_kernels.triton_dot import check_pair, is_interpreted, num_persistent_programs, tma_ok
from moe_kernels.triton_linear_config import (
    LinearConfig,
    batched_config,
    k_split_chunk,
    k_split_chunks_per_program,
    k_split_count,
    k_split_is_tree,
    linear_config,
)
from moe_kernels.triton_pdl import pdl_launch, pdl_start
from moe_kernels.triton_pointer_linear import launch_pointer_linear
from moe_kernels.triton_split_k import launch_split_k


@triton.jit
def _tma_tile(desc, batch, row, col, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
              IS_BATCHED: tl.constexpr):  # fmt: skip
    """desc's [BLOCK_R, BLOCK_C] tile at (row, col), of matrix `batch` where desc is 3-d."""
    if IS_BATCHED:
        tile = desc.load([batch, row, col]).reshape(BLOCK_R, BLOCK_C)
    else:
        tile = desc.load([row, col])
    return tile


@triton.jit
def _tma_k_steps(x_desc, w_desc, batch, row, col, first_step, num_steps, acc,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST_DOT: tl.constexpr, IS_BATCHED: tl.constexpr):  # fmt: skip
    """acc + x[row tile, k] @ w[col tile, k]^T over num_steps BLOCK_K steps ascending from
    first_step, by TMA tiles (TMA fills rows and K columns past the end with exact zeros)."""
    for ki in range(first_step, first_step + num_steps):
        a = _tma_tile(x_desc, batch, row, ki * BLOCK_K, BLOCK_M, BLOCK_K, IS_BATCHED)
        b = _tma_tile(w_desc, batch, col, ki * BLOCK_K, BLOCK_N, BLOCK_K, IS_BATCHED)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit(do_not_specialize=["num_rows"])
def _linear_persistent_kernel(
    x_desc,
    w_desc,
    out_desc,
    num_rows,
    N,
    K,
    num_batches,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    NUM_CHUNKS: tl.constexpr = 1,
    FLATTEN: tl.constexpr = True,
    IS_BATCHED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """out = x @ w^T with TMA tiles; program p computes tiles p, p + NUM_PROGRAMS, ...
    NUM_CHUNKS > 1: the linear's fixed K split as the chain (((c0 + c1) + c2) + ...) of
    NUM_CHUNKS chunk sums of whole BLOCK_K steps, each an fp32 sum from zero: the chain's and
    the chunk launch's adds (moe_kernels/triton_chunk_tree.py), so their bits. IS_BATCHED:
    3-d descriptors, num_batches products x[b] @ w[b]^T (a matrix's tiles one after another)."""
    pdl_start(PDL)
    num_pid_m = tl.cdiv(num_rows, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    chunk_steps = num_k // NUM_CHUNKS
    pids_per_group = GROUP_M * num_pid_n
    tiles_per_batch = num_pid_m * num_pid_n
    num_tiles = tiles_per_batch * num_batches if IS_BATCHED else tiles_per_batch
    # Which program computes a tile depends on the row count; the tile's sums do not.
    # (FLATTEN: the tile and K loops as one; the launch turns it off for the chain's nest)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        batch = tile // tiles_per_batch if IS_BATCHED else 0
        in_batch = tile % tiles_per_batch if IS_BATCHED else tile
        first_m = (in_batch // pids_per_group) * GROUP_M
        group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (in_batch % pids_per_group) % group_rows
        pid_n = (in_batch % pids_per_group) // group_rows
        row = pid_m * BLOCK_M
        col = pid_n * BLOCK_N
        # Why: the same ascending K loop with the same BLOCK_K as _linear_kernel; TMA fills
        # out-of-range rows and K columns with exact zeros, as the masked loads there do.
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _tma_k_steps(
            x_desc, w_desc, batch, row, col, 0, chunk_steps, zero, BLOCK_M, BLOCK_N, BLOCK_K,
            UPCAST_DOT, IS_BATCHED,
        )  # fmt: skip
        for chunk in range(1, NUM_CHUNKS):
            acc += _tma_k_steps(
                x_desc, w_desc, batch, row, col, chunk * chunk_steps, chunk_steps, zero, BLOCK_M,
                BLOCK_N, BLOCK_K, UPCAST_DOT, IS_BATCHED,
            )  # fmt: skip
        if IS_BATCHED:
            out_desc.store([batch, row, col], acc.to(out_desc.dtype).reshape(1, BLOCK_M, BLOCK_N))
        else:
            out_desc.store([row, col], acc.to(out_desc.dtype))


def _launch_persistent(x, weight, out, config: LinearConfig, num_chunks: int = 1) -> torch.Tensor:
    """The TMA kernel over SM-many programs: x [M, K] @ weight [N, K]^T, or batched x [B, M, K]
    @ weight [B, N, K]^T into out [B, M, N] (strided views as tma_ok allows); num_chunks > 1:
    the fixed K split's chain (chunks of whole K steps, in_dim = num_chunks * chunk)."""
    is_batched = x.dim() == 3
    num_rows, (out_dim, in_dim) = x.shape[-2], weight.shape[-2:]
    num_batches = x.shape[0] if is_batched else 1
    num_tiles = triton.cdiv(num_rows, config.block_m) * triton.cdiv(out_dim, config.block_n)
    num_programs = num_persistent_programs(num_tiles * num_batches, x.device)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    lead = [1] if is_batched else []  # a batched tile is one matrix's
    _linear_persistent_kernel[(num_programs,)](
        TensorDescriptor.from_tensor(x, lead + [bm, bk]),
        TensorDescriptor.from_tensor(weight, lead + [bn, bk]),
        TensorDescriptor.from_tensor(out, lead + [bm, bn]),
        num_rows,
        out_dim,
        in_dim,
        num_batches,
        NUM_PROGRAMS=num_programs,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=config.group_m,
        UPCAST_DOT=is_interpreted(),
        NUM_CHUNKS=num_chunks,
        FLATTEN=num_chunks == 1,
        IS_BATCHED=is_batched,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_launch(x.device),
    )
    return out


def _launch(
    x,
    weight,
    out,
    num_rows,
    config: LinearConfig,
    whole_out_dim: int | None = None,
    arrivals: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch over row tiles. whole_out_dim, arrivals: see linear_triton.

    x [M, K] / out [M, N] (row strides free, unit column stride), or batched x [B, M, K],
    out [B, M, N] with weight [B, N, K]. 2-D launches of a weight with a fixed K split
    (k_split_count) go through _launch_k_split; persistent configs take the TMA kernel where
    its alignment allows, else the pointer kernel."""
    out_dim, in_dim = weight.shape[-2:]
    is_plain = x.dim() == 2
    k_splits = k_split_count(whole_out_dim or out_dim, in_dim, weight.dtype) if is_plain else 1
    if k_splits > 1:
        return _launch_k_split(x, weight, out, num_rows, config, k_splits, arrivals)
    if config.is_persistent and out.dtype == weight.dtype:
        # Plain or batched (batched_config's prefill tiles). (An fp32 out's
        # [BLOCK_M, BLOCK_N] store tile would not fit the TMA kernel's smem.)
        if is_plain and not tma_ok(x, weight, out):
            x, weight = x.clone(), weight.clone()  # fresh allocations are 16-byte aligned
        if tma_ok(x, weight, out):
            return _launch_persistent(x, weight, out, config)
    return launch_pointer_linear(x, weight, out, None, num_rows, config)


def _launch_k_split(
    x, weight, out, num_rows, config: LinearConfig, k_splits: int, arrivals
) -> torch.Tensor:
    """A plain launch of a weight with a fixed K split of k_splits chunks: the in-program
    chain where it takes these sizes, else launch_split_k (chunk order; fp32: the tree)."""
    out_dim, in_dim = weight.shape
    chunk_k = k_split_chunk(in_dim, k_splits)
    chain = chain_config(out_dim, in_dim, k_splits, weight.dtype, num_rows)
    if chain is not None and x.is_contiguous() and out.is_contiguous():
        # Prefill sizes: the same chunk sums and adds in one launch, no fp32 parts.
        if chain.is_persistent:
            if out.dtype == weight.dtype and tma_ok(x, weight, out):
                return _launch_persistent(x, weight, out, chain, k_splits)
            chain = CHAIN_WIDE_CONFIG
        return linear_chunk_tree(x, weight, k_splits, out.dtype, chain, is_tree=False, out=out)
    launch_split_k(
        x, weight, out, chunk_k, config, is_tree=k_split_is_tree(weight.dtype),
        chunks_per_program=k_split_chunks_per_program(weight.dtype, k_splits, num_rows),
        arrivals=arrivals,
    )  # fmt: skip
    return out


def linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    whole_out_dim: int | None = None,
    arrivals: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [T, IN] @ weight [OUT, IN]^T -> [T, OUT] in out_dtype (None: weight's dtype); fp32
    accumulation, rounded to out_dtype once at the store (fp32: the sums themselves). x has
    weight's dtype, or is 16-bit against an fp32 weight (the router): then it is upcast in
    registers, exactly, and the result has linear_triton(x.float(), weight)'s bits without
    the copy launch.

    whole_out_dim: the OUT of the whole weight when `weight` is one TP rank's column slice of
    it (None: weight is whole). The fixed K split follows the whole weight's shape, so each
    output column gets the same sum at every TP degree. arrivals: the fixed K split's arrival
    counts (arrival_counts; None: fresh zeros when a launch needs them).
    """
    check_pair(x, weight, 2, is_upcast_ok=True)
    if whole_out_dim is not None and whole_out_dim < weight.shape[0]:
        raise ValueError(
            f"whole_out_dim {whole_out_dim} is smaller than the slice's {weight.shape[0]} rows"
        )
    x, weight = x.contiguous(), weight.contiguous()
    if out_dtype not in (None, weight.dtype, torch.float32):
        raise ValueError(f"out_dtype must be the weight's {weight.dtype} or fp32, got {out_dtype}")
    out = x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype or weight.dtype)
    if x.shape[0] == 0:
        return out
    config = linear_config(weight.shape[0], weight.shape[1], weight.dtype, x.shape[0])
    return _launch(x, weight, out, x.shape[0], config, whole_out_dim, arrivals)


def batched_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [B, M, IN] (any batch and row strides) @ weight [B, OUT, IN]^T -> [B, M, OUT].

    One launch for every b; each b gets exactly the bits `linear_triton(x[b], weight[b])`
    gives (the same BLOCK_K and K order; the row bucket picks only the tile shape). `out`:
    where to write them, e.g. a slice of a wider buffer (batch and row strides free, unit
    column stride, x's dtype); the strides move only the stores, never the arithmetic.
    """
    if x.dim() != 3 or weight.dim() != 3 or x.shape[0] != weight.shape[0]:
        raise ValueError(
            f"need x [B, M, IN] and weight [B, OUT, IN], got {tuple(x.shape)}, "
            f"{tuple(weight.shape)}"
        )
    check_pair(x[0], weight[0], 2)
    if x.stride(2) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    batch, num_rows = x.shape[:2]
    if out is None:
        out = x.new_empty((batch, num_rows, weight.shape[1]))
    elif (
        out.shape != (batch, num_rows, weight.shape[1])
        or out.dtype != x.dtype
        or out.device != x.device
        or out.stride(2) != 1
    ):
        raise ValueError(
            f"out must be [{batch}, {num_rows}, {weight.shape[1]}] {x.dtype} on {x.device} with "
            f"a unit column stride, got {tuple(out.shape)} {out.dtype} on {out.device}, "
            f"strides {out.stride()}"
        )
    if num_rows == 0 or batch == 0:
        return out
    config = batched_config(weight.shape[1], weight.shape[2], x.dtype, num_rows, batch)
    return _launch(x, weight, out, num_rows, config)
