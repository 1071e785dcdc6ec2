"""A design measured, not used by the runtime: the thirtieth session's warp-specialised form of
the 128-head split attention kernel, timed against the runtime's kernel
(moe_kernels/gluon_attention.py) and FlashMLA on the H200 (BENCHMARKS.md, thirtieth session:
correct, level with the kernel of that session). The runtime's kernel took the next step (cache
blocks in pairs, both partitions computing scores at once: thirty-first session); this form is
kept so the thirtieth session's figures reproduce.

Two 4-warp partitions own alternate cache blocks: the owner computes the block's whole
64 x 64 score tile, its softmax step, and publishes the running max, sum and rescale (and the
probabilities) through shared memory behind an mbarrier; each partition multiplies every
block's probabilities into its half of the 512 value columns; a one-warp partition issues a
block's TMA copy once both partitions' value MMAs of the block two before it are done. Its
bits are its own (one 64-key softmax step a block, with other MMA shapes). Like the runtime's
kernel it writes a query of one split itself (the merge skips it).

    python bench/gluon_ws_attention.py                 # GPU: checks, then the timing table
    python bench/gluon_ws_attention.py --compile-only  # any machine: sm_90 compile, ptxas -v
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
from functools import partial
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

# The shape's module-level constexprs (constexprs passed through gl.warp_specialize reach the
# partitions as tensors), the loader's registers and the launch's maxnreg: the runtime kernel's.
from moe_kernels.gluon_attention import (  # noqa: E402
    BLOCK_H,
    BS,
    LOADER_REGS,
    MAXNREG,
    R,
    V,
    _split_range,
    _write_half,
)

# Registers a thread of the second consumer (the first gets the rest of the 168 x 384 the
# launch's maxnreg gives): 216 for a consumer spilled and ran 1.6x slower.
CONSUMER_REGS = gl.constexpr(232)
HALF_COLS, ROPE_COLS = V.value // 2, R.value  # the same, as host ints


@gluon.jit
def _copy_block(lat_desc, pe_desc, block_id, lo_smem, hi_smem, pe_smem, bar):
    """TMA copies of cache block block_id: latent halves and rope part, completing on bar.
    (Value halves are separate buffers: a wgmma operand sliced from a wider NVMMA buffer along
    N crashed the compiler's verifier.)"""
    row = (block_id * BS).to(gl.int32)
    mbarrier.expect(bar, BS * (V + R) * 2)
    tma.async_copy_global_to_shared(lat_desc, [row, 0], bar, lo_smem)
    tma.async_copy_global_to_shared(lat_desc, [row, V // 2], bar, hi_smem)
    tma.async_copy_global_to_shared(pe_desc, [row, V], bar, pe_smem)


@gluon.jit
def _consumer(W: gl.constexpr, smem, bars, scal, ptrs, WRITE_OUT: gl.constexpr):
    """Partition W: the scores and softmax step of blocks i with i % 2 == W, every block's
    probabilities times value columns [256 W, 256 W + 256); then its half of the output
    (WRITE_OUT) or of the split's partial acc, and (W = 0) the partial's max and sum."""
    q_lo_s, q_hi_s, q_pe_s, p_s, k_lo_s, k_hi_s, k_pe_s, m_s, l_s, a_s = smem
    q_bar, ready, free, stats_bar = bars
    table, position, first_block, n, t, head_block, split, num_heads, num_splits, scale = scal
    HV: gl.constexpr = V // 2
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]
    )
    O_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]
    )
    ROW: gl.constexpr = gl.SliceLayout(1, S_L)
    OROW: gl.constexpr = gl.SliceLayout(1, O_L)
    ZERO_L: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    mbarrier.wait(q_bar, 0)
    no_scores = gl.zeros([BLOCK_H, BS], gl.float32, layout=S_L)
    offs_s = gl.arange(0, BS, layout=gl.SliceLayout(0, S_L))
    zero_rows = gl.arange(0, BS, layout=gl.SliceLayout(1, ZERO_L))
    m_run = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=ROW)
    l_run = gl.zeros([BLOCK_H], gl.float32, layout=ROW)
    acc = gl.zeros([BLOCK_H, HV], gl.float32, layout=O_L)
    for i in range(n):
        j = first_block + i
        s = i % 2
        if s == W:  # this partition's block: its scores and softmax step
            mbarrier.wait(ready.index(s), (i // 2) & 1)
            sc = warpgroup_mma(
                q_pe_s, k_pe_s.index(s).permute((1, 0)), no_scores, use_acc=False, is_async=True
            )
            sc = warpgroup_mma(q_lo_s, k_lo_s.index(s).permute((1, 0)), sc, is_async=True)
            sc = warpgroup_mma(q_hi_s, k_hi_s.index(s).permute((1, 0)), sc, is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            kv_ok = (j * BS + offs_s) <= position
            sc = gl.where(kv_ok[None, :], sc * scale, float("-inf"))
            m_new = gl.maximum(m_run, gl.max(sc, axis=1))
            alpha = gl.exp(m_run - m_new)
            p = gl.exp(sc - m_new[:, None])
            l_run = l_run * alpha + gl.sum(p, axis=1)
            m_run = m_new
            num_ok = position - j * BS + 1
            if num_ok < BS:  # the query's last block: value rows past the position zeroed
                keep = (zero_rows < num_ok)[:, None]
                for c in gl.static_range(0, HV, 64):
                    piece = k_lo_s.index(s).slice(c, 64, dim=1)
                    piece.store(gl.where(keep, piece.load(ZERO_L), 0.0))
                    piece = k_hi_s.index(s).slice(c, 64, dim=1)
                    piece.store(gl.where(keep, piece.load(ZERO_L), 0.0))
            if i > 0:  # one probability buffer: both value MMAs of block i - 1 have read it
                mbarrier.wait(free.index(1 - s), ((i - 1) // 2) & 1)
            p_s.store(p.to(gl.bfloat16))
            m_s[W].store(m_run)
            l_s[W].store(l_run)
            a_s[W].store(alpha)
            fence_async_shared()
            gl.thread_barrier()  # every thread's stores land before the one arrive
            mbarrier.arrive(stats_bar, count=1)
        else:
            mbarrier.wait(stats_bar, i & 1)
            m_run = m_s[1 - W].load(ROW)
            l_run = l_s[1 - W].load(ROW)
            alpha = a_s[1 - W].load(ROW)
        acc = acc * gl.convert_layout(alpha, OROW)[:, None]
        acc = warpgroup_mma(p_s, (k_lo_s, k_hi_s)[W].index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(free.index(s), count=1)
    if n > 0:
        _write_half(
            W, acc, m_run, l_run, position, first_block, n, t, head_block, split, num_heads,
            num_splits, ptrs, WRITE_OUT, 0,  # one value part: the whole half
        )  # fmt: skip


# Why four wrappers: WRITE_OUT must be a constexpr inside the partition (see BS above).
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
def _loader(smem, bars, descs, scal, ptrs):
    """Blocks 2 .. n - 1 of the split: each copied into its stage once both partitions'
    value MMAs of the block two before it are done (the table entry read a block ahead)."""
    q_lo_s, q_hi_s, q_pe_s, p_s, k_lo_s, k_hi_s, k_pe_s, m_s, l_s, a_s = smem
    q_bar, ready, free, stats_bar = bars
    lat_desc, pe_desc = descs
    table, position, first_block, n, t, head_block, split, num_heads, num_splits, scale = scal
    next_id = gl.load(table + first_block + gl.minimum(2, gl.maximum(n - 1, 0)))
    for i in range(2, n):
        s = i % 2
        block_id = next_id
        next_id = gl.load(table + first_block + gl.minimum(i + 1, n - 1))
        mbarrier.wait(free.index(s), ((i - 2) // 2) & 1)
        _copy_block(
            lat_desc, pe_desc, block_id, k_lo_s.index(s), k_hi_s.index(s), k_pe_s.index(s),
            ready.index(s),
        )  # fmt: skip


@gluon.jit(do_not_specialize=["num_splits", "table_width"])
def _mla_ws_split_kernel(
    q_desc, q_pe_desc, lat_desc, pe_desc, seq_ids_ptr, tables_ptr, positions_ptr, acc_ptr,
    stats_ptr, out_ptr, scale, num_heads, num_splits, table_width,
    SPLIT_BLOCKS: gl.constexpr, TAIL_BLOCKS: gl.constexpr, WRITE_OUT: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """The contract of _mla_wide_split_kernel (moe_kernels/gluon_attention.py): a (head block,
    query, KV split) program's partial, or with WRITE_OUT (or a query of one split) the
    output. Shared memory: the query (72 KB), two cache-block stages (144 KB),
    one probability tile, the published stats."""
    lat_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, V // 2], gl.bfloat16)
    pe_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], gl.bfloat16)
    vec_s: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    head_block = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    split = gl.program_id(2)
    position = gl.load(positions_ptr + t)
    first_block, n = _split_range(split, position, SPLIT_BLOCKS, TAIL_BLOCKS, 0, 0)  # no long
    table = tables_ptr + gl.load(seq_ids_ptr + t) * table_width
    q_lo_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, V // 2], lat_s)
    q_hi_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, V // 2], lat_s)
    q_pe_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, R], pe_s)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BS], pe_s)
    k_lo_s = gl.allocate_shared_memory(gl.bfloat16, [2, BS, V // 2], lat_s)
    k_hi_s = gl.allocate_shared_memory(gl.bfloat16, [2, BS, V // 2], lat_s)
    k_pe_s = gl.allocate_shared_memory(gl.bfloat16, [2, BS, R], pe_s)
    m_s = (gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_s),
           gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_s))  # fmt: skip
    l_s = (gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_s),
           gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_s))  # fmt: skip
    a_s = (gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_s),
           gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_s))  # fmt: skip
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    misc = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_bar = misc.index(0)
    stats_bar = misc.index(1)
    for b in gl.static_range(2):
        mbarrier.init(ready.index(b), count=1)
        mbarrier.init(free.index(b), count=2)  # one arrive from each consumer
    mbarrier.init(q_bar, count=1)
    mbarrier.init(stats_bar, count=1)
    fence_async_shared()
    first_head = (t * num_heads + head_block * BLOCK_H).to(gl.int32)
    mbarrier.expect(q_bar, BLOCK_H * (V + R) * 2)
    tma.async_copy_global_to_shared(q_desc, [first_head, 0], q_bar, q_lo_s)
    tma.async_copy_global_to_shared(q_desc, [first_head, V // 2], q_bar, q_hi_s)
    tma.async_copy_global_to_shared(q_pe_desc, [first_head, V], q_bar, q_pe_s)
    for b in gl.static_range(2):
        if b < n:
            _copy_block(
                lat_desc, pe_desc, gl.load(table + first_block + b), k_lo_s.index(b),
                k_hi_s.index(b), k_pe_s.index(b), ready.index(b),
            )  # fmt: skip
    smem = (q_lo_s, q_hi_s, q_pe_s, p_s, k_lo_s, k_hi_s, k_pe_s, m_s, l_s, a_s)
    scal = (table, position, first_block, n, t, head_block, split, num_heads, num_splits, scale)
    args = (smem, (q_bar, ready, free, stats_bar), (lat_desc, pe_desc), scal,
            (acc_ptr, stats_ptr, out_ptr))  # fmt: skip
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


def _descriptors(q, kv_cache):
    """TMA descriptors of 64-row boxes: the query's and the cache's latent halves and rope."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    q_rows = q.reshape(-1, q.shape[2])
    cache_rows = kv_cache.reshape(-1, kv_cache.shape[2])
    half = gl.NVMMASharedLayout.get_default_for([64, HALF_COLS], gl.bfloat16)
    rope = gl.NVMMASharedLayout.get_default_for([64, ROPE_COLS], gl.bfloat16)
    return (
        TensorDescriptor.from_tensor(q_rows, [64, HALF_COLS], half),
        TensorDescriptor.from_tensor(q_rows, [64, ROPE_COLS], rope),
        TensorDescriptor.from_tensor(cache_rows, [64, HALF_COLS], half),
        TensorDescriptor.from_tensor(cache_rows, [64, ROPE_COLS], rope),
    )


def launch_ws_split(
    grid, q, kv_cache, seq_ids, block_tables, positions, acc, stats, out, scale, num_splits,
    split_blocks, tail_blocks, is_direct,
) -> None:  # fmt: skip
    """launch_wide_split's signature (moe_kernels/gluon_attention.py)."""
    _mla_ws_split_kernel[grid](
        *_descriptors(q, kv_cache), seq_ids, block_tables, positions, acc, stats, out, scale,
        q.shape[1], num_splits, block_tables.shape[1], SPLIT_BLOCKS=split_blocks,
        TAIL_BLOCKS=tail_blocks, WRITE_OUT=is_direct, num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip


@contextlib.contextmanager
def _split_launch(launch):
    """The op's split launch with `launch` as its Gluon kernel: the op's merge and buffers
    unchanged, so both forms are timed through the same code around the kernel."""
    import moe_kernels.triton_attention as triton_attention

    kept = triton_attention.launch_wide_split
    triton_attention.launch_wide_split = launch
    try:
        yield
    finally:
        triton_attention.launch_wide_split = kept


def split_attention(q, kv_cache, seq_ids, tables, positions, scale, v_dim):
    """The invariant op's 128-head split launch and merge."""
    from moe_kernels.attention_launch import WIDE_LAUNCH as w
    from moe_kernels.triton_attention import _attend

    return _attend(
        q, kv_cache, seq_ids, tables, positions, scale, v_dim, w.split_blocks, w.num_warps,
        w.num_stages, w.block_h, is_gluon=True, tail_blocks=w.tail_blocks,
    )  # fmt: skip


def _reference(q, kv_cache, tables, positions, scale):
    """fp32 attention of each query over its cache rows 0 .. position."""
    outs = []
    for b in range(q.shape[0]):
        rows = kv_cache[tables[b]].reshape(-1, q.shape[2])[: int(positions[b]) + 1].float()
        weights = torch.softmax((q[b].float() @ rows.T) * scale, -1)
        outs.append(weights @ rows[:, : 2 * HALF_COLS])
    return torch.stack(outs)


def check(launch=None, label: str = "warp-specialised", heads: int = 128) -> None:
    """Queries over 1 to 38 blocks (partial last blocks, tails, several splits): error against
    fp32 next to the kernel's; repeat and alone-vs-batched bits. launch: a form's split launch
    (launch_wide_split's signature; this file's by default)."""
    from moe_kernels.gluon_attention import launch_wide_split

    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = [1, 70, 1100, 2400, 1056, 64, 1089]
    blocks = -(-max(lens) // 64)
    kv = torch.randn(len(lens) * blocks, 64, 576, device="cuda", generator=gen).bfloat16()
    q = torch.randn(len(lens), heads, 576, device="cuda", generator=gen).bfloat16()
    tables = torch.randperm(len(lens) * blocks, device="cuda", generator=gen).view(len(lens), -1)
    positions = torch.tensor([n - 1 for n in lens], device="cuda")
    seq_ids = torch.arange(len(lens), device="cuda")
    args = (kv, seq_ids, tables, positions, 192**-0.5, 512)
    ref = _reference(q, kv, tables, positions, 192**-0.5)
    with _split_launch(launch_wide_split):
        kernel = split_attention(q, *args)
    with _split_launch(launch or launch_ws_split):
        ws, again = split_attention(q, *args), split_attention(q, *args)
        alone = split_attention(q[3:4], kv, seq_ids[3:4], tables, positions[3:4], 192**-0.5, 512)
    print(
        f"max |error| vs fp32: kernel {(kernel.float() - ref).abs().max():.4f}, {label} "
        f"{(ws.float() - ref).abs().max():.4f}; repeat equal {torch.equal(ws, again)}; "
        f"alone equal {torch.equal(alone, ws[3:4])}",
        flush=True,
    )


def timing(launch=None, label: str = "warp-specialised", heads: int = 128) -> None:
    """Graph replay over L2-missing caches (bench/gpu_kernels.py's _graph_ms), µs; launch as
    in check."""
    from bench.gpu_kernels import ATTENTION_GRAPH_CALLS, _graph_ms
    from moe_kernels.fast_attention import mla_decode_fast
    from moe_kernels.gluon_attention import launch_wide_split

    print(f"| B | ctx | FlashMLA (one plan) | kernel, split launch | {label} | form / kernel |")
    print("|---|---|---|---|---|---|")
    for batch, ctx in ((1, 4096), (64, 1024), (64, 4096), (128, 2048), (256, 1024), (32, 8192)):
        blocks = -(-ctx // 64)
        read = batch * ctx * 576 * 2

        def step(batch=batch, blocks=blocks, ctx=ctx):
            tables = torch.randperm(batch * blocks, device="cuda").view(batch, blocks)
            positions = torch.full((batch,), ctx - 1, device="cuda")
            return torch.arange(batch, device="cuda"), tables, positions

        def make(op, shared=None, batch=batch, blocks=blocks):
            kv = torch.randn(batch * blocks, 64, 576, device="cuda").bfloat16()
            q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
            args = (q, kv, *(shared or step()))
            return lambda: op(*args, scale=192**-0.5, v_dim=512)

        calls = ATTENTION_GRAPH_CALLS
        flash = _graph_ms(partial(make, mla_decode_fast, step()), read, calls)
        with _split_launch(launch_wide_split):
            kernel = _graph_ms(partial(make, split_attention), read, calls)
        with _split_launch(launch or launch_ws_split):
            ws = _graph_ms(partial(make, split_attention), read, calls)
        print(
            f"| {batch} | {ctx} | {flash * 1e3:.1f} | {kernel * 1e3:.1f} | {ws * 1e3:.1f} | "
            f"{ws / kernel:.2f} |",
            flush=True,
        )


def compile_sm90(write_out: bool, kernel=None) -> tuple[int, str]:
    """Compile one launch form for sm_90 here (no GPU needed): (shared-memory bytes, ptxas's
    line on registers and stack). kernel: a form with this file's kernel signature (this
    file's by default)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(columns: int) -> str:
        layout = gl.NVMMASharedLayout.get_default_for([64, columns], gl.bfloat16)
        return f"tensordesc<bf16[64, {columns}],{layout!r}>"

    signature = {
        "q_desc": desc(HALF_COLS), "q_pe_desc": desc(ROPE_COLS), "lat_desc": desc(HALF_COLS),
        "pe_desc": desc(ROPE_COLS), "seq_ids_ptr": "*i64", "tables_ptr": "*i64",
        "positions_ptr": "*i64", "acc_ptr": "*fp32", "stats_ptr": "*fp32", "out_ptr": "*bf16",
        "scale": "fp32", "num_heads": "i32", "num_splits": "i32", "table_width": "i32",
    }  # fmt: skip
    consts = dict(SPLIT_BLOCKS=16, TAIL_BLOCKS=2, WRITE_OUT=write_out, num_warps=4)
    # Why the divisibility marks: the GPU's JIT marks 16-byte aligned pointers and multiples of
    # 16 so; without them the compile is another kernel (other registers and spills).
    names = [*signature, *consts]
    aligned = [n for n in signature if n.endswith("_ptr")] + ["num_heads"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = GluonASTSource(
        kernel or _mla_ws_split_kernel,
        {**signature, **dict.fromkeys(consts, "constexpr")},
        consts,
        attrs,
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=MAXNREG)
    )
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "mla_ws.ptx"
        ptx.write_text(compiled.asm["ptx"])
        info = subprocess.run(
            [str(Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"), "-arch=sm_90a",
             "-v", str(ptx), "-o", str(Path(tmp) / "mla_ws.cubin")],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
    used = next(line.split(":", 1)[1].strip() for line in info.splitlines() if "Used" in line)
    return compiled.metadata.shared, used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="sm_90 compile, no GPU")
    if parser.parse_args().compile_only:
        for write_out in (False, True):
            shared, used = compile_sm90(write_out)
            print(f"WRITE_OUT={write_out}: shared {shared} bytes; {used}")
        return
    torch.cuda.init()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {triton.__version__}")  # fmt: skip
    check()
    timing()


if __name__ == "__main__":
    main()
