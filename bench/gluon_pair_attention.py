"""A design measured, not used by the runtime: the 128-head split attention kernel with cache
blocks taken in pairs, both warp-specialised partitions computing a score tile at once
(FlashMLA's schedule), timed against the kernel (moe_kernels/gluon_attention.py) and FlashMLA
on the H200 (BENCHMARKS.md, thirty-first session). The step after bench/gluon_ws_attention.py,
whose owner of a block computed its scores while the other partition waited, so one score
product ran at a time.

Blocks 2k and 2k + 1 of a split form pair k: partition 0 computes block 2k's 64 x 64 score tile
from stage 0 while partition 1 computes block 2k + 1's from stage 1. They swap block maxima
through shared memory (each then runs the same max chain, one 64-key online-softmax step a
block), each writes its block's probabilities over its block's rope rows (read only by the
score product, done by then), and each multiplies both blocks' probabilities into its half of
the 512 value columns. A stage arrives and is released in three parts (latent columns 0-255,
256-511, rope), each with its own mbarriers: the latent halves are freed by the one partition
whose value product reads them last, the rope part (holding the probabilities) by both, and a
one-warp loader refills each part as it frees, so the next pair's score products (latent halves
first, the rope part last) start while the rest of the copy is in flight. Each partition sums
the probabilities of its own blocks; the two sums are added at the end. Its bits are its own.

    python bench/gluon_pair_attention.py                 # GPU: checks, then the timing table
    python bench/gluon_pair_attention.py --compile-only  # any machine: sm_90 compile, ptxas -v
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gluon_ws_attention import (  # noqa: E402
    BLOCK_H,
    BS,
    CONSUMER_REGS,
    LOADER_REGS,
    MAXNREG,
    R,
    V,
    _descriptors,
    check,
    compile_sm90,
    timing,
)

# A stage's parts, each with a ready and a free mbarrier at index part * 2 + stage.
LO = gl.constexpr(0)
HI = gl.constexpr(1)
PE = gl.constexpr(2)


@gluon.jit
def _copy_part(tile_desc, block_id, part: gl.constexpr, smem, ready, stage: gl.constexpr):
    """TMA copies of one part (LO, HI: a latent half, four 64-column tiles; PE: the rope
    columns, one) of cache block block_id into smem, each tile completing on its own ready
    barrier (tile * 2 + stage; tiles 0-3 LO, 4-7 HI, 8 the rope), so the score product can
    start on a part's first tile while the rest is in flight."""
    row = (block_id * BS).to(gl.int32)
    if part == PE:
        bar = ready.index(8 * 2 + stage)
        mbarrier.expect(bar, BS * R * 2)
        tma.async_copy_global_to_shared(tile_desc, [row, V], bar, smem)
    else:
        for c in gl.static_range(4):
            bar = ready.index((part * 4 + c) * 2 + stage)
            mbarrier.expect(bar, BS * 64 * 2)
            tma.async_copy_global_to_shared(
                tile_desc, [row, part * (V // 2) + c * 64], bar, smem.slice(c * 64, 64, dim=1)
            )  # fmt: skip


@gluon.jit
def _score_part(q_part, k_part, ready, part: gl.constexpr, stage: gl.constexpr, phase, sc,
                use_acc: gl.constexpr):  # fmt: skip
    """Issue a part's share of the score product, each 64-column tile as it lands."""
    if part == PE:
        mbarrier.wait(ready.index(8 * 2 + stage), phase)
        sc = warpgroup_mma(
            q_part, k_part.index(stage).permute((1, 0)), sc, use_acc=use_acc, is_async=True
        )  # fmt: skip
    else:
        for c in gl.static_range(4):
            mbarrier.wait(ready.index((part * 4 + c) * 2 + stage), phase)
            q_tile = q_part.slice(c * 64, 64, dim=1)
            k_tile = k_part.index(stage).slice(c * 64, 64, dim=1).permute((1, 0))
            if c == 0:
                sc = warpgroup_mma(q_tile, k_tile, sc, use_acc=use_acc, is_async=True)
            else:
                sc = warpgroup_mma(q_tile, k_tile, sc, is_async=True)
    return sc


@gluon.jit
def _block_scores(W: gl.constexpr, smem, ready, phase, j, position, scale, S_L: gl.constexpr):
    """Block j's scaled 64 x 64 score tile from stage W, keys past the position at -inf, its
    parts in the order the pair before frees them: partition 0 the rope part, columns 0-255
    (its own value half), 256-511; partition 1 columns 256-511 (its own), 0-255, the rope."""
    q_lo_s, q_hi_s, q_pe_s, k_lo_s, k_hi_s, k_pe_s, p_s, mx_s, l_s = smem
    q_parts = (q_lo_s, q_hi_s, q_pe_s)
    k_parts = (k_lo_s, k_hi_s, k_pe_s)
    sc = gl.zeros([BLOCK_H, BS], gl.float32, layout=S_L)
    if W == 0:
        sc = _score_part(q_parts[PE], k_parts[PE], ready, PE, 0, phase, sc, False)
        sc = _score_part(q_parts[LO], k_parts[LO], ready, LO, 0, phase, sc, True)
        sc = _score_part(q_parts[HI], k_parts[HI], ready, HI, 0, phase, sc, True)
    else:
        sc = _score_part(q_parts[HI], k_parts[HI], ready, HI, 1, phase, sc, False)
        sc = _score_part(q_parts[LO], k_parts[LO], ready, LO, 1, phase, sc, True)
        sc = _score_part(q_parts[PE], k_parts[PE], ready, PE, 1, phase, sc, True)
    sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
    kv_ok = (j * BS + gl.arange(0, BS, layout=gl.SliceLayout(0, S_L))) <= position
    return gl.where(kv_ok[None, :], sc * scale, float("-inf"))


@gluon.jit
def _publish(buf, bar, values):
    """Store this partition's values into buf, then one arrive on bar once every thread's
    store has landed (generic and async proxies: the value products read probabilities)."""
    buf.store(values)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _zero_tail(W: gl.constexpr, smem, j, position):
    """If block j (stage W) is the query's last, zero its value rows past the position (an
    unwritten slot may hold a NaN, and 0 x NaN is a NaN) before any value product reads
    them."""
    q_lo_s, q_hi_s, q_pe_s, k_lo_s, k_hi_s, k_pe_s, p_s, mx_s, l_s = smem
    ZERO_L: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    num_ok = position - j * BS + 1
    if num_ok < BS:
        keep = (gl.arange(0, BS, layout=gl.SliceLayout(1, ZERO_L)) < num_ok)[:, None]
        for c in gl.static_range(0, V // 2, 64):
            piece = k_lo_s.index(W).slice(c, 64, dim=1)
            piece.store(gl.where(keep, piece.load(ZERO_L), 0.0))
            piece = k_hi_s.index(W).slice(c, 64, dim=1)
            piece.store(gl.where(keep, piece.load(ZERO_L), 0.0))
        fence_async_shared()
        gl.thread_barrier()


@gluon.jit
def _own_value_product(p16, v_smem, acc, free_bar, P_L: gl.constexpr):
    """acc + p16 (this partition's block's probabilities, from registers) x v_smem, then the
    release of v_smem's half of the stage."""
    acc = warpgroup_mma(gl.convert_layout(p16, P_L), v_smem, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    gl.thread_barrier()
    mbarrier.arrive(free_bar, count=1)
    return acc


@gluon.jit
def _consumer(W: gl.constexpr, smem, bars, scal, ptrs, WRITE_OUT: gl.constexpr):
    """Partition W: the scores of block 2k + W of every pair k (stage W) and its softmax step;
    its own block's probabilities (from registers) and then the other's (from shared memory)
    times value columns [256 W, 256 W + 256); then its half of the output (WRITE_OUT) or of the
    split's partial acc, and (W = 0) the partial's max and sum.

    The max chain runs m -> m_a (block 2k) -> m_b (block 2k + 1), as a block-by-block online
    softmax would, but partition 0 multiplies block 2k's probabilities into its half at once
    (scaled to m_a) and gives partition 1 them rescaled to m_b, so it never waits for block
    2k + 1's scores before its own value product; partition 1 scales its half to m_b once."""
    q_lo_s, q_hi_s, q_pe_s, k_lo_s, k_hi_s, k_pe_s, p_s, mx_s, l_s = smem
    q_bar, ready, free, mx_bar, p_bar, l_bar = bars
    table, position, first_block, n, t, head_block, split, num_heads, num_splits, scale = scal
    acc_ptr, stats_ptr, out_ptr = ptrs
    HV: gl.constexpr = V // 2
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]
    )
    O_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]
    )
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, S_L)
    OROW: gl.constexpr = gl.SliceLayout(1, O_L)
    mbarrier.wait(q_bar, 0)
    m_run = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=ROW)
    l_own = gl.zeros([BLOCK_H], gl.float32, layout=ROW)  # this partition's blocks' sums
    acc = gl.zeros([BLOCK_H, HV], gl.float32, layout=O_L)
    for k in range((n + 1) // 2):
        phase = k & 1
        has_b = 2 * k + 1 < n
        j = first_block + 2 * k + W
        if W == 0:
            sc = _block_scores(0, smem, ready, phase, j, position, scale, S_L)
            gl.thread_barrier()  # the rope part's last reader was the score product
            mbarrier.arrive(free.index(PE * 2 + 0), count=1)
            mx = gl.max(sc, axis=1)
            _publish(mx_s[0], mx_bar.index(0), mx)
            m_a = gl.maximum(m_run, mx)
            alpha_a = gl.exp(m_run - m_a)
            p = gl.exp(sc - m_a[:, None])
            l_own = l_own * alpha_a + gl.sum(p, axis=1)
            acc = acc * gl.convert_layout(alpha_a, OROW)[:, None]
            _zero_tail(0, smem, j, position)
            p16 = p.to(gl.bfloat16)
            acc = warpgroup_mma(gl.convert_layout(p16, P_L), k_lo_s.index(0), acc, is_async=True)
            m_b = m_a
            if has_b:
                mbarrier.wait(mx_bar.index(1), phase)
                m_b = gl.maximum(m_a, mx_s[1].load(ROW))
            alpha_b = gl.exp(m_a - m_b)
            if has_b:  # block 2k's probabilities for partition 1, rescaled to m_b
                p16 = (p * alpha_b[:, None]).to(gl.bfloat16)
            _publish(p_s, p_bar.index(0), p16)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            mbarrier.arrive(free.index(LO * 2 + 0), count=1)
            if has_b:  # block 2k + 1's probabilities (at m_b) from shared memory
                l_own = l_own * alpha_b
                acc = acc * gl.convert_layout(alpha_b, OROW)[:, None]
                mbarrier.wait(p_bar.index(1), phase)
                acc = warpgroup_mma(k_pe_s.index(1), k_lo_s.index(1), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                gl.thread_barrier()
                mbarrier.arrive(free.index(LO * 2 + 1), count=1)
                mbarrier.arrive(free.index(PE * 2 + 1), count=1)
        else:
            if has_b:
                sc = _block_scores(1, smem, ready, phase, j, position, scale, S_L)
                mx = gl.max(sc, axis=1)
                _publish(mx_s[1], mx_bar.index(1), mx)
                mbarrier.wait(mx_bar.index(0), phase)
                m_a = gl.maximum(m_run, mx_s[0].load(ROW))
                m_b = gl.maximum(m_a, mx)
                alpha = gl.exp(m_run - m_a) * gl.exp(m_a - m_b)
                p = gl.exp(sc - m_b[:, None])
                l_own = l_own * alpha + gl.sum(p, axis=1)
                acc = acc * gl.convert_layout(alpha, OROW)[:, None]
                _zero_tail(1, smem, j, position)
                p16 = p.to(gl.bfloat16)
                _publish(k_pe_s.index(1), p_bar.index(1), p16)  # over the rope rows
                acc = _own_value_product(p16, k_hi_s.index(1), acc, free.index(HI * 2 + 1), P_L)
            else:  # a last pair of one block
                mbarrier.wait(mx_bar.index(0), phase)
                m_a = gl.maximum(m_run, mx_s[0].load(ROW))
                m_b = m_a
                alpha = gl.exp(m_run - m_a)
                l_own = l_own * alpha
                acc = acc * gl.convert_layout(alpha, OROW)[:, None]
            # Block 2k's probabilities (at m_b) from shared memory.
            mbarrier.wait(p_bar.index(0), phase)
            acc = warpgroup_mma(p_s, k_hi_s.index(0), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            mbarrier.arrive(free.index(HI * 2 + 0), count=1)
        m_run = m_b
    if n > 0:
        # Each partition's sum of its blocks' probabilities, added in one order by both.
        _publish(l_s[W], l_bar.index(W), l_own)
        mbarrier.wait(l_bar.index(1 - W), 0)
        l_run = l_s[0].load(ROW) + l_s[1].load(ROW)
        heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=OROW)
        cols = W * HV + gl.arange(0, HV, layout=gl.SliceLayout(0, O_L))
        head_ok = (heads < num_heads)[:, None]
        if WRITE_OUT:
            out = acc / gl.convert_layout(l_run, OROW)[:, None]
            gl.store(
                out_ptr + (t * num_heads + heads)[:, None] * V + cols[None, :],
                out.to(out_ptr.dtype.element_ty), mask=head_ok,
            )  # fmt: skip
        else:
            slot = (t * num_splits + split) * num_heads + heads
            gl.store(acc_ptr + slot[:, None] * V + cols[None, :], acc, mask=head_ok)
            if W == 0:
                heads_s = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW)
                slot_s = (t * num_splits + split) * num_heads + heads_s
                stats_ok = heads_s < num_heads
                gl.store(stats_ptr + slot_s * 2, m_run, mask=stats_ok)
                gl.store(stats_ptr + slot_s * 2 + 1, l_run, mask=stats_ok)


# Why four wrappers: WRITE_OUT must be a constexpr inside the partition (Gluon passes
# constexprs through gl.warp_specialize as tensors).
@gluon.jit
def _consumer_0_out(smem, bars, descs, scal, ptrs):
    _consumer(0, smem, bars, scal, ptrs, True)


@gluon.jit
def _consumer_1_out(smem, bars, descs, scal, ptrs):
    _consumer(1, smem, bars, scal, ptrs, True)


@gluon.jit
def _consumer_0_part(smem, bars, descs, scal, ptrs):
    _consumer(0, smem, bars, scal, ptrs, False)


@gluon.jit
def _consumer_1_part(smem, bars, descs, scal, ptrs):
    _consumer(1, smem, bars, scal, ptrs, False)


@gluon.jit
def _refill(lat_desc, pe_desc, block_id, part: gl.constexpr, stage: gl.constexpr, phase, smem,
            ready, free):  # fmt: skip
    """Wait until the pair before has released (part, stage), then copy block_id's part."""
    q_lo_s, q_hi_s, q_pe_s, k_lo_s, k_hi_s, k_pe_s, p_s, mx_s, l_s = smem
    mbarrier.wait(free.index(part * 2 + stage), phase)
    dest = (k_lo_s, k_hi_s, k_pe_s)[part].index(stage)
    _copy_part(pe_desc, block_id, part, dest, ready, stage)


@gluon.jit
def _loader(smem, bars, descs, scal, ptrs):
    """Pairs 1 .. of the split: each part of each stage copied as the pair before releases it,
    in the order they free (stage 0's rope part after its scores, each partition's own value
    half after its first value product, then partition 0's second, then partition 1's), the
    pair's table entries read before the waits."""
    q_bar, ready, free, mx_bar, p_bar, l_bar = bars
    lat_desc, pe_desc = descs
    table, position, first_block, n, t, head_block, split, num_heads, num_splits, scale = scal
    last = first_block + n - 1
    for k in range(1, (n + 1) // 2):
        phase = (k - 1) & 1
        a = first_block + 2 * k
        has_b = 2 * k + 1 < n
        a_id = gl.load(table + a)
        b_id = gl.load(table + gl.minimum(a + 1, last))
        _refill(lat_desc, pe_desc, a_id, PE, 0, phase, smem, ready, free)
        _refill(lat_desc, pe_desc, a_id, LO, 0, phase, smem, ready, free)
        if has_b:
            _refill(lat_desc, pe_desc, b_id, HI, 1, phase, smem, ready, free)
            _refill(lat_desc, pe_desc, b_id, LO, 1, phase, smem, ready, free)
            _refill(lat_desc, pe_desc, b_id, PE, 1, phase, smem, ready, free)
        _refill(lat_desc, pe_desc, a_id, HI, 0, phase, smem, ready, free)


@gluon.jit(do_not_specialize=["num_splits", "table_width"])
def _mla_pair_split_kernel(
    q_desc, q_pe_desc, lat_desc, pe_desc, seq_ids_ptr, tables_ptr, positions_ptr, acc_ptr,
    stats_ptr, out_ptr, scale, num_heads, num_splits, table_width,
    SPLIT_BLOCKS: gl.constexpr, TAIL_BLOCKS: gl.constexpr, WRITE_OUT: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """The split launch's contract of _mla_wide_split_kernel (moe_kernels/gluon_attention.py,
    without its whole-query form). Shared memory: the query (72 KB), two cache-block stages
    (144 KB; each block's probabilities over its rope rows), the exchanged maxima and sums."""
    lat_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, V // 2], gl.bfloat16)
    pe_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], gl.bfloat16)
    vec_s: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    head_block = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    split = gl.program_id(2)
    position = gl.load(positions_ptr + t)
    first_block = split * SPLIT_BLOCKS
    num_blocks = position // BS + 1
    has_split = first_block < gl.maximum(num_blocks - TAIL_BLOCKS, 1)
    is_last_split = first_block + SPLIT_BLOCKS + TAIL_BLOCKS >= num_blocks
    last_block = gl.where(is_last_split, num_blocks, first_block + SPLIT_BLOCKS)
    n = gl.where(has_split, last_block - first_block, 0).to(gl.int32)
    table = tables_ptr + gl.load(seq_ids_ptr + t) * table_width
    q_lo_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, V // 2], lat_s)
    q_hi_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, V // 2], lat_s)
    q_pe_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, R], pe_s)
    k_lo_s = gl.allocate_shared_memory(gl.bfloat16, [2, BS, V // 2], lat_s)
    k_hi_s = gl.allocate_shared_memory(gl.bfloat16, [2, BS, V // 2], lat_s)
    k_pe_s = gl.allocate_shared_memory(gl.bfloat16, [2, BS, R], pe_s)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BS], pe_s)  # partition 0's
    # (Pairs of rank-1 buffers: a [2, N] buffer's .index() failed in Gluon 3.6.)
    mx_s = (gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_s),
            gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_s))  # fmt: skip
    l_s = (gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_s),
           gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_s))  # fmt: skip
    # ready: tile * 2 + stage (_copy_part); free: part * 2 + stage (arrays of a power-of-two
    # length).
    ready = gl.allocate_shared_memory(gl.int64, [32, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [8, 1], mbarrier.MBarrierLayout())
    mx_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    l_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    for b in gl.static_range(18):
        mbarrier.init(ready.index(b), count=1)
    for b in gl.static_range(6):
        # Every part is released by the one partition whose value product reads it last (the
        # score product before it is done by then; the rope part holds the probabilities).
        mbarrier.init(free.index(b), count=1)
    for b in gl.static_range(2):
        mbarrier.init(mx_bar.index(b), count=1)
        mbarrier.init(p_bar.index(b), count=1)
        mbarrier.init(l_bar.index(b), count=1)
    mbarrier.init(q_bar, count=1)
    fence_async_shared()
    first_head = (t * num_heads + head_block * BLOCK_H).to(gl.int32)
    mbarrier.expect(q_bar, BLOCK_H * (V + R) * 2)
    tma.async_copy_global_to_shared(q_desc, [first_head, 0], q_bar, q_lo_s)
    tma.async_copy_global_to_shared(q_desc, [first_head, V // 2], q_bar, q_hi_s)
    tma.async_copy_global_to_shared(q_pe_desc, [first_head, V], q_bar, q_pe_s)
    for b in gl.static_range(2):
        if b < n:
            block_id = gl.load(table + first_block + b)
            _copy_part(pe_desc, block_id, LO, k_lo_s.index(b), ready, b)
            _copy_part(pe_desc, block_id, HI, k_hi_s.index(b), ready, b)
            _copy_part(pe_desc, block_id, PE, k_pe_s.index(b), ready, b)
    smem = (q_lo_s, q_hi_s, q_pe_s, k_lo_s, k_hi_s, k_pe_s, p_s, mx_s, l_s)
    scal = (table, position, first_block, n, t, head_block, split, num_heads, num_splits, scale)
    bars = (q_bar, ready, free, mx_bar, p_bar, l_bar)
    args = (smem, bars, (lat_desc, pe_desc), scal, (acc_ptr, stats_ptr, out_ptr))
    if WRITE_OUT:
        gl.warp_specialize(
            [(_consumer_0_out, args), (_consumer_1_out, args), (_loader, args)], [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [(_consumer_0_part, args), (_consumer_1_part, args), (_loader, args)], [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )  # fmt: skip


def launch_pair_split(
    grid, q, kv_cache, seq_ids, block_tables, positions, acc, stats, out, scale, num_splits,
    split_blocks, tail_blocks, is_direct, is_whole_query=False,
) -> None:  # fmt: skip
    """launch_wide_split's signature (moe_kernels/gluon_attention.py), its split launch only."""
    if is_whole_query:
        raise ValueError("the paired form has no whole-query launch")
    _mla_pair_split_kernel[grid](
        *_descriptors(q, kv_cache), seq_ids, block_tables, positions, acc, stats, out, scale,
        q.shape[1], num_splits, block_tables.shape[1], SPLIT_BLOCKS=split_blocks,
        TAIL_BLOCKS=tail_blocks, WRITE_OUT=is_direct, num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="sm_90 compile, no GPU")
    if parser.parse_args().compile_only:
        for write_out in (False, True):
            shared, used = compile_sm90(write_out, _mla_pair_split_kernel)
            print(f"WRITE_OUT={write_out}: shared {shared} bytes; {used}")
        return
    torch.cuda.init()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {triton.__version__}")  # fmt: skip
    check(launch_pair_split, "paired")
    timing(launch_pair_split, "paired")


if __name__ == "__main__":
    main()
