"""What every invariant matmul kernel shares: one K step of fp32 accumulation (`dot_step`),
the K loops over whole steps (`dot_k_range`) and over a 64-column grid fixed in the whole
weight's columns (`dot_k_grid`), the tile order, the fixed binary tree of chunk sums
(`tree_push`, `sum_parts`), and the launch side's input checks, kernel constants and
persistent-launch checks (`tma_ok`, `num_persistent_programs`). The pointer, chunk-launch
and in-program kernels (triton_pointer_linear, triton_split_k, triton_chunk_tree)
all sum a chunk through these, so a chunk's sum is the same sequence of steps on every path.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from moe_kernels.triton_linear_config import LinearConfig

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def is_interpreted() -> bool:
    return isinstance(dot_step, InterpretedFunction)


def check_tensor(name: str, t: torch.Tensor, ndim: int, dtype: torch.dtype | None) -> None:
    allowed = ("cpu", "cuda") if is_interpreted() else ("cuda",)
    if t.device.type not in allowed:
        raise ValueError(f"{name} must be on a device of type {allowed}, got {t.device}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES or (dtype is not None and t.dtype != dtype):
        want = dtype if dtype is not None else _DTYPES
        raise ValueError(f"{name} dtype must be {want}, got {t.dtype}")


def check_pair(
    x: torch.Tensor, weight: torch.Tensor, weight_ndim: int, is_upcast_ok: bool = False
) -> None:
    """is_upcast_ok: an fp32 weight may meet a 16-bit x (upcast in registers, exact)."""
    check_tensor("x", x, 2, None)
    is_upcast = is_upcast_ok and weight.dtype == torch.float32
    check_tensor("weight", weight, weight_ndim, None if is_upcast else x.dtype)
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if weight.shape[-1] != x.shape[1]:
        raise ValueError(
            f"x has {x.shape[1]} input features but weight {tuple(weight.shape)} "
            f"expects {weight.shape[-1]}"
        )


def kernel_consts(config: LinearConfig, x_dtype: torch.dtype, w_dtype: torch.dtype) -> dict:
    return dict(
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        # Why: fp32 weights (the router) use exact fp32 products, not tf32.
        INPUT_PRECISION="ieee" if w_dtype == torch.float32 else "tf32",
        # The interpreter hands 16-bit floats to numpy's matmul as raw bits: feed it fp32
        # (exact for bf16/fp16 products). Compiled kernels keep the 16-bit MMA. A 16-bit x
        # against an fp32 weight is upcast in registers: the values x.float() would load.
        UPCAST_DOT=(is_interpreted() and w_dtype != torch.float32) or x_dtype != w_dtype,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned base addresses and strides (all but the last, which is 1)."""
    return all(
        t.data_ptr() % 16 == 0
        and t.stride(-1) == 1
        and all(t.stride(d) * t.element_size() % 16 == 0 for d in range(t.dim() - 1))
        for t in tensors
    )


def num_persistent_programs(num_tiles: int, device: torch.device) -> int:
    """A persistent kernel's program count: one a tile, at most one an SM (4 interpreted).
    Which program computes a tile follows it; a tile's sums never do."""
    sms = 4 if is_interpreted() else _num_sms(device.index or 0)
    return min(num_tiles, sms)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@triton.jit
def stored_value(acc, dtype: tl.constexpr):
    """acc rounded to dtype as a store to memory and a reload would give it; the bitcast keeps
    the compiler from folding the round trip into the next fp32 op."""
    bits = tl.int16 if dtype.primitive_bitwidth == 16 else tl.int32
    return acc.to(dtype).to(bits, bitcast=True).to(dtype, bitcast=True)


@triton.jit
def dot_step(
    x_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, stride_xm, K, k, k_ok, acc,
    INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, IS_K_MASKED: tl.constexpr,
):  # fmt: skip
    """acc + x[m, k] @ w[n, k]^T for one K step k; masked rows and columns load exact zeros.
    IS_K_MASKED: lanes where k_ok is false load zeros too (their products add nothing), for a
    step partly outside [k_lo, k_hi); otherwise k_ok is unread and the step's BLOCK_K columns
    all lie inside K: no k mask, so the loads stay full-width vectors."""
    x_mask = row_ok[:, None]
    w_mask = col_ok[None, :]
    if IS_K_MASKED:
        x_mask = x_mask & k_ok[None, :]
        w_mask = w_mask & k_ok[:, None]
    a = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
    b = tl.load(w_ptr + offs_n[None, :] * K + k[:, None], mask=w_mask, other=0.0)
    if UPCAST_DOT:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def dot_k_range(
    x_ptr,
    w_ptr,
    offs_m,
    offs_n,
    row_ok,
    col_ok,
    stride_xm,
    K,
    k_lo,
    k_hi,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """fp32 sum over k in [k_lo, k_hi) of x[m, k] * w[n, k], from zero, in steps of BLOCK_K
    ascending from k_lo. Masked lanes load exact zeros."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    num_whole = (k_hi - k_lo) // BLOCK_K
    # Why two loops: a mask along k that the compiler cannot prove aligned (k_hi of a chunk)
    # turns every load into scalar loads; whole steps need none, the tail step keeps it. The
    # steps and their dots are the same as one masked loop's: the same bits.
    for i in range(num_whole):
        acc = dot_step(
            x_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, stride_xm, K,
            k_lo + i * BLOCK_K + offs_k, None, acc, INPUT_PRECISION, UPCAST_DOT, False,
        )  # fmt: skip
    k0 = k_lo + num_whole * BLOCK_K
    if k0 < k_hi:
        k = k0 + offs_k
        acc = dot_step(
            x_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, stride_xm, K, k, k < k_hi, acc,
            INPUT_PRECISION, UPCAST_DOT, True,
        )  # fmt: skip
    return acc


@triton.jit
def dot_k_grid(
    x_ptr,
    w_ptr,
    offs_m,
    offs_n,
    row_ok,
    col_ok,
    stride_xm,
    K,
    k_start,
    k_lo,
    k_hi,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    K_ALIGN: tl.constexpr,
):
    """fp32 sum over k in [k_lo, k_hi) of x[m, k] * w[n, k], from zero, in steps of BLOCK_K
    ascending from k_start (<= k_lo, > k_lo - BLOCK_K: a step grid the chunk need not start
    on), every step masked to [k_lo, k_hi) in one loop, which the compiler pipelines whole: a
    partial first step written apart compiled to 16-bit scalar loads outside the pipeline on
    the H200 (the shared experts' down at 64 rows 10.9 -> 9.4 us in one loop). K_ALIGN: a power
    of two dividing k_start, k_lo and k_hi (the caller's promise), so the masked loads stay
    full-width vectors."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = tl.multiple_of(k_lo, K_ALIGN)
    k_hi = tl.multiple_of(k_hi, K_ALIGN)
    for i in range(tl.cdiv(k_hi - k_start, BLOCK_K)):
        k = tl.multiple_of(k_start + i * BLOCK_K, K_ALIGN) + offs_k
        acc = dot_step(
            x_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, stride_xm, K, k,
            (k >= k_lo) & (k < k_hi), acc, INPUT_PRECISION, UPCAST_DOT, True,
        )  # fmt: skip
    return acc


@triton.jit
def tile_of(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program pid's (row tile, column tile), in an order grouped along M for L2 reuse: it moves
    tiles between programs only."""
    pids_per_group = GROUP_M * num_pid_n
    first_m = (pid // pids_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % pids_per_group) % group_rows, (pid % pids_per_group) // group_rows


@triton.jit
def tree_push(acc, s0, s1, s2, s3, C, NUM_PARTS: tl.constexpr):
    """Part C (counting from 0, a constexpr or a runtime int) of a fixed binary tree over
    NUM_PARTS (a power of two, <= 16) parts, evaluated as a binary counter: acc (part C) is
    added to the finished left siblings waiting in s0..s3 (subtrees of 1, 2, 4, 8 parts; bit l
    of C set: one of 2**l waits), then the subtree it now holds is parked at its level. Every
    add is one of the tree's (left + right, adjacent pairs level by level), so the sum's bits
    are the level-by-level tree's. After the last part, acc holds the whole tree (it parks
    nowhere; levels the tree does not have are never written, so they are no loop state).
    Returns (acc, s0, s1, s2, s3)."""
    if C % 2 == 1:
        acc = s0 + acc
    if C % 4 == 3:
        acc = s1 + acc
    if C % 8 == 7:
        acc = s2 + acc
    if C % 16 == 15:
        acc = s3 + acc
    if NUM_PARTS > 1 and (C + 1) % 2 == 1:
        s0 = acc
    elif NUM_PARTS > 2 and (C + 1) % 4 == 2:
        s1 = acc
    elif NUM_PARTS > 4 and (C + 1) % 8 == 4:
        s2 = acc
    elif NUM_PARTS > 8 and (C + 1) % 16 == 8:
        s3 = acc
    return acc, s0, s1, s2, s3


@triton.jit
def sum_parts(parts_ptr, offs, part_elems, mask, NUM_PARTS: tl.constexpr, IS_TREE: tl.constexpr):
    """The fp32 parts at parts_ptr + c * part_elems + offs, c < NUM_PARTS, added in chunk order
    (((p0 + p1) + p2) + ...) or in the fixed binary tree (IS_TREE; NUM_PARTS a power of two);
    masked lanes give zeros."""
    total = tl.load(parts_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
    # The tree's waiting subtrees (tree_push); each is written before it is read.
    s0 = total
    s1 = total
    s2 = total
    s3 = total
    if IS_TREE:
        total, s0, s1, s2, s3 = tree_push(total, s0, s1, s2, s3, 0, NUM_PARTS)
    for c in tl.static_range(1, NUM_PARTS):
        part = tl.load(
            parts_ptr + c * part_elems + offs, mask=mask, other=0.0, cache_modifier=".cg"
        )
        if IS_TREE:
            total, s0, s1, s2, s3 = tree_push(part, s0, s1, s2, s3, c, NUM_PARTS)
        else:
            total = total + part
    return total
