"""The wide attention launch's split kernel in Gluon (GPU only, sm90): 64 heads of one query
against its latent cache, warp-specialised as FlashMLA divides the work.

Why Gluon: in `tl.dot` a score product whose result feeds another dot gets every warp along M,
so with 8 warps both warpgroups computed the whole 64 x 64 score tile (BENCHMARKS.md, tenth and
eleventh sessions). Here two 4-warp partitions take a split's cache blocks in pairs: partition 0
computes block 2k's 64 x 64 score tile while partition 1 computes block 2k + 1's, so two score
products run at once; they swap block maxima through shared memory and take one online-softmax
step for the pair; each multiplies its own block's probabilities (from registers) and then the
other's (from shared memory) into its half of the 512 value columns. A one-warp loader refills
the two cache-block stages part by part (latent columns 0-255, 256-511, the rope; each part in
64-column TMA tiles with a barrier each) as the pair before releases them, so the next scores
start on a part's first tile. The score tile's 576-long sums run in a fixed order for each
block parity (partition 0: rope, 0-255, 256-511; partition 1: 256-511, 0-255, rope); each
partition sums its own blocks' probabilities and the two sums are added at the end. A query
of one split has its output written here; longer ones' partials feed the Triton merge kernel
(moe_kernels/triton_attention.py). Nothing a program computes depends on other
queries or on the heads next to its own, so the bits hold across batches, chunkings and TP head
subsets. H200, 128 heads (BENCHMARKS.md, thirty-first session): 0.84-0.92x the time of the
kernel before it (two warpgroups splitting each score tile by key columns).

A launch of few queries may split each partition's 256 value columns over two programs
(V_PARTS, attention_launch.wide_value_parts): each still computes every score of its head
block, the same products, so the same probabilities; its value products run at N = 128 on
a slice of the stage, and a warpgroup MMA gives each column the same bits at N = 64, 128 and
256 (bench/wgmma_width_probe.py, H100), so the choice may follow the batch. It fills more SMs,
not a shorter walk: each program still waits on every block's copy in turn.

The softmax runs in base 2 (the scale times log2(e) folded into one multiply-add before
exp2; the split's max converted back to natural log for the merge), and the kernel's
mbarriers each have their own allocation and are signalled by zero-byte expects: Triton's
barrier analysis put a CTA barrier before every wait on an element of a barrier array and
after every arrive, 16-20 a pair of blocks in each partition where the protocol needs 4-5.
Together 2-4% faster at 128 heads (H100, BENCHMARKS.md, fifty-sixth session); the base-2
softmax changed the bits (batch invariance holds as before), the barriers none.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# The one shape it serves: DeepSeek's MLA latent (512 + 64 rope), cache blocks of 64, 64
# heads a program (num_warps: the first partition's; the launch has 4 + 4 + 1); other shapes
# take the Triton kernel.
GLUON_SHAPE = dict(cache_dim=576, v_dim=512, block_size=64, block_h=64, num_warps=4)


def fits_gluon(q: torch.Tensor, kv_cache: torch.Tensor, v_dim: int, block_h: int) -> bool:
    """Whether the Gluon split kernel serves this call: a Hopper GPU (its warpgroup MMAs are
    sm_90's), bf16 (the model's 16-bit dtype, the one run on the GPU), the MLA shape.
    Elsewhere the Triton kernel of the same launch runs."""
    return (
        q.is_cuda
        and torch.cuda.get_device_capability(q.device)[0] == 9
        and q.dtype == torch.bfloat16
        and q.shape[2] == GLUON_SHAPE["cache_dim"]
        and v_dim == GLUON_SHAPE["v_dim"]
        and kv_cache.shape[1] == GLUON_SHAPE["block_size"]
        and block_h == GLUON_SHAPE["block_h"]
    )


# The shape as module-level constexprs: constexpr arguments passed through gl.warp_specialize
# reach the partitions as tensors (Gluon, triton 3.6).
BS = gl.constexpr(GLUON_SHAPE["block_size"])
V = gl.constexpr(GLUON_SHAPE["v_dim"])
R = gl.constexpr(GLUON_SHAPE["cache_dim"] - GLUON_SHAPE["v_dim"])
HALF = gl.constexpr(GLUON_SHAPE["v_dim"] // 2)  # a partition's value columns
BLOCK_H = gl.constexpr(GLUON_SHAPE["block_h"])
# A cache-block stage's parts (the latent halves freed by free[LO | HI][stage]).
LO = gl.constexpr(0)
HI = gl.constexpr(1)
PE = gl.constexpr(2)
# Registers a thread of partition 1 and of the loader; partition 0 gets the rest of the 168 x
# 384 the launch's maxnreg gives (256): the split that left the fewest spills (sm_90 compile).
CONSUMER_REGS = gl.constexpr(224)
# The value splits the kernel has (each partition's 256 columns over this many programs).
WIDE_VALUE_PARTS = (1, 2)
LOADER_REGS = gl.constexpr(24)
MAXNREG = 168


@gluon.jit
def _split_range(
    split, position, SPLIT_BLOCKS: gl.constexpr, TAIL_BLOCKS: gl.constexpr,
    LONG_BLOCKS: gl.constexpr, LONG_SPLIT_BLOCKS: gl.constexpr,
):  # fmt: skip
    """(first block, blocks) of KV split `split` of a query at `position`: the query's own
    splits (split_count, moe_kernels/attention_launch.py) are runs of its split size
    (SPLIT_BLOCKS; LONG_SPLIT_BLOCKS from LONG_BLOCKS blocks, 0: never: query_split_blocks)
    from block 0, the last one taking up to TAIL_BLOCKS blocks more; split k > 0 exists where
    k * size + TAIL_BLOCKS < its blocks (0 blocks otherwise)."""
    num_blocks = position // BS + 1
    if LONG_BLOCKS > 0:
        split_blocks = gl.where(num_blocks >= LONG_BLOCKS, LONG_SPLIT_BLOCKS, SPLIT_BLOCKS)
    else:
        split_blocks = SPLIT_BLOCKS
    first_block = split * split_blocks
    has_split = first_block < gl.maximum(num_blocks - TAIL_BLOCKS, 1)
    is_last_split = first_block + split_blocks + TAIL_BLOCKS >= num_blocks
    last_block = gl.where(is_last_split, num_blocks, first_block + split_blocks)
    return first_block, gl.where(has_split, last_block - first_block, 0).to(gl.int32)


@gluon.jit
def _copy_part(tile_desc, block_id, part: gl.constexpr, smem, ready, stage: gl.constexpr):
    """TMA copies of one part (LO, HI: a latent half, four 64-column tiles; PE: the rope
    columns, one tile) of cache block block_id into smem, each tile completing on its own ready
    barrier (ready[part][tile][stage]; the rope part one tile), so a score product starts
    on a part's first tile while the rest is in flight. Rows past the query's position arrive
    as they are in the cache: their scores are masked and their value rows zeroed."""
    row = (block_id * BS).to(gl.int32)
    if part == PE:
        bar = ready[PE][0][stage]
        mbarrier.expect(bar, BS * R * 2)
        tma.async_copy_global_to_shared(tile_desc, [row, V], bar, smem)
    else:
        for c in gl.static_range(4):
            bar = ready[part][c][stage]
            mbarrier.expect(bar, BS * 64 * 2)
            tma.async_copy_global_to_shared(
                tile_desc, [row, part * HALF + c * 64], bar, smem.slice(c * 64, 64, dim=1)
            )  # fmt: skip


@gluon.jit
def _score_part(q_part, k_part, ready, part: gl.constexpr, stage: gl.constexpr, phase, sc,
                use_acc: gl.constexpr):  # fmt: skip
    """Issue a part's share of a score product, each 64-column tile as it lands."""
    if part == PE:
        mbarrier.wait(ready[PE][0][stage], phase)
        sc = warpgroup_mma(
            q_part, k_part.index(stage).permute((1, 0)), sc, use_acc=use_acc, is_async=True
        )  # fmt: skip
    else:
        for c in gl.static_range(4):
            mbarrier.wait(ready[part][c][stage], phase)
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
    return gl.where(kv_ok[None, :], sc, float("-inf"))


@gluon.jit
def _signal(bar):
    """One arrive on bar, written as an expect of 0 bytes: the same PTX arrive (with
    release semantics), which Triton's barrier analysis does not take for a write to all of
    shared memory, as it takes mbarrier.arrive (a CTA barrier before the next shared memory
    access after every one of those)."""
    mbarrier.expect(bar, 0)


@gluon.jit
def _publish(buf, bar, values):
    """Store this partition's values into buf, then one arrive on bar once every thread's
    store has landed (generic and async proxies: the value products read probabilities)."""
    buf.store(values)
    fence_async_shared()
    gl.thread_barrier()
    _signal(bar)


@gluon.jit
def _publish_probs(W: gl.constexpr, smem, p_bar, p, j, position):
    """Block j's probabilities for the other partition (partition 0's in their own buffer, so
    stage 0's rope part frees once its scores are done; partition 1's over stage 1's rope
    rows), its value rows past the position zeroed first if it is the query's last block (an
    unwritten slot may hold a NaN, and 0 x NaN is a NaN)."""
    q_lo_s, q_hi_s, q_pe_s, k_lo_s, k_hi_s, k_pe_s, p_s, mx_s, l_s = smem
    ZERO_L: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    num_ok = position - j * BS + 1
    if num_ok < BS:
        keep = (gl.arange(0, BS, layout=gl.SliceLayout(1, ZERO_L)) < num_ok)[:, None]
        for c in gl.static_range(0, HALF, 64):
            piece = k_lo_s.index(W).slice(c, 64, dim=1)
            piece.store(gl.where(keep, piece.load(ZERO_L), 0.0))
            piece = k_hi_s.index(W).slice(c, 64, dim=1)
            piece.store(gl.where(keep, piece.load(ZERO_L), 0.0))
    _publish((p_s, k_pe_s.index(1))[W], p_bar[W], p)


@gluon.jit
def _write_half(W: gl.constexpr, acc, m_run, l_run, position, first_block, n, t, head_block,
                split, num_heads, num_splits, ptrs, WRITE_OUT: gl.constexpr, vp):  # fmt: skip
    """Partition W's value columns of a finished split (acc, [BLOCK_H, HALF / V_PARTS] fp32,
    value part vp of its half; the split's max and sum m_run, l_run): acc / l_run into the
    output where the launch has one split (WRITE_OUT) or the query has one, the merge kernel's
    one-split case, the same fp32 division, so the same bits (the merge skips such queries:
    ONE_SPLIT_WRITTEN); else the split's partial acc and (W = 0, value part 0) its max and
    sum."""
    acc_ptr, stats_ptr, out_ptr = ptrs
    OROW: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    ROW: gl.constexpr = m_run.type.layout
    heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=OROW)
    part_cols: gl.constexpr = acc.type.shape[1]
    cols = W * HALF + vp * part_cols
    cols = cols + gl.arange(0, part_cols, layout=gl.SliceLayout(0, acc.type.layout))
    head_ok = (heads < num_heads)[:, None]
    is_one_split = (first_block == 0) & (n == position // BS + 1)
    if WRITE_OUT or is_one_split:
        out = acc / gl.convert_layout(l_run, OROW)[:, None]
        gl.store(
            out_ptr + (t * num_heads + heads)[:, None] * V + cols[None, :],
            out.to(out_ptr.dtype.element_ty), mask=head_ok,
        )  # fmt: skip
    else:
        slot = (t * num_splits + split) * num_heads + heads
        gl.store(acc_ptr + slot[:, None] * V + cols[None, :], acc, mask=head_ok)
        if W == 0 and vp == 0:
            heads_s = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW)
            slot_s = (t * num_splits + split) * num_heads + heads_s
            stats_ok = heads_s < num_heads
            gl.store(stats_ptr + slot_s * 2, m_run, mask=stats_ok)
            gl.store(stats_ptr + slot_s * 2 + 1, l_run, mask=stats_ok)


@gluon.jit
def _value_product(p, values, acc, vp, V_PARTS: gl.constexpr):
    """acc + p @ values' columns of value part vp (of V_PARTS: each a slice of the half's
    256 columns, taken in a static branch as a slice's start must be a constant); one MMA,
    waited for."""
    if V_PARTS == 1:
        acc = warpgroup_mma(p, values, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    else:
        width: gl.constexpr = HALF // V_PARTS
        for part in gl.static_range(V_PARTS):
            if vp == part:
                acc = warpgroup_mma(
                    p, values.slice(part * width, width, dim=1), acc, is_async=True
                )  # fmt: skip
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return acc


@gluon.jit
def _consumer(W: gl.constexpr, smem, bars, scal, ptrs, WRITE_OUT: gl.constexpr,
              V_PARTS: gl.constexpr):  # fmt: skip
    """Partition W: for each pair k of the split's blocks, the scores of block 2k + W (stage
    W), the pair's softmax step (one max for both blocks: the online softmax steps a pair at a
    time), its own block's probabilities (from registers) and then the other's (from shared
    memory) times value columns [256 W, 256 W + 256), or the program's value part vp of them
    (V_PARTS > 1: every score still computed, the same sums a column). Each partition sums its
    own blocks' probabilities; the split's sum is their sum, partition 0's first. Then its
    columns of the output (WRITE_OUT) or of the split's partial acc, and (W = 0) the partial's
    max and sum."""
    q_lo_s, q_hi_s, q_pe_s, k_lo_s, k_hi_s, k_pe_s, p_s, mx_s, l_s = smem
    q_bar, ready, free, mx_bar, p_bar, l_bar = bars
    table, position, first_block, n, t, head_block, split, num_heads, num_splits, scale, vp = scal
    scale = scale * 1.4426950408889634  # base 2: log2(e) folded in
    MY_HALF: gl.constexpr = LO if W == 0 else HI  # this partition's value columns
    PART: gl.constexpr = HALF // V_PARTS  # the value columns it keeps
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]
    )
    O_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, PART, 16]
    )
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, S_L)
    OROW: gl.constexpr = gl.SliceLayout(1, O_L)
    k_half = (k_lo_s, k_hi_s)[W]
    m_run = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=ROW)
    l_own = gl.zeros([BLOCK_H], gl.float32, layout=ROW)
    acc = gl.zeros([BLOCK_H, PART], gl.float32, layout=O_L)
    if n > 0:
        mbarrier.wait(q_bar, 0)
    for k in range((n + 1) // 2):
        phase = k & 1
        has_b = 2 * k + 1 < n
        is_owner = (W == 0) | has_b  # partition 1 owns no block in a last pair of one
        j = first_block + 2 * k + W
        if is_owner:
            sc = _block_scores(W, smem, ready, phase, j, position, scale, S_L)
            mx = gl.max(sc, axis=1) * scale
            _publish(mx_s[W], mx_bar[W], mx)
        else:
            sc = gl.full([BLOCK_H, BS], float("-inf"), gl.float32, layout=S_L)
            mx = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=ROW)
        # The pair's max: the same values in both partitions.
        if W == 0:
            m_new = gl.maximum(m_run, mx)
            if has_b:
                mbarrier.wait(mx_bar[1], phase)
                m_new = gl.maximum(m_new, mx_s[1].load(ROW))
        else:
            mbarrier.wait(mx_bar[0], phase)
            m_new = gl.maximum(gl.maximum(m_run, mx_s[0].load(ROW)), mx)
        alpha = gl.exp2(m_run - m_new)
        l_own = l_own * alpha
        acc = acc * gl.convert_layout(alpha, OROW)[:, None]
        if is_owner:
            p = gl.exp2(sc * scale - m_new[:, None])
            l_own = l_own + gl.sum(p, axis=1)
            p16 = p.to(gl.bfloat16)
            _publish_probs(W, smem, p_bar, p16, j, position)
            # Own block: probabilities from registers; then this half of the stage frees.
            acc = _value_product(gl.convert_layout(p16, P_L), k_half.index(W), acc, vp, V_PARTS)
            gl.thread_barrier()
            _signal(free[MY_HALF][W])
        if W == 1 or has_b:  # the other partition's block: probabilities from shared memory
            mbarrier.wait(p_bar[1 - W], phase)
            other_p = (k_pe_s.index(1), p_s)[W]
            acc = _value_product(other_p, k_half.index(1 - W), acc, vp, V_PARTS)
            gl.thread_barrier()
            _signal(free[MY_HALF][1 - W])
        m_run = m_new
    if n > 0:
        # The split's sum: both partitions' sums, added in one order by both.
        _publish(l_s[W], l_bar[W], l_own)
        mbarrier.wait(l_bar[1 - W], 0)
        l_run = l_s[0].load(ROW) + l_s[1].load(ROW)
        m_run = m_run * 0.6931471805599453  # the merge's natural-log max
        _write_half(
            W, acc, m_run, l_run, position, first_block, n, t, head_block, split, num_heads,
            num_splits, ptrs, WRITE_OUT, vp,
        )  # fmt: skip


# Why wrappers: W, WRITE_OUT and V_PARTS must be constexprs inside a partition
# (gl.warp_specialize passes constexpr arguments on as tensors in Gluon 3.6). Named
# _consumer_{W}_{partial | out}_{V_PARTS}.
@gluon.jit
def _consumer_0_partial_1(smem, bars, descs, scal, ptrs):
    _consumer(0, smem, bars, scal, ptrs, False, 1)


@gluon.jit
def _consumer_1_partial_1(smem, bars, descs, scal, ptrs):
    _consumer(1, smem, bars, scal, ptrs, False, 1)


@gluon.jit
def _consumer_0_out_1(smem, bars, descs, scal, ptrs):
    _consumer(0, smem, bars, scal, ptrs, True, 1)


@gluon.jit
def _consumer_1_out_1(smem, bars, descs, scal, ptrs):
    _consumer(1, smem, bars, scal, ptrs, True, 1)


@gluon.jit
def _consumer_0_partial_2(smem, bars, descs, scal, ptrs):
    _consumer(0, smem, bars, scal, ptrs, False, 2)


@gluon.jit
def _consumer_1_partial_2(smem, bars, descs, scal, ptrs):
    _consumer(1, smem, bars, scal, ptrs, False, 2)


@gluon.jit
def _consumer_0_out_2(smem, bars, descs, scal, ptrs):
    _consumer(0, smem, bars, scal, ptrs, True, 2)


@gluon.jit
def _consumer_1_out_2(smem, bars, descs, scal, ptrs):
    _consumer(1, smem, bars, scal, ptrs, True, 2)


@gluon.jit
def _refill(tile_desc, block_id, part: gl.constexpr, stage: gl.constexpr, phase, smem, ready,
            bar):  # fmt: skip
    """Wait until the pair before has released (part, stage), then copy block_id's part."""
    q_lo_s, q_hi_s, q_pe_s, k_lo_s, k_hi_s, k_pe_s, p_s, mx_s, l_s = smem
    mbarrier.wait(bar, phase)  # the barrier that releases (part, stage)
    _copy_part(tile_desc, block_id, part, (k_lo_s, k_hi_s, k_pe_s)[part].index(stage), ready, stage)


@gluon.jit
def _loader(smem, bars, descs, scal, ptrs):
    """Pairs 1 .. of the split (the first is copied before the partitions start): each part of
    each stage copied as the pair before releases it, in the order they free (stage 0's rope
    part after its scores, each partition's own value half after its first value product,
    then partition 0's second, then partition 1's), the pair's table entries read before the
    waits."""
    q_bar, ready, free, mx_bar, p_bar, l_bar = bars
    table, position, first_block, n, t, head_block, split, num_heads, num_splits, scale, vp = scal
    tile_desc = descs
    for k in range(1, (n + 1) // 2):
        phase = (k - 1) & 1
        a = first_block + 2 * k
        has_b = 2 * k + 1 < n
        a_id = gl.load(table + a)
        b_id = gl.load(table + gl.minimum(a + 1, first_block + n - 1))
        # Stage 0's rope part frees with partition 0's max (its scores were its last reader),
        # stage 1's with partition 0's second value product (partition 1's probabilities lay
        # over it), as stage 1's first half does.
        _refill(tile_desc, a_id, PE, 0, phase, smem, ready, mx_bar[0])
        _refill(tile_desc, a_id, LO, 0, phase, smem, ready, free[LO][0])
        if has_b:
            _refill(tile_desc, b_id, HI, 1, phase, smem, ready, free[HI][1])
            _refill(tile_desc, b_id, LO, 1, phase, smem, ready, free[LO][1])
            _refill(tile_desc, b_id, PE, 1, phase, smem, ready, free[LO][1])
        _refill(tile_desc, a_id, HI, 0, phase, smem, ready, free[HI][0])


@gluon.jit
def _barrier():
    """One mbarrier in its own allocation: Triton's barrier analysis (membar) takes a wait on
    one element of a barrier array for an access to all of it and put a CTA barrier before
    every wait (9 a block in each partition, on the ready tiles)."""
    return gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)


@gluon.jit
def _barrier_pair():
    """Two mbarriers, a stage each (_barrier)."""
    return (_barrier(), _barrier())


@gluon.jit
def _tile_barriers():
    """A latent half's four 64-column tiles' ready barriers, [tile][stage]."""
    return (_barrier_pair(), _barrier_pair(), _barrier_pair(), _barrier_pair())


@gluon.jit(do_not_specialize=["num_splits", "table_width"])
def _mla_wide_split_kernel(
    q_desc, q_pe_desc, tile_desc, seq_ids_ptr, tables_ptr, positions_ptr, acc_ptr, stats_ptr,
    out_ptr, scale, num_heads, num_splits, table_width,
    SPLIT_BLOCKS: gl.constexpr, TAIL_BLOCKS: gl.constexpr, WRITE_OUT: gl.constexpr,
    V_PARTS: gl.constexpr, num_warps: gl.constexpr, LONG_BLOCKS: gl.constexpr = 0,
    LONG_SPLIT_BLOCKS: gl.constexpr = 0,
):  # fmt: skip
    """_mla_split_kernel's contract (moe_kernels/triton_attention.py) for one (head block of 64,
    query, KV split): the split's partial (max, sum, acc), an online softmax in fp32 a pair of
    cache blocks at a time; WRITE_OUT (the launch's one split), and for a query of one split
    in any launch: acc / sum into out_ptr. The
    query (rows of q viewed [T * H, 576]) arrives through TMA descriptors of its latent halves
    and rope part, the cache (rows of [blocks * BS, 576]) through one of 64 x 64 tiles.

    Shared memory: the query (72 KB), two cache-block stages (144 KB; partition 1's
    probabilities over stage 1's rope rows), partition 0's probabilities (8 KB), the exchanged
    maxima and sums: 226 KB of the 227 an H200 block may have."""
    lat_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, HALF], gl.bfloat16)
    pe_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], gl.bfloat16)
    vec_s: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    head_block = gl.program_id(0) // V_PARTS
    vp = gl.program_id(0) % V_PARTS  # the value part this program keeps
    t = gl.program_id(1).to(gl.int64)
    split = gl.program_id(2)
    position = gl.load(positions_ptr + t)
    first_block, n = _split_range(
        split, position, SPLIT_BLOCKS, TAIL_BLOCKS, LONG_BLOCKS, LONG_SPLIT_BLOCKS
    )  # fmt: skip
    table = tables_ptr + gl.load(seq_ids_ptr + t) * table_width
    q_lo_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, HALF], lat_s)
    q_hi_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, HALF], lat_s)
    q_pe_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, R], pe_s)
    k_lo_s = gl.allocate_shared_memory(gl.bfloat16, [2, BS, HALF], lat_s)
    k_hi_s = gl.allocate_shared_memory(gl.bfloat16, [2, BS, HALF], lat_s)
    k_pe_s = gl.allocate_shared_memory(gl.bfloat16, [2, BS, R], pe_s)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BS], pe_s)  # partition 0's
    # (Pairs of rank-1 buffers: a [2, N] buffer's .index() failed in Gluon 3.6.)
    mx_s = (gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_s),
            gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_s))  # fmt: skip
    l_s = (gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_s),
           gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_s))  # fmt: skip
    # ready[part][tile][stage] (_copy_part; the rope part one tile); free[LO | HI][stage]: a
    # latent half of a stage released by the one partition whose value product reads it last
    # (the score product before it is done by then); the rope parts free with mx_bar[0] and
    # free[LO][1] (_loader).
    ready = (_tile_barriers(), _tile_barriers(), (_barrier_pair(),))
    free = (_barrier_pair(), _barrier_pair())
    mx_bar = _barrier_pair()
    p_bar = _barrier_pair()
    l_bar = _barrier_pair()
    q_bar = _barrier()
    for b in gl.static_range(2):
        for c in gl.static_range(4):
            mbarrier.init(ready[LO][c][b], count=1)
            mbarrier.init(ready[HI][c][b], count=1)
        mbarrier.init(ready[PE][0][b], count=1)
        mbarrier.init(free[LO][b], count=1)
        mbarrier.init(free[HI][b], count=1)
        mbarrier.init(mx_bar[b], count=1)
        mbarrier.init(p_bar[b], count=1)
        mbarrier.init(l_bar[b], count=1)
    mbarrier.init(q_bar, count=1)
    fence_async_shared()
    if n > 0:
        # A head block past the rank's heads copies the next query's rows (or TMA's zeros
        # past the end): each row is its own head, and those rows are never stored.
        first_head = (t * num_heads + head_block * BLOCK_H).to(gl.int32)
        mbarrier.expect(q_bar, BLOCK_H * (V + R) * 2)
        tma.async_copy_global_to_shared(q_desc, [first_head, 0], q_bar, q_lo_s)
        tma.async_copy_global_to_shared(q_desc, [first_head, HALF], q_bar, q_hi_s)
        tma.async_copy_global_to_shared(q_pe_desc, [first_head, V], q_bar, q_pe_s)
        for b in gl.static_range(2):  # the first pair
            if b < n:
                block_id = gl.load(table + first_block + b)
                _copy_part(tile_desc, block_id, LO, k_lo_s.index(b), ready, b)
                _copy_part(tile_desc, block_id, HI, k_hi_s.index(b), ready, b)
                _copy_part(tile_desc, block_id, PE, k_pe_s.index(b), ready, b)
    smem = (q_lo_s, q_hi_s, q_pe_s, k_lo_s, k_hi_s, k_pe_s, p_s, mx_s, l_s)
    scal = (table, position, first_block, n, t, head_block, split, num_heads, num_splits, scale, vp)
    bars = (q_bar, ready, free, mx_bar, p_bar, l_bar)
    args = (smem, bars, tile_desc, scal, (acc_ptr, stats_ptr, out_ptr))
    if WRITE_OUT and V_PARTS == 1:
        gl.warp_specialize(
            [(_consumer_0_out_1, args), (_consumer_1_out_1, args), (_loader, args)],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )
    elif WRITE_OUT and V_PARTS == 2:
        gl.warp_specialize(
            [(_consumer_0_out_2, args), (_consumer_1_out_2, args), (_loader, args)],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )
    elif V_PARTS == 1:
        gl.warp_specialize(
            [(_consumer_0_partial_1, args), (_consumer_1_partial_1, args), (_loader, args)],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )
    elif V_PARTS == 2:
        gl.warp_specialize(
            [(_consumer_0_partial_2, args), (_consumer_1_partial_2, args), (_loader, args)],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )


def launch_wide_split(
    grid, q, kv_cache, seq_ids, block_tables, positions, acc, stats, out, scale, num_splits,
    split_blocks, tail_blocks, is_direct, v_parts=1, long_blocks=0, long_split_blocks=0,
) -> None:  # fmt: skip
    """One launch of the Gluon split kernel over `grid` (head blocks x v_parts, queries,
    splits) into the split buffers acc / stats (or the output out, is_direct), as _attend
    launches the Triton one; v_parts (1 or 2): programs a head block's value columns are
    split over (WIDE_VALUE_PARTS); long_blocks, long_split_blocks: HeadLaunch's. The query
    reaches it through TMA descriptors of 64-row boxes of its latent halves and rope part, the
    cache through one of 64 x 64 tiles."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if v_parts not in WIDE_VALUE_PARTS:
        raise ValueError(f"v_parts {v_parts} must be one of {WIDE_VALUE_PARTS}")
    for name, blocks in (("split_blocks", split_blocks), ("long_split_blocks", long_split_blocks)):
        if blocks % 2:
            raise ValueError(f"{name} {blocks} must be even (the kernel pairs blocks)")
    num_tokens, num_heads, cache_dim = q.shape
    q_rows = q.reshape(num_tokens * num_heads, cache_dim)
    if q_rows.data_ptr() % 16:  # TMA reads from 16-byte aligned addresses
        q_rows = q_rows.clone()
    cache_rows = kv_cache.reshape(-1, cache_dim)
    if cache_rows.data_ptr() % 16:
        raise ValueError(
            f"the KV cache at {cache_rows.data_ptr():#x} is not 16-byte aligned (TMA needs it)"
        )
    half_layout = gl.NVMMASharedLayout.get_default_for([64, HALF.value], gl.bfloat16)
    tile_layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    _mla_wide_split_kernel[grid](
        TensorDescriptor.from_tensor(q_rows, [64, HALF.value], half_layout),
        TensorDescriptor.from_tensor(q_rows, [64, 64], tile_layout),
        TensorDescriptor.from_tensor(cache_rows, [64, 64], tile_layout),
        seq_ids, block_tables, positions, acc, stats, out,
        scale, num_heads, num_splits, block_tables.shape[1],
        SPLIT_BLOCKS=split_blocks, TAIL_BLOCKS=tail_blocks, WRITE_OUT=is_direct,
        V_PARTS=v_parts, num_warps=GLUON_SHAPE["num_warps"], LONG_BLOCKS=long_blocks,
        LONG_SPLIT_BLOCKS=long_split_blocks, maxnreg=MAXNREG,
    )  # fmt: skip
