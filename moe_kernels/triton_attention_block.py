"""The arithmetic of the Triton MLA attention's launches (moe_kernels/triton_attention.py): one
cache block's online-softmax step, the query's load, the fold of a finished split into
the running one (split kernel, whole-query programs and merge kernel), and a program's walk
over a run of blocks (a split, a group of them, or the whole query).

A launch's bits are these functions' bits: a kernel that walks blocks or splits in another
order, or from another program, must call them, never restate them, so that each split's
(max, sum, acc) and each fold round alike in every launch. No launch choices live here.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _split_blocks_of(
    num_blocks, SPLIT_BLOCKS: tl.constexpr, LONG_BLOCKS: tl.constexpr,
    LONG_SPLIT_BLOCKS: tl.constexpr,
):  # fmt: skip
    """The cache blocks a KV split of a query of num_blocks blocks runs: SPLIT_BLOCKS,
    LONG_SPLIT_BLOCKS from LONG_BLOCKS blocks (0: never; then a constant). A function of the
    query's own block count only (query_split_blocks in moe_kernels/attention_launch.py,
    restated)."""
    if LONG_BLOCKS > 0:
        return tl.where(num_blocks >= LONG_BLOCKS, LONG_SPLIT_BLOCKS, SPLIT_BLOCKS)
    else:
        return SPLIT_BLOCKS


@triton.jit
def _own_splits(
    num_blocks, SPLIT_BLOCKS: tl.constexpr, TAIL_BLOCKS: tl.constexpr, LONG_BLOCKS: tl.constexpr,
    LONG_SPLIT_BLOCKS: tl.constexpr,
):  # fmt: skip
    """A query's KV splits: runs of its split size (_split_blocks_of) from block 0, the last
    one taking up to TAIL_BLOCKS blocks more (at least one split). A function of the query's
    own block count only (split_count in moe_kernels/attention_launch.py, restated)."""
    split_blocks = _split_blocks_of(num_blocks, SPLIT_BLOCKS, LONG_BLOCKS, LONG_SPLIT_BLOCKS)
    return tl.maximum((num_blocks - TAIL_BLOCKS + split_blocks - 1) // split_blocks, 1)


@triton.jit
def _starts_run(block, run_blocks, TAIL_BLOCKS: tl.constexpr, num_blocks):
    """Whether cache block `block` (> 0) starts a new run (a KV split, or a group of them) of
    a query of num_blocks blocks: runs of run_blocks from block 0, the last one taking up to
    TAIL_BLOCKS more (the rule _own_splits counts)."""
    return (block % run_blocks == 0) & (block + TAIL_BLOCKS < num_blocks)


@triton.jit
def _fold_weights(row_max, part_max, is_first):
    """(max, alpha, beta) of folding a split's (max, sum, acc) into the running one: the new
    sum is fma(sum, alpha, part_sum * beta), the new acc likewise. Why explicit fmas: the
    merge kernel and WHOLE_QUERY programs must round alike, not as each compile contracts.
    is_first: nothing folded yet; (0, 1) take the split exactly as it is."""
    max_new = tl.maximum(row_max, part_max)
    alpha = tl.where(is_first, 0.0, tl.exp(row_max - max_new))
    return max_new, alpha, tl.where(is_first, 1.0, tl.exp(part_max - max_new))


@triton.jit
def _fold(a_max, a_sum, a_acc, b_max, b_sum, b_acc, is_first, IS_ROWS: tl.constexpr):
    """Fold the state (b_max, b_sum, b_acc) into the running one (a_...) that comes before it
    in the order: (max, fma(a_sum, alpha, b_sum * beta), the acc likewise), alpha and beta
    from _fold_weights (is_first: take b as it is). IS_ROWS: [H] stats of a [H, V] acc (else
    scalar stats of a [V] acc). The one place every fold of a split or group is written."""
    max_new, alpha, beta = _fold_weights(a_max, b_max, is_first)
    if IS_ROWS:
        acc = tl.fma(a_acc, alpha[:, None], b_acc * beta[:, None])
    else:
        acc = tl.fma(a_acc, alpha, b_acc * beta)
    return max_new, tl.fma(a_sum, alpha, b_sum * beta), acc


@triton.jit
def _load_query(
    q_rows, head_ok, offs_v, v_ok, offs_r, r_ok, V, IS_WHOLE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """A query's (latent [BLOCK_H, BLOCK_V], rope [BLOCK_H, BLOCK_R]) parts, masked rows and
    columns zero, fp32 under the interpreter (UPCAST_DOT). Without IS_WHOLE `_attend_block`
    reads the latent in pieces per block: the rope part stands in for the unused latent."""
    if IS_WHOLE:
        q_lat = tl.load(q_rows + offs_v[None, :], mask=head_ok[:, None] & v_ok[None, :], other=0.0)
        if UPCAST_DOT:
            q_lat = q_lat.to(tl.float32)
    q_pe = tl.load(q_rows + V + offs_r[None, :], mask=head_ok[:, None] & r_ok[None, :], other=0.0)
    if UPCAST_DOT:
        q_pe = q_pe.to(tl.float32)
    if not IS_WHOLE:
        q_lat = q_pe
    return q_lat, q_pe


@triton.jit
def _attend_block(
    q_lat,
    q_pe,
    q_rows,
    kv_rows,
    kv_ok,
    head_ok,
    offs_pv,
    pv_ok,
    offs_r,
    r_ok,
    row_max,
    row_sum,
    acc,
    scale,
    V,
    C,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_V: tl.constexpr,
    LAT_CHUNK: tl.constexpr,
    IS_WHOLE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One cache block's step of the online softmax: (row_max, row_sum, acc) after the keys
    kv_rows [BLOCK_S rows of C] (kv_ok: the positions the query sees; the others read exact
    zeros and score -inf). IS_WHOLE: q_lat holds the whole latent and the block's latent is
    both keys and values; else the latent's dot in LAT_CHUNK-column pieces, ascending (a
    chained accumulator), the query's pieces re-read from q_rows (L1), and this program's
    value columns offs_pv read again (L1/L2: just loaded)."""
    k_pe = tl.load(kv_rows + V + offs_r[None, :], mask=kv_ok[:, None] & r_ok[None, :], other=0.0)
    if UPCAST_DOT:
        k_pe = k_pe.to(tl.float32)
    if IS_WHOLE:
        offs_v = tl.arange(0, BLOCK_V)
        k_lat = tl.load(
            kv_rows + offs_v[None, :], mask=kv_ok[:, None] & (offs_v < V)[None, :], other=0.0
        )
        if UPCAST_DOT:
            k_lat = k_lat.to(tl.float32)
        scores = tl.dot(q_lat, tl.trans(k_lat), input_precision=INPUT_PRECISION)
        v_rows = k_lat
    else:
        offs_c = tl.arange(0, LAT_CHUNK)
        scores = tl.zeros((BLOCK_H, BLOCK_S), dtype=tl.float32)
        for c in tl.static_range(BLOCK_V // LAT_CHUNK):
            cols = c * LAT_CHUNK + offs_c
            c_ok = cols < V
            q_c = tl.load(q_rows + cols[None, :], mask=head_ok[:, None] & c_ok[None, :], other=0.0)
            k_c = tl.load(kv_rows + cols[None, :], mask=kv_ok[:, None] & c_ok[None, :], other=0.0)
            if UPCAST_DOT:
                q_c = q_c.to(tl.float32)
                k_c = k_c.to(tl.float32)
            scores = tl.dot(q_c, tl.trans(k_c), scores, input_precision=INPUT_PRECISION)
        v_rows = tl.load(
            kv_rows + offs_pv[None, :], mask=kv_ok[:, None] & pv_ok[None, :], other=0.0
        )
        if UPCAST_DOT:
            v_rows = v_rows.to(tl.float32)
    scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=INPUT_PRECISION)
    scores = tl.where(kv_ok[None, :], scores * scale, float("-inf"))
    max_new = tl.maximum(row_max, tl.max(scores, axis=1))
    alpha = tl.exp(row_max - max_new)
    p = tl.exp(scores - max_new[:, None])
    row_sum = row_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v_rows.dtype), v_rows, input_precision=INPUT_PRECISION)
    return max_new, row_sum, acc


@triton.jit
def _walk_run(
    q_lat, q_pe, q_rows, kv_ptr, table_row, position, first_block, last_block, num_blocks,
    offs_s, head_ok, offs_pv, pv_ok, offs_r, r_ok, scale, V: tl.constexpr, C: tl.constexpr,
    BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_PV: tl.constexpr, LAT_CHUNK: tl.constexpr, IS_WHOLE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, SPLIT_BLOCKS: tl.constexpr,
    TAIL_BLOCKS: tl.constexpr, WHOLE_QUERY: tl.constexpr, TABLE_AHEAD: tl.constexpr,
    LONG_BLOCKS: tl.constexpr, LONG_SPLIT_BLOCKS: tl.constexpr,
):  # fmt: skip
    """(max, sum, acc) of a query's heads over its cache blocks first_block .. last_block - 1
    (a KV split; with WHOLE_QUERY a run of splits, each from a fresh state, folded in order:
    a group of them or the whole query). Its splits' size: _split_blocks_of."""
    split_blocks = _split_blocks_of(num_blocks, SPLIT_BLOCKS, LONG_BLOCKS, LONG_SPLIT_BLOCKS)
    row_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_PV), dtype=tl.float32)
    if WHOLE_QUERY:  # the splits folded so far (valid from the second split on)
        done_max, done_sum, done_acc = row_max, row_sum, acc
        group_first = first_block.to(tl.int64)  # the first block of the run
    # Why: chunk j is cache block j of the sequence, whole (BS positions, aligned to
    # absolute positions), merged in order j ascending; positions past the query read
    # exact zeros (unwritten slots may hold garbage) and score -inf.
    if TABLE_AHEAD:
        next_id = tl.load(table_row + first_block).to(tl.int64)
    for j in range(first_block, last_block):
        # A split starts at every SPLIT_BLOCKS-th block but inside the last split's tail.
        is_split_start = (j > first_block) & _starts_run(j, split_blocks, TAIL_BLOCKS, num_blocks)
        if WHOLE_QUERY and is_split_start:
            # Why one loop, not a loop over splits: the pipeliner keeps its copies in
            # flight across split boundaries. At a boundary the finished split is
            # folded in (the first one taken as it is) and a fresh state starts.
            is_first = j == group_first + split_blocks
            done_max, done_sum, done_acc = _fold(
                done_max, done_sum, done_acc, row_max, row_sum, acc, is_first, True
            )
            row_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
            row_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_H, BLOCK_PV), dtype=tl.float32)
        if TABLE_AHEAD:
            # Why the next entry read a block ahead: a copy whose address comes from a
            # load of the same iteration gets one buffer from the pipeliner; from the
            # loop-carried id it gets num_stages - 1 (BENCHMARKS.md).
            block_id = next_id
            next_id = tl.load(table_row + tl.minimum(j + 1, last_block - 1)).to(tl.int64)
        else:
            block_id = tl.load(table_row + j).to(tl.int64)
        kv_ok = (offs_s < BS) & (j * BS + offs_s <= position)
        kv_rows = kv_ptr + (block_id * BS + offs_s)[:, None] * C
        row_max, row_sum, acc = _attend_block(
            q_lat, q_pe, q_rows, kv_rows, kv_ok, head_ok, offs_pv, pv_ok, offs_r, r_ok,
            row_max, row_sum, acc, scale, V, C, BLOCK_H, BLOCK_S, BLOCK_V, LAT_CHUNK,
            IS_WHOLE, INPUT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
    if WHOLE_QUERY:  # the last split folded in (taken as it is if it is the only one)
        is_one_split = last_block <= group_first + split_blocks + TAIL_BLOCKS
        row_max, row_sum, acc = _fold(
            done_max, done_sum, done_acc, row_max, row_sum, acc, is_one_split, True
        )
    return row_max, row_sum, acc
