"""The wide attention launch's split kernel in Gluon (GPU only, sm90): 64 heads of one query
against one KV split of its latent cache, written with explicit Hopper layouts.

Why Gluon: in `tl.dot` a score product whose result feeds another dot gets every warp along M,
so with 8 warps both warpgroups computed the whole 64 x 64 score tile (BENCHMARKS.md, tenth and
eleventh sessions). Here the score tile is split over the two warpgroups by key columns and the
64 x 512 value accumulator by value columns, the cache blocks are copied into shared memory by
TMA (two stages, an mbarrier each; a block's copy is issued as soon as its stage is free, when
every warp's value MMA of the block two before it is done, its table entry read a block
earlier), and the probabilities reach the value MMA through shared memory. The warpgroups
exchange their row maxima once a block through a [64, 2] tile and keep the row sums of their
own keys (added at the end), so a block costs three barriers (nine in the first form,
BENCHMARKS.md). Its partials feed the Triton merge kernel (moe_kernels/triton_attention.py).
Nothing a program computes depends on other queries or on the heads next to its own, so the
bits hold across batches, chunkings and TP head subsets.
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
# heads a program on two warpgroups; other shapes take the Triton kernel.
GLUON_SHAPE = dict(cache_dim=576, v_dim=512, block_size=64, block_h=64, num_warps=8)


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


@gluon.jit
def _copy_block(lat_desc, pe_desc, block_id, lat_smem, pe_smem, bar,
                BS: gl.constexpr, V: gl.constexpr, R: gl.constexpr):  # fmt: skip
    """Issue the TMA copies of cache block block_id (its latent and rope parts) into one
    pipeline stage, completing on bar. Rows past the query's position arrive as they are in
    the cache: the kernel masks their scores and zeroes their value rows."""
    row = (block_id * BS).to(gl.int32)
    mbarrier.expect(bar, BS * (V + R) * 2)
    tma.async_copy_global_to_shared(lat_desc, [row, 0], bar, lat_smem)
    tma.async_copy_global_to_shared(pe_desc, [row, V], bar, pe_smem)


@gluon.jit
def _tile_offsets(num_ok, BLOCK_H: gl.constexpr, V: gl.constexpr, L: gl.constexpr):
    """(offsets, rows < num_ok) of a row-major [BLOCK_H, V] fp32 tile in layout L."""
    rows = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, L))
    cols = gl.arange(0, V, layout=gl.SliceLayout(0, L))
    return rows[:, None] * V + cols[None, :], (rows < num_ok)[:, None]


@gluon.jit
def _fold_parked(done_ptr, part_ptr, out_ptr, alpha, row_sum, num_ok,
                 BLOCK_H: gl.constexpr, V: gl.constexpr, IS_LAST: gl.constexpr,
                 num_warps: gl.constexpr):  # fmt: skip
    """The merge kernel's fold of a finished split into the parked running one, 64 value
    columns at a time: done = fma(done, alpha, part) with part = acc * beta already rounded
    and parked (the merge's `part_acc * beta`); IS_LAST: done / row_sum into the output
    instead (the merge's final division), rows from num_ok on (heads past the rank's)
    untouched. Pointers: row 0, column 0 of each [BLOCK_H, V] tile."""
    L: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])
    rows = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, L))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
    ok = (rows < num_ok)[:, None]
    alpha = gl.convert_layout(alpha, gl.SliceLayout(1, L))[:, None]
    row_sum = gl.convert_layout(row_sum, gl.SliceLayout(1, L))[:, None]
    for c in gl.static_range(0, V, 64):
        offs = rows[:, None] * V + c + cols[None, :]
        done = gl.fma(gl.load(done_ptr + offs, mask=ok), alpha, gl.load(part_ptr + offs, mask=ok))
        if IS_LAST:
            gl.store(out_ptr + offs, (done / row_sum).to(out_ptr.dtype.element_ty), mask=ok)
        else:
            gl.store(done_ptr + offs, done, mask=ok)


@gluon.jit
def _fold_split(done_max, done_sum, row_max, row_sum, acc, done_slot, part_slot, dest, heads_ok,
                BLOCK_H: gl.constexpr, V: gl.constexpr, S_L: gl.constexpr, O_L: gl.constexpr,
                IS_LAST: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """Fold a finished split (row_max, row_sum, acc) into the parked running one with the merge
    kernel's arithmetic (_fold_weights, moe_kernels/triton_attention_block.py, restated: a Gluon
    kernel cannot call a Triton function; the same bits checked on the GPU): its acc * beta
    parked in part_slot, the fold into done_slot, or IS_LAST divided into dest. Returns the
    new (done_max, done_sum)."""
    max_new = gl.maximum(done_max, row_max)
    alpha = gl.exp(done_max - max_new)
    beta = gl.exp(row_max - max_new)
    done_sum = gl.fma(done_sum, alpha, row_sum * beta)
    beta_o = gl.convert_layout(beta, gl.SliceLayout(1, O_L))
    local, head_ok = _tile_offsets(heads_ok, BLOCK_H, V, O_L)
    gl.store(part_slot + local, acc * beta_o[:, None], mask=head_ok)
    gl.thread_barrier()  # the parked part is in place for every thread
    _fold_parked(
        done_slot, part_slot, dest, alpha, done_sum, heads_ok, BLOCK_H, V, IS_LAST, num_warps
    )  # fmt: skip
    return max_new, done_sum


@gluon.jit(do_not_specialize=["num_splits", "table_width"])
def _mla_wide_split_kernel(
    q_desc, q_pe_desc, lat_desc, pe_desc, seq_ids_ptr, tables_ptr, positions_ptr, acc_ptr,
    stats_ptr, out_ptr, scale, num_heads, num_splits, table_width,
    C: gl.constexpr, V: gl.constexpr, R: gl.constexpr, BS: gl.constexpr,
    BLOCK_H: gl.constexpr, SPLIT_BLOCKS: gl.constexpr, TAIL_BLOCKS: gl.constexpr,
    WRITE_OUT: gl.constexpr, WHOLE_QUERY: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """_mla_split_kernel's contract (moe_kernels/triton_attention.py) for one (head block of 64,
    query, KV split): partial (max, sum, acc) of the split's cache blocks in order, an online
    softmax in fp32 per block of BS positions; WRITE_OUT: acc / sum into out_ptr (the
    launch's one split). Each warpgroup sums the probabilities of its own keys; the two
    sums are added once, at the end. The query (rows of q viewed [T * H, C]) and the cache
    (rows of [blocks * BS, C]) arrive through TMA descriptors of 64-row boxes.

    WHOLE_QUERY (grid axis 2 of size 1, acc_ptr / stats_ptr two fp32 slots a query and head
    block, out_ptr the output): the program walks every split of its query, each from a fresh
    state as above, and folds them in split order with the merge kernel's arithmetic, the
    running fold parked in slot 0 and each finished split's acc * beta in slot 1 (written and
    read back by this program, so mostly in L2): the bits of the split launch and its merge
    without the merge launch or the partials' trip through HBM."""
    DTYPE: gl.constexpr = gl.bfloat16  # fits_gluon's one dtype
    # Zeroing the unwritten value rows of a query's last block, [BS, 64] at a time.
    ZERO_L: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
    # Why [4, 2] for both products: each warpgroup takes half of the keys of the scores and
    # half of the value columns of the accumulator, so no product is computed twice.
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]
    )
    O_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]
    )
    # A [BLOCK_H, 2] tile of per-warpgroup row values (column w: warpgroup w's keys) in which
    # every thread holds both columns of the rows it holds in S_L: one exchange of the row
    # maxima through shared memory, one barrier.
    BOTH_L: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [8, 0]],
        lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0], [0, 0]],
        block_bases=[],
        shape=[BLOCK_H, 2],
    )
    LAT_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, V], DTYPE)
    PE_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], DTYPE)
    P_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BS], DTYPE)
    HALF: gl.constexpr = BS // 2  # one warpgroup's keys of a block

    head_block = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    split = gl.program_id(2)
    position = gl.load(positions_ptr + t)
    first_block = split * SPLIT_BLOCKS
    num_blocks = position // BS + 1
    # The query's own splits (split_count, moe_kernels/attention_launch.py): runs of SPLIT_BLOCKS
    # from block 0, the last one taking up to TAIL_BLOCKS blocks more. Split k > 0 exists
    # where k * SPLIT_BLOCKS + TAIL_BLOCKS < num_blocks. (A whole-query program, split 0,
    # always runs: its test left as it was, which ptxas fits in registers; the split
    # launch's form spills 32 bytes there, sm_90 offline compile.)
    has_split = first_block < num_blocks
    if not WHOLE_QUERY:
        has_split = first_block < gl.maximum(num_blocks - TAIL_BLOCKS, 1)
    if has_split:
        seq = gl.load(seq_ids_ptr + t)
        if WHOLE_QUERY:
            last_block = num_blocks
        else:  # the query's last split runs to its last block
            is_last_split = first_block + SPLIT_BLOCKS + TAIL_BLOCKS >= num_blocks
            last_block = gl.where(is_last_split, num_blocks, first_block + SPLIT_BLOCKS)
        table = tables_ptr + seq * table_width
        q_lat_s = gl.allocate_shared_memory(DTYPE, [BLOCK_H, V], LAT_S)
        q_pe_s = gl.allocate_shared_memory(DTYPE, [BLOCK_H, R], PE_S)
        k_lat_s = gl.allocate_shared_memory(DTYPE, [2, BS, V], LAT_S)
        k_pe_s = gl.allocate_shared_memory(DTYPE, [2, BS, R], PE_S)
        p_s = gl.allocate_shared_memory(DTYPE, [BLOCK_H, BS], P_S)
        max_s = gl.allocate_shared_memory(
            gl.float32, [BLOCK_H, 2], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        )
        # Barriers 0 and 1: the two cache stages; 2: the query.
        bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(3):
            mbarrier.init(bars.index(b), count=1)
        fence_async_shared()
        # A head block past the rank's heads copies the next query's rows (or TMA's zeros
        # past the end): each row is its own head, and those rows are never stored.
        first_head = (t * num_heads + head_block * BLOCK_H).to(gl.int32)
        mbarrier.expect(bars.index(2), BLOCK_H * (V + R) * 2)
        tma.async_copy_global_to_shared(q_desc, [first_head, 0], bars.index(2), q_lat_s)
        tma.async_copy_global_to_shared(q_pe_desc, [first_head, V], bars.index(2), q_pe_s)
        # Why both stages at once: each block's copy is issued as soon as its stage is free
        # (the value MMA of the block two before it is done), so while a block is computed
        # the next one is already in flight.
        for b in gl.static_range(2):
            if first_block + b < last_block:
                _copy_block(
                    lat_desc, pe_desc, gl.load(table + first_block + b), k_lat_s.index(b),
                    k_pe_s.index(b), bars.index(b), BS, V, R,
                )  # fmt: skip
        # Why read ahead: the table read's latency is spent while blocks are computed.
        next_id = gl.load(table + gl.minimum(first_block + 2, last_block - 1))
        mbarrier.wait(bars.index(2), 0)

        row_max = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        no_scores = gl.zeros([BLOCK_H, BS], gl.float32, layout=S_L)
        # [BLOCK_H, 2]: each warpgroup's running sum of its keys' probabilities (the layout
        # of a block's per-warpgroup sums).
        row_sums = gl.sum(gl.reshape(no_scores, [BLOCK_H, 2, HALF]), axis=2)
        acc = gl.zeros([BLOCK_H, V], gl.float32, layout=O_L)
        offs_s = gl.arange(0, BS, layout=gl.SliceLayout(0, S_L))
        zero_rows = gl.arange(0, BS, layout=gl.SliceLayout(1, ZERO_L))
        # WHOLE_QUERY: the parked fold's slots and its running max and sum.
        heads_ok = num_heads - head_block * BLOCK_H
        done_slot = acc_ptr + ((t * 2) * num_heads + head_block * BLOCK_H) * V
        part_slot = acc_ptr + ((t * 2 + 1) * num_heads + head_block * BLOCK_H) * V
        done_max = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        done_sum = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
        # Why one order: block j of the sequence, whole, merged in order j ascending.
        for j in range(first_block, last_block):
            # A split starts at every SPLIT_BLOCKS-th block but inside the last split's tail.
            is_split_start = (j % SPLIT_BLOCKS == 0) and (j > 0) and (j + TAIL_BLOCKS < last_block)
            if WHOLE_QUERY and is_split_start:
                # A split ends: fold it in as the merge kernel would, then a fresh state.
                row_sum = gl.convert_layout(gl.sum(row_sums, axis=1), gl.SliceLayout(1, S_L))
                if j == SPLIT_BLOCKS:  # the first split: taken as it is
                    local, head_ok = _tile_offsets(heads_ok, BLOCK_H, V, O_L)
                    gl.store(done_slot + local, acc, mask=head_ok)
                    done_max, done_sum = row_max, row_sum
                else:
                    done_max, done_sum = _fold_split(
                        done_max, done_sum, row_max, row_sum, acc, done_slot, part_slot,
                        done_slot, heads_ok, BLOCK_H, V, S_L, O_L, False, num_warps,
                    )  # fmt: skip
                row_max = gl.full(
                    [BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L)
                )  # fmt: skip
                row_sums = gl.sum(gl.reshape(no_scores, [BLOCK_H, 2, HALF]), axis=2)
                acc = gl.zeros([BLOCK_H, V], gl.float32, layout=O_L)
            i = (j - first_block).to(gl.int32)
            stage = i % 2
            mbarrier.wait(bars.index(stage), (i // 2) & 1)  # block j has landed
            k_lat = k_lat_s.index(stage)
            scores = warpgroup_mma(
                q_pe_s, k_pe_s.index(stage).permute((1, 0)), no_scores, use_acc=False,
                is_async=True,
            )  # fmt: skip
            scores = warpgroup_mma(q_lat_s, k_lat.permute((1, 0)), scores, is_async=True)
            scores = warpgroup_mma_wait(num_outstanding=0, deps=(scores,))
            kv_ok = (j * BS + offs_s) <= position
            scores = gl.where(kv_ok[None, :], scores * scale, float("-inf"))
            max_s.store(gl.max(gl.reshape(scores, [BLOCK_H, 2, HALF]), axis=2))
            gl.thread_barrier()  # both warpgroups' maxima are in max_s, their scores done
            num_ok = position - j * BS + 1
            if num_ok < BS:
                # The query's last block: its rows past the position came as they are in
                # the cache (an unwritten slot may hold a NaN, and 0 x NaN is a NaN).
                for c in gl.static_range(0, V, 64):
                    piece = k_lat.slice(c, 64, dim=1)
                    keep = (zero_rows < num_ok)[:, None]
                    piece.store(gl.where(keep, piece.load(ZERO_L), 0.0))
            block_max = gl.max(max_s.load(BOTH_L), axis=1)
            max_new = gl.maximum(row_max, gl.convert_layout(block_max, gl.SliceLayout(1, S_L)))
            alpha = gl.exp(row_max - max_new)
            p = gl.exp(scores - max_new[:, None])
            alpha_2 = gl.convert_layout(alpha, gl.SliceLayout(1, row_sums.type.layout))
            row_sums = row_sums * alpha_2[:, None] + gl.sum(
                gl.reshape(p, [BLOCK_H, 2, HALF]), axis=2
            )  # fmt: skip
            row_max = max_new
            p_s.store(p.to(DTYPE))
            fence_async_shared()
            gl.thread_barrier()  # both warpgroups' probabilities (and zeroed rows) are in place
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_L))
            acc = warpgroup_mma(p_s, k_lat, acc * alpha_o[:, None], is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            # This stage's last reader, every warp's value MMA, is done: block j + 2's copy.
            gl.thread_barrier()
            if j + 2 < last_block:
                _copy_block(
                    lat_desc, pe_desc, next_id, k_lat, k_pe_s.index(stage), bars.index(stage),
                    BS, V, R,
                )  # fmt: skip
                next_id = gl.load(table + gl.minimum(j + 3, last_block - 1))
        row_sum = gl.convert_layout(gl.sum(row_sums, axis=1), gl.SliceLayout(1, S_L))
        heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
        cols = gl.arange(0, V, layout=gl.SliceLayout(0, O_L))
        head_ok = (heads < num_heads)[:, None]
        if WHOLE_QUERY and num_blocks > SPLIT_BLOCKS + TAIL_BLOCKS:  # two splits or more
            # The last split: folded in as above, and the fold divided into the output.
            first_out = out_ptr + (t * num_heads + head_block * BLOCK_H) * V
            _fold_split(
                done_max, done_sum, row_max, row_sum, acc, done_slot, part_slot, first_out,
                heads_ok, BLOCK_H, V, S_L, O_L, True, num_warps,
            )  # fmt: skip
        elif WRITE_OUT or WHOLE_QUERY:
            # The merge kernel's one-split case, the same fp32 division: the same bits.
            out = acc / gl.convert_layout(row_sum, gl.SliceLayout(1, O_L))[:, None]
            gl.store(
                out_ptr + (t * num_heads + heads)[:, None] * V + cols[None, :],
                out.to(out_ptr.dtype.element_ty), mask=head_ok,
            )  # fmt: skip
        else:
            slot = (t * num_splits + split) * num_heads + heads
            gl.store(acc_ptr + slot[:, None] * V + cols[None, :], acc, mask=head_ok)
            heads_s = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_L))
            slot_s = (t * num_splits + split) * num_heads + heads_s
            stats_ok = heads_s < num_heads
            gl.store(stats_ptr + slot_s * 2, row_max, mask=stats_ok)
            gl.store(stats_ptr + slot_s * 2 + 1, row_sum, mask=stats_ok)


def launch_wide_split(
    grid, q, kv_cache, seq_ids, block_tables, positions, acc, stats, out, scale, num_splits,
    split_blocks, tail_blocks, is_direct, is_whole_query=False,
) -> None:  # fmt: skip
    """One launch of the Gluon split kernel over `grid` (head blocks, queries, splits) into
    the split buffers acc / stats (or the output out, is_direct), as _attend launches the
    Triton one; is_whole_query: a program a query's head block (grid axis 2 of size 1), acc
    its two parked fp32 slots [queries, 2, heads, V], the result in out. The query and the
    cache reach it through TMA descriptors (64-row boxes of the latent's and the rope's
    columns)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    num_tokens, num_heads, cache_dim = q.shape
    v_dim = GLUON_SHAPE["v_dim"]
    rope = cache_dim - v_dim
    q_rows = q.reshape(num_tokens * num_heads, cache_dim)
    if q_rows.data_ptr() % 16:  # TMA reads from 16-byte aligned addresses
        q_rows = q_rows.clone()
    cache_rows = kv_cache.reshape(-1, cache_dim)
    if cache_rows.data_ptr() % 16:
        raise ValueError(
            f"the KV cache at {cache_rows.data_ptr():#x} is not 16-byte aligned (TMA needs it)"
        )
    lat_layout = gl.NVMMASharedLayout.get_default_for([64, v_dim], gl.bfloat16)
    pe_layout = gl.NVMMASharedLayout.get_default_for([64, rope], gl.bfloat16)
    _mla_wide_split_kernel[grid](
        TensorDescriptor.from_tensor(q_rows, [64, v_dim], lat_layout),
        TensorDescriptor.from_tensor(q_rows, [64, rope], pe_layout),
        TensorDescriptor.from_tensor(cache_rows, [64, v_dim], lat_layout),
        TensorDescriptor.from_tensor(cache_rows, [64, rope], pe_layout),
        seq_ids, block_tables, positions, acc, stats, out,
        scale, num_heads, num_splits, block_tables.shape[1],
        C=cache_dim, V=v_dim, R=rope, BS=GLUON_SHAPE["block_size"],
        BLOCK_H=GLUON_SHAPE["block_h"], SPLIT_BLOCKS=split_blocks, TAIL_BLOCKS=tail_blocks,
        WRITE_OUT=is_direct and not is_whole_query, WHOLE_QUERY=is_whole_query,
        num_warps=GLUON_SHAPE["num_warps"],
    )  # fmt: skip
