"""The measured cost of batch invariance on one GPU, in one run.

Invariant Triton linear vs cuBLAS (torch.matmul, bf16) over the DeepSeek-V2-Lite linear
shapes and a sweep of token counts M; Triton RMSNorm and log-softmax bandwidth against a
device copy measured in the same run (the ceiling), with the torch versions beside them.
Times are medians of triton.testing.do_bench (CUDA events, warm-up, L2 flushed per call).

    PYTHONUNBUFFERED=1 python bench/gpu_kernels.py [rows linear grouped attention sweep layer
        row_parallel tree_crossover split_prefill value_split split_sweep whole_query tail
        read_floor heads fast_choice fast_choice_v3 ...] (every section: the table in main)
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

# Run as a script from anywhere: the repository root holds the top-level packages.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from bench.hbm_floor import copy_bandwidth  # noqa: E402
from moe_kernels.attention_launch import (  # noqa: E402
    NARROW_LAUNCH,
    WIDE_HEADS,
    WIDE_LAUNCH,
    head_launch,
)
from moe_kernels.rmsnorm import rms_norm_fast  # noqa: E402
from moe_kernels.triton_grouped_linear import grouped_config, grouped_linear_triton  # noqa: E402
from moe_kernels.triton_linear import _launch, linear_triton  # noqa: E402
from moe_kernels.triton_linear_config import LinearConfig, batched_config, linear_config  # noqa: E402
from moe_kernels.triton_rmsnorm import rms_norm_triton  # noqa: E402
from moe_kernels.triton_softmax import log_softmax_triton  # noqa: E402
from moe_kernels.triton_split_k import arrival_counts, launch_split_k  # noqa: E402
from moe_runtime.config import load_config  # noqa: E402
from moe_runtime.worker.cuda_graphs import table_widths  # noqa: E402

# (name, in_dim K, out_dim N) of DeepSeek-V2-Lite (hidden 2048), from the shipped config.
LINEAR_SHAPES = load_config(ROOT / "launch" / "configs" / "v2_lite_gpu.yaml").model.linear_shapes()
ROW_COUNTS = (1, 16, 64, 256, 1024, 4096, 16384)
L2_BYTES = 60 << 20


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _graph_ms(make_fn, num_bytes: int, min_copies: int = 1) -> float:
    """Median time of one call, replayed in a CUDA graph (no launch gaps) over enough copies
    of the inputs that they do not fit in L2 (each call reads from HBM, as in a decode step),
    and at least min_copies of them."""
    copies = max(min_copies, min(32, -(-4 * L2_BYTES // max(num_bytes, 1))))
    fns = [make_fn() for _ in range(copies)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median") / copies


def bench_linear() -> None:
    print("\n## linear: invariant Triton (row-bucket configs) vs cuBLAS (bf16)")
    print(
        f"{'shape':16} {'K':>6} {'N':>7} {'M':>6} {'cublas_us':>10} {'triton_us':>10} "
        f"{'ratio':>6} {'cublas_TF':>9} {'triton_TF':>9} {'g_cublas':>9} {'g_triton':>9} "
        f"{'g_ratio':>7}  config"
    )
    ratios = {"large": [], "decode": [], "g_large": [], "g_decode": []}
    arrivals = arrival_counts("cuda")  # as the engine's op table binds them
    for name, in_dim, out_dim in LINEAR_SHAPES:
        w = torch.randn(out_dim, in_dim, device="cuda", dtype=torch.bfloat16) * in_dim**-0.5
        for m in ROW_COUNTS:
            x = torch.randn(m, in_dim, device="cuda", dtype=torch.bfloat16)
            t_cublas = _ms(lambda x=x, w=w: torch.matmul(x, w.t()))
            t_triton = _ms(lambda x=x, w=w: linear_triton(x, w, arrivals=arrivals))
            g_cublas = g_triton = float("nan")
            if m <= 256:  # graph replay: the kernels alone, as a decode step under a graph

                def make(op, m=m, in_dim=in_dim, out_dim=out_dim):
                    wc = torch.randn(out_dim, in_dim, device="cuda", dtype=torch.bfloat16)
                    xc = torch.randn(m, in_dim, device="cuda", dtype=torch.bfloat16)
                    return lambda: op(xc, wc)

                num_bytes = 2 * (out_dim * in_dim + m * (in_dim + out_dim))
                g_cublas = _graph_ms(lambda: make(lambda a, b: torch.matmul(a, b.t())), num_bytes)
                triton_op = partial(linear_triton, arrivals=arrivals)
                g_triton = _graph_ms(lambda op=triton_op: make(op), num_bytes)
            flops = 2 * m * in_dim * out_dim
            c = linear_config(out_dim, in_dim, torch.bfloat16, m)
            tag = f"{c.block_m}x{c.block_n}x{c.block_k}/w{c.num_warps}/s{c.num_stages}"
            tag += "/tma" if c.is_persistent else ""
            print(
                f"{name:16} {in_dim:6} {out_dim:7} {m:6} {t_cublas * 1e3:10.1f} "
                f"{t_triton * 1e3:10.1f} {t_triton / t_cublas:6.2f} "
                f"{flops / t_cublas / 1e9:9.1f} {flops / t_triton / 1e9:9.1f} "
                f"{g_cublas * 1e3:9.1f} {g_triton * 1e3:9.1f} {g_triton / g_cublas:7.2f}  {tag}"
            )
            if m >= 1024:
                ratios["large"].append(t_triton / t_cublas)
            if m <= 64:
                ratios["decode"].append(t_triton / t_cublas)
                ratios["g_decode"].append(g_triton / g_cublas)
        del w
    for key, values in ratios.items():
        if values:
            print(f"ratio triton/cublas {key}: min {min(values):.2f} max {max(values):.2f}")


def bench_grouped() -> None:
    """Routed experts of one V2-Lite MoE layer (64 experts, 2048 -> 2x1408 and 1408 -> 2048)
    at the rows a decode step of B tokens gives (top-6, random routing), and at 8 experts x
    1024 rows: the invariant Triton grouped GEMM (device counts) vs torch._grouped_mm (fast
    mode), both replayed in CUDA graphs over enough weight copies to miss L2."""
    from moe_kernels.linear import grouped_linear_cuda_fast

    print("\n## grouped expert GEMM: invariant Triton vs torch._grouped_mm (graph replay)")
    print("| weight | tokens | experts | rows | _grouped_mm us | Triton us | ratio |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    cases = [(t, 64, 6) for t in (1, 8, 64, 256, 1024)] + [(1024, 8, 8)]
    for name, out_dim, in_dim in (("gate_up", 2816, 2048), ("down", 2048, 1408)):
        for tokens, experts, top_k in cases:
            ids = torch.stack(
                [torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
            )
            counts = torch.bincount(ids.reshape(-1), minlength=experts).cuda()
            rows = tokens * top_k
            num_bytes = int((counts > 0).sum()) * out_dim * in_dim * 2

            def make(op, rows=rows, counts=counts, experts=experts, out_dim=out_dim, in_dim=in_dim):
                w = torch.randn(experts, out_dim, in_dim, device="cuda").bfloat16()
                x = torch.randn(rows, in_dim, device="cuda").bfloat16()
                return lambda: op(x, w, counts)

            t_fast = _graph_ms(partial(make, grouped_linear_cuda_fast), num_bytes)
            t_triton = _graph_ms(partial(make, grouped_linear_triton), num_bytes)
            print(
                f"| {name} | {tokens} | {experts} | {rows} | {t_fast * 1e3:.1f} | "
                f"{t_triton * 1e3:.1f} | {t_triton / t_fast:.2f} |"
            )


# Pointer-kernel tiles for the grouped GEMM at prefill sizes (every one BLOCK_K 64).
GROUPED_SWEEP = [
    LinearConfig(64, 64, 64, 8, 4, 4),
    LinearConfig(64, 128, 64, 8, 4, 4),
    LinearConfig(128, 64, 64, 8, 4, 4),
    LinearConfig(128, 128, 64, 8, 8, 3),
    LinearConfig(128, 128, 64, 8, 8, 4),
    LinearConfig(128, 128, 64, 8, 4, 3),
    LinearConfig(128, 256, 64, 8, 8, 3),
    LinearConfig(64, 256, 64, 8, 8, 3),
    LinearConfig(256, 128, 64, 8, 8, 3),
    LinearConfig(128, 128, 64, 8, 8, 3, True),
    LinearConfig(128, 128, 64, 8, 8, 4, True),
    LinearConfig(128, 256, 64, 8, 8, 3, True),
    LinearConfig(128, 64, 64, 8, 4, 4, True),
]


def bench_grouped_sweep() -> None:
    """The grouped expert GEMM at prefill sizes (V2-Lite, 64 experts, top-6, random routing,
    1024 and 8192 tokens): each pointer tile's graph-replay time with the rows read through
    the token index (the MoE layer's path) / pre-gathered, and its ratio to fast mode's
    gather + torch._grouped_mm; '=' where the tile's output has the default tile's bits."""
    print("\n## grouped GEMM tiles at prefill sizes (graph replay, us; = same bits as default)")
    gen = torch.Generator().manual_seed(0)
    for name, out_dim, in_dim in (("gate_up", 2816, 2048), ("down", 2048, 1408)):
        for tokens in (1024, 8192):
            print(_grouped_sweep_row(name, out_dim, in_dim, tokens, gen))


def _grouped_sweep_row(name: str, out_dim: int, in_dim: int, tokens: int, gen) -> str:
    from moe_kernels.linear import grouped_linear_cuda_fast
    from moe_kernels.triton_grouped_linear import _grouped, grouped_config

    ids = torch.stack([torch.randperm(64, generator=gen)[:6] for _ in range(tokens)])
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=64).cuda()
    index = (torch.sort(flat, stable=True).indices // 6).cuda()
    rows = flat.numel()
    w = torch.randn(64, out_dim, in_dim, device="cuda").bfloat16() * in_dim**-0.5
    x = torch.randn(tokens, in_dim, device="cuda").bfloat16()
    gathered = x[index]
    num_bytes = w.numel() * 2  # far past L2: one copy of the inputs

    def timed(fn) -> float:
        return _graph_ms(lambda: fn, num_bytes) * 1e3

    default = grouped_config(out_dim, in_dim, x.dtype, rows, 64)
    want = grouped_linear_triton(x, w, counts, row_index=index)
    t_fast = timed(lambda: grouped_linear_cuda_fast(x, w, counts, row_index=index))
    cells = []
    for c in dict.fromkeys([default, *GROUPED_SWEEP]):
        try:
            out = _grouped(x, w, counts, index, is_gated=False, config=c)
        except Exception as err:  # out of shared memory etc.: report, keep sweeping
            cells.append(f"{_tag(c)}:fail:{type(err).__name__}")
            continue
        same = "=" if torch.equal(out, want) else "x"
        # TMA tiles gather first (timed in "index"); pointer tiles read through the index.
        t_in = timed(partial(_grouped, x, w, counts, index, is_gated=False, config=c))
        t_pre = timed(partial(_grouped, gathered, w, counts, None, is_gated=False, config=c))
        mark = "*" if c == default else ""
        cells.append(f"{mark}{_tag(c)}{same} {t_in:.0f}/{t_pre:.0f} ({t_in / t_fast:.2f})")
    return f"{name} tokens={tokens} rows={rows} fast {t_fast:.0f}us | " + " | ".join(cells)


SWEEP_SMALL = [
    LinearConfig(16, 16, 64, 8, 4, 4),
    LinearConfig(16, 32, 64, 8, 4, 4),
    LinearConfig(16, 64, 64, 8, 4, 4),
    LinearConfig(16, 32, 64, 8, 4, 6),
    LinearConfig(16, 64, 64, 8, 2, 4),
    LinearConfig(32, 32, 64, 8, 4, 4),
    LinearConfig(32, 64, 64, 8, 4, 4),
    LinearConfig(64, 32, 64, 8, 4, 4),
    LinearConfig(64, 64, 64, 8, 4, 4),
    LinearConfig(64, 128, 64, 8, 4, 4),
]
SWEEP_LARGE = [
    LinearConfig(64, 64, 64, 8, 4, 4),
    LinearConfig(128, 128, 64, 8, 8, 3),
    LinearConfig(128, 256, 64, 8, 8, 3),
    LinearConfig(128, 128, 64, 8, 8, 3, True),
    LinearConfig(128, 128, 64, 8, 8, 4, True),
    LinearConfig(128, 256, 64, 8, 8, 3, True),
    LinearConfig(128, 128, 64, 8, 4, 4, True),
    LinearConfig(128, 64, 64, 8, 4, 4, True),
    LinearConfig(64, 128, 64, 8, 4, 4, True),
]


def _tag(c: LinearConfig) -> str:
    kind = "/T" if c.is_persistent else ""
    return f"{c.block_m}x{c.block_n}x{c.block_k}/w{c.num_warps}/s{c.num_stages}{kind}"


def bench_config_sweep() -> None:
    """Every candidate config on every shape and M: time (us), and whether its 600-row output
    is bit-identical to 64x64/w4/s4 (all share BLOCK_K = 64). Best per (shape, M) last."""
    print("\n## linear config sweep: us (= bits equal to 64x64/w4/s4, x differs)")
    for name, in_dim, out_dim in LINEAR_SHAPES:
        w = torch.randn(out_dim, in_dim, device="cuda", dtype=torch.bfloat16) * in_dim**-0.5
        x600 = torch.randn(600, in_dim, device="cuda", dtype=torch.bfloat16)
        ref = _launch(x600, w, x600.new_empty((600, out_dim)), 600, SWEEP_SMALL[8])
        same = {}
        for c in dict.fromkeys(SWEEP_SMALL + SWEEP_LARGE):
            try:
                out = _launch(x600, w, x600.new_empty((600, out_dim)), 600, c)
                same[c] = "=" if torch.equal(out, ref) else "x"
            except Exception as err:  # out of shared memory etc.: report, keep sweeping
                same[c] = f"fail:{type(err).__name__}"
        print(f"{name}: bits " + " ".join(f"{_tag(c)}{e}" for c, e in same.items()))
        for m in ROW_COUNTS[:-1]:
            x = torch.randn(m, in_dim, device="cuda", dtype=torch.bfloat16)
            out = x.new_empty((m, out_dim))
            t_cublas = _ms(lambda x=x, w=w: torch.matmul(x, w.t()))
            cells = []
            for c in SWEEP_SMALL if m <= 64 else SWEEP_LARGE:
                if same[c].startswith("fail"):
                    continue
                t = _ms(lambda x=x, w=w, out=out, c=c, m=m: _launch(x, w, out, m, c))
                cells.append((t / t_cublas, c))
            cells.sort(key=lambda item: item[0])
            print(
                f"  {name:14} M={m:5} cublas {t_cublas * 1e3:7.1f}us | "
                + " ".join(f"{_tag(c)}={r:.2f}" for r, c in cells)
            )
        del w


# The linears of one V2-Lite prefill layer outside the experts (name, K, N); the router and
# kv_a take the fixed K split's chain, the rest the plain kernel (o_proj and the shared
# experts' down run whole on TP token shares: the plain kernel at every kernels.tp_max).
PREFILL_LINEARS = (
    ("q_proj", 2048, 3072),
    ("kv_a", 2048, 576),
    ("kv_b", 512, 4096),
    ("o_proj", 2048, 2048),
    ("shared_gate_up", 2048, 5632),
    ("shared_down", 2816, 2048),
    ("q_proj_h128", 2048, 128 * 192),  # V3's 128 heads on V2-Lite's hidden
    ("o_proj_h128", 128 * 128, 2048),
)


def bench_prefill_linears() -> None:
    """The plain invariant linear at prefill rows (8 x 1024 and 2 x 1024 tokens) against cuBLAS,
    the default config and each large-M candidate (do_bench, L2 flushed: a prefill call reads
    more than L2), with '=' where a candidate gave the default's bits."""
    print("\n## prefill linears: µs, invariant default / cuBLAS, candidates (= same bits)")
    for name, in_dim, out_dim in PREFILL_LINEARS:
        w = torch.randn(out_dim, in_dim, device="cuda", dtype=torch.bfloat16) * in_dim**-0.5
        for m in (2048, 8192):
            x = torch.randn(m, in_dim, device="cuda", dtype=torch.bfloat16)
            want = linear_triton(x, w)
            t_cublas = _ms(lambda x=x, w=w: torch.matmul(x, w.t()))
            t_default = _ms(lambda x=x, w=w: linear_triton(x, w))
            cells = []
            for c in SWEEP_LARGE[1:] + [LinearConfig(256, 128, 64, 8, 8, 3, True)]:
                out = x.new_empty((m, out_dim))
                try:
                    same = torch.equal(_launch(x, w, out, m, c), want)
                except Exception as err:  # out of shared memory etc.: report, keep sweeping
                    cells.append(f"{_tag(c)}:fail:{type(err).__name__}")
                    continue
                t = _ms(lambda x=x, w=w, out=out, c=c, m=m: _launch(x, w, out, m, c))
                cells.append(f"{_tag(c)}{'=' if same else 'x'}{t * 1e3:.1f}")
            print(
                f"{name:15} M={m:5} cublas {t_cublas * 1e3:6.1f} default {t_default * 1e3:6.1f} "
                f"({t_default / t_cublas:.2f}) | " + " ".join(cells),
                flush=True,
            )


ATTENTION_GRAPH_CALLS = 8  # calls a graph at least: a decode step's layers share its plan
# (B, context): 1056 is 17 blocks of 64, a query whose last KV split of the wide launch holds
# one block (the engine's decode benchmark runs at contexts 1032-1065).
ATTENTION_SHAPES = (
    (1, 4096), (64, 1024), (64, 1056), (64, 4096), (256, 1024), (256, 1056), (8, 8192),
)  # fmt: skip


def bench_attention() -> None:
    """Decode attention (latent 512 + rope 64, blocks of 64) at 16 heads (V2-Lite) and 128
    (V3): the invariant op (Triton; its Gluon split kernel from 64 heads) vs fast mode's
    decode attention (mla_decode_fast: FlashMLA only where its host rules pick it, else the
    invariant launch or the split-KV Triton kernel; the last column names it), each
    replayed in a CUDA graph over enough caches to miss L2. Bytes = the KV cache read once.
    Fast mode is timed twice: each call with its own step (FlashMLA plans its schedule every
    call) and all of the graph's calls sharing one step's positions and tables (one plan for
    all of them, as the engine's layers share it). Every graph holds at least
    ATTENTION_GRAPH_CALLS calls, so the shared plan is paid once for that many, as a decode
    step's layers pay it (with one call a graph FlashMLA took ~178 us at B = 256 context
    1024, with its plan shared by 8 calls ~138: BENCHMARKS.md, eighteenth session)."""
    from moe_kernels.fast_attention import HAS_FLASH_MLA, mla_decode_fast
    from moe_kernels.triton_attention import mla_attention_triton

    ceiling = copy_bandwidth(torch.device("cuda")) / 1e12  # TB/s, read + write of 1 GiB
    flash = "FlashMLA installed" if HAS_FLASH_MLA else "FlashMLA not installed"
    capability = torch.cuda.get_device_capability()
    print(
        f"\n## decode attention: invariant vs fast mode's op ({flash}; the path it takes at "
        f"each shape in the last column); copy ceiling {ceiling:.2f} TB/s"
    )
    print(
        "| heads | B | ctx | invariant us | % of copy | fast us | % of copy | invariant / fast "
        "| fast, one plan a step, us | invariant / that | fast path |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for heads in (16, 128):
        for batch, ctx in ATTENTION_SHAPES:
            blocks = -(-ctx // 64)
            read = batch * ctx * 576 * 2

            def step(batch=batch, blocks=blocks, ctx=ctx):
                tables = torch.randperm(batch * blocks, device="cuda").view(batch, blocks)
                seq_ids = torch.arange(batch, device="cuda")
                positions = torch.full((batch,), ctx - 1, device="cuda")
                return seq_ids, tables, positions

            def make(op, shared=None, batch=batch, blocks=blocks, heads=heads):
                kv = torch.randn(batch * blocks, 64, 576, device="cuda").bfloat16()
                q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
                seq_ids, tables, positions = shared or step()
                args = (q, kv, seq_ids, tables, positions)
                return lambda: op(*args, scale=192**-0.5, v_dim=512)

            one_step = step()
            calls = ATTENTION_GRAPH_CALLS
            times = [
                _graph_ms(partial(make, mla_attention_triton), read, calls),
                _graph_ms(partial(make, mla_decode_fast), read, calls),
                _graph_ms(partial(make, mla_decode_fast, one_step), read, calls),
            ]
            pct = [read / t / 1e9 / ceiling for t in times]
            print(
                f"| {heads} | {batch} | {ctx} | {times[0] * 1e3:.1f} | {pct[0]:.0%} | "
                f"{times[1] * 1e3:.1f} | {pct[1]:.0%} | {times[0] / times[1]:.2f} | "
                f"{times[2] * 1e3:.1f} | {times[0] / times[2]:.2f} | "
                f"{fast_decode_path(batch, blocks, heads, HAS_FLASH_MLA, capability)} |"
            )


def fast_decode_path(
    batch: int, table_width: int, heads: int, has_flash_mla: bool, capability: tuple[int, int]
) -> str:
    """Which kernel fast mode's decode attention (mla_decode_fast) runs for a decode batch of
    `batch` queries over tables `table_width` blocks wide at `heads` heads (bf16, blocks of 64)
    on a device of compute `capability`, by its own host rules. Why: it is FlashMLA only where
    those rules leave it there (an importable FlashMLA on a device other than SM90 runs the
    split-KV kernel: uses_flash_mla); elsewhere the "fast" columns time the invariant launch or
    the split-KV Triton kernel, not FlashMLA."""
    from moe_kernels.fast_attention import (
        FLASH_MLA_CAPABILITY,
        takes_invariant_launch,
        takes_split_kv,
    )

    uses_flash_mla = has_flash_mla and tuple(capability) == FLASH_MLA_CAPABILITY
    if not uses_flash_mla or takes_split_kv(batch, heads):
        return "split-KV Triton"
    if takes_invariant_launch(batch, table_width, heads):
        return "invariant launch"
    return "FlashMLA"


def _graph_width(blocks: int, heads: int = 16) -> int:
    """The block-table width of the engine's decode graph at `heads` heads for a batch whose
    longest context is `blocks` cache blocks: table_widths of a 128-block model with the
    tail of the head count's launch, as DecodeGraphRunner takes them (16 heads: 16, 32, 64,
    128; 128 heads: 18, 34, 66, 128)."""
    tail = head_launch(heads).tail_blocks
    return next(w for w in table_widths(128, tail) if w >= blocks)


def engine_decode_step(batch: int, ctx: int, heads: int, width: int | None = None) -> tuple:
    """(seq_ids, block_tables, positions) of a decode step of `heads` heads as the engine's
    graph runs it: batch queries at position ctx (a context one past a block's end), each
    over its own shuffled ctx // 64 + 1 blocks, tables padded with -1 to the graph's width
    (_graph_width) or to `width` entries."""
    blocks = ctx // 64 + 1
    width = _graph_width(blocks, heads) if width is None else width
    tables = torch.full((batch, width), -1, device="cuda", dtype=torch.int64)
    tables[:, :blocks] = torch.randperm(batch * blocks, device="cuda").view(batch, -1)
    positions = torch.full((batch,), ctx, device="cuda")
    return torch.arange(batch, device="cuda"), tables, positions


def _decode_cache(batch: int, ctx: int, seed: int = 0, width: int = 128) -> tuple:
    """(q, kv_cache, seq_ids, block_tables, positions) of a 16-head decode step: batch queries
    at position ctx - 1, each over its own shuffled cache blocks of 64, bf16, block tables
    padded with -1 to width entries (128: the engine's widest graph tables)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = -(-ctx // 64)
    kv = torch.randn(batch * blocks, 64, 576, device="cuda", generator=gen).bfloat16()
    q = torch.randn(batch, 16, 576, device="cuda", generator=gen).bfloat16()
    tables = torch.full((batch, width), -1, device="cuda", dtype=torch.int64)
    order = torch.randperm(batch * blocks, device="cuda", generator=gen)
    tables[:, :blocks] = order.view(batch, blocks)
    positions = torch.full((batch,), ctx - 1, device="cuda")
    return q, kv, torch.arange(batch, device="cuda"), tables, positions


def _engine_step(batch: int, ctx: int) -> tuple[int, int, tuple]:
    """(the engine's graph table width, the KV bytes read, FlashMLA's (block tables, positions))
    of a 16-head decode step of batch queries at context ctx (_decode_cache's)."""
    blocks = -(-ctx // 64)
    width = _graph_width(blocks)
    step = _decode_cache(batch, ctx, width=width)
    return width, batch * ctx * 576 * 2, (step[3][:, :blocks].contiguous(), step[4])


def bench_value_split() -> None:
    """The invariant decode attention's value split (VALUE_SPLIT in
    moe_kernels/attention_launch.py, and a split of two) at 16 heads against whole head blocks,
    each also with the table read a block ahead (TABLE_AHEAD_MAX_PAIRS), at contexts 1024
    to 8192 with block tables as wide as the engine's graph for that context (16 to 128
    entries, -1 padding), graph replay over L2-missing caches, bits compared with whole head
    blocks; and the op's own launch."""
    from moe_kernels.attention_launch import SPLIT_BLOCKS, VALUE_SPLIT
    from moe_kernels.triton_attention import _attend, mla_attention_triton

    shapes = [
        (1, None, False), (1, None, True), (*VALUE_SPLIT, False), (*VALUE_SPLIT, True),
        (2, None, False),
    ]  # fmt: skip
    print("\n## decode attention's value split, 16 heads (graph replay)")
    cols = " | ".join(
        f"v_parts {v} / lat_chunk {c or 'all'}{' / ahead' if a else ''} µs" for v, c, a in shapes
    )
    print(f"| B | ctx | table width | {cols} | the op µs | same bits |")
    print("|---|---|---|" + "---|" * (len(shapes) + 2))
    for ctx in (1024, 2048, 4096, 8192):
        blocks = ctx // 64
        width = _graph_width(blocks)
        for batch in (1, 2, 4, 8, 16, 32, 64):

            def make(v_parts=None, lat_chunk=None, ahead=False, batch=batch, ctx=ctx, width=width):
                cache = _decode_cache(batch, ctx, width=width)
                if v_parts is None:
                    return lambda: mla_attention_triton(*cache, scale=192**-0.5, v_dim=512)
                args = (*cache, 192**-0.5, 512, SPLIT_BLOCKS, 4, 3)
                return lambda: _attend(
                    *args, v_parts=v_parts, lat_chunk=lat_chunk, is_table_ahead=ahead
                )

            whole = make(1, None)()
            same, cells = True, []
            for shape in [*shapes, (None,)]:
                try:
                    same &= torch.equal(make(*shape)(), whole)
                except triton.runtime.errors.OutOfResources:  # 3 stages and the table ahead
                    cells.append("does not fit")
                    continue
                us = _graph_ms(partial(make, *shape), batch * ctx * 576 * 2) * 1e3
                cells.append(f"{us:.1f}")
            cells = " | ".join(cells)
            print(f"| {batch} | {ctx} | {width} | {cells} | {same} |")


def bench_wide_value_split() -> None:
    """The 128-head Gluon kernel's value split (WIDE_VALUE_PARTS: each partition's 256 value
    columns over 1 or 2 programs, every program computing all of its head block's scores)
    at decode shapes, tables as wide as the engine's graph for the context, graph replay over
    L2-missing caches (ATTENTION_GRAPH_CALLS calls a graph), µs, bits compared with one part;
    the op's own launch; and fast mode's decode attention with one plan a step (FlashMLA where
    installed) for the ratio."""
    from moe_kernels.attention_launch import WIDE_LAUNCH
    from moe_kernels.fast_attention import mla_decode_fast
    from moe_kernels.gluon_attention import WIDE_VALUE_PARTS
    from moe_kernels.triton_attention import _attend, mla_attention_triton

    launch = (
        WIDE_LAUNCH.split_blocks, WIDE_LAUNCH.num_warps, WIDE_LAUNCH.num_stages,
        WIDE_LAUNCH.block_h,
    )  # fmt: skip
    print("\n## the 128-head Gluon kernel's value split (graph replay, µs)")
    parts = " | ".join(f"{v} part{'s' * (v > 1)}" for v in WIDE_VALUE_PARTS)
    print(f"| B | ctx | table width | {parts} | the op | fast, one plan | op / fast | same bits |")
    print("|---|---|---|" + "---|" * (len(WIDE_VALUE_PARTS) + 4))
    for ctx in (1024, 2048, 4096, 8000):  # 8000: a table of 126 blocks (the widest graph's 128)
        blocks = ctx // 64 + 1  # the engine's decode: a context past a block's end
        width = _graph_width(blocks, 128)
        for batch in (1, 2, 4, 8, 16, 32, 64):
            read = batch * (ctx + 1) * 576 * 2
            step = engine_decode_step(batch, ctx, 128)

            def make(op, batch=batch, blocks=blocks, step=step):
                kv = torch.randn(batch * blocks, 64, 576, device="cuda").bfloat16()
                q = torch.randn(batch, 128, 576, device="cuda").bfloat16()
                return lambda: op(q, kv, *step)

            def parted(v_parts):
                return lambda q, kv, *rest: _attend(
                    q, kv, *rest, 192**-0.5, 512, *launch, is_gluon=True,
                    tail_blocks=WIDE_LAUNCH.tail_blocks, v_parts=v_parts,
                )  # fmt: skip

            def op(q, kv, *rest):
                return mla_attention_triton(q, kv, *rest, scale=192**-0.5, v_dim=512)

            def fast(q, kv, *rest):
                return mla_decode_fast(q, kv, *rest, scale=192**-0.5, v_dim=512)

            def seeded(fn, seed=batch * 7 + ctx):  # the same inputs for every form compared
                torch.manual_seed(seed)
                return make(fn)()

            base = seeded(parted(1))
            others = [*(parted(v) for v in WIDE_VALUE_PARTS[1:]), op]
            same = all(torch.equal(seeded(fn), base) for fn in others)
            calls = ATTENTION_GRAPH_CALLS
            times = [_graph_ms(partial(make, parted(v)), read, calls) for v in WIDE_VALUE_PARTS] + [
                _graph_ms(partial(make, op), read, calls)
            ]
            t_fast = _graph_ms(partial(make, fast), read, calls)
            cells = " | ".join(f"{t * 1e3:.1f}" for t in times)
            print(
                f"| {batch} | {ctx} | {width} | {cells} | {t_fast * 1e3:.1f} | "
                f"{times[-1] / t_fast:.2f} | {same} |"
            )


def bench_whole_query() -> None:
    """The invariant decode attention at 16 heads with each query's splits in one program
    (WHOLE_QUERY, two and three stages) against the split launch and its merge, engine-wide
    block tables (128 entries), each batch's value split, graph replay over L2-missing
    caches, bits compared; the last column is the launch the op takes (WHOLE_QUERY_STAGES)."""
    from moe_kernels.attention_launch import SPLIT_BLOCKS, value_split, whole_query_stages
    from moe_kernels.triton_attention import _attend

    ceiling = copy_bandwidth(torch.device("cuda")) / 1e12
    print(f"\n## decode attention, whole-query programs, 16 heads (graph replay); copy ceiling "
          f"{ceiling:.2f} TB/s")  # fmt: skip
    print("| B | ctx | split + merge µs | whole, 2 stages µs | whole, 3 stages µs | same bits "
          "| the op's launch | % of copy |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for batch in (32, 64, 128, 256):
        for ctx in (1024, 4096):
            v_parts, lat_chunk = value_split(batch, 512, 128 // SPLIT_BLOCKS)  # 128-wide tables

            def make(launch, batch=batch, ctx=ctx, v_parts=v_parts, lat_chunk=lat_chunk):
                args = (*_decode_cache(batch, ctx), 192**-0.5, 512)
                stages, is_whole = launch
                return lambda: _attend(
                    *args, SPLIT_BLOCKS, 4, stages, 16, v_parts, lat_chunk, is_whole_query=is_whole
                )

            launches = ((3, False), (2, True), (3, True))
            split = make(launches[0])()
            same = all(torch.equal(make(w)(), split) for w in launches[1:])
            read = batch * ctx * 576 * 2
            us = [_graph_ms(partial(make, w), read) * 1e3 for w in launches]
            stages = whole_query_stages(batch)
            taken = launches.index((stages, True) if stages else (3, False))
            print(
                f"| {batch} | {ctx} | {us[0]:.1f} | {us[1]:.1f} | {us[2]:.1f} | {same} | "
                f"{('split', 'whole, 2', 'whole, 3')[taken]} | "
                f"{read / us[taken] / 1e6 / ceiling:.0%} |"
            )


def bench_groups() -> None:
    """The 16-head invariant decode attention with a query's KV splits folded in groups
    (kernels.attention_group_splits; new bits past one group): the op as configured without
    groups and with G = 4 and 8 (its launch chosen by group_launch, the last group taking up
    to one split more), against FlashMLA with one plan a step; and G = 8 with a program a
    group (the op's form from 128 programs of groups) at 2 and 3 stages.
    Tables as wide as the engine's graph for the context (contexts just past a group's 32
    blocks included), graph replay over L2-missing caches, µs (/ FlashMLA); `same`: every
    G = 8 form gives the op's G = 8 bits."""
    from moe_kernels.attention_launch import SPLIT_BLOCKS
    from moe_kernels.fast_attention import _decode_flash_mla
    from moe_kernels.triton_attention import _attend, mla_attention_triton

    ceiling = copy_bandwidth(torch.device("cuda")) / 1e12
    print(f"\n## 16-head decode attention, splits folded in groups (graph replay); copy "
          f"ceiling {ceiling:.2f} TB/s")  # fmt: skip
    forms = [("group", 2), ("group", 3)]
    cols = " | ".join(f"G 8 {form}, {stages} st µs" for form, stages in forms)
    print(f"| B | ctx | FlashMLA µs | op G 0 µs | op G 4 µs | op G 8 µs | {cols} | G 8 same |")
    print("|---|---|---|---|---|---|" + "---|" * (len(forms) + 1))
    shapes = (
        (8, 8192), (32, 4096), (64, 2048), (64, 4096), (64, 4140), (64, 8192), (128, 2048),
        (128, 4140), (256, 2048), (256, 4140),
    )  # fmt: skip
    for batch, ctx in shapes:
        width, read, flash_step = _engine_step(batch, ctx)

        def make(launch, batch=batch, ctx=ctx, width=width, flash=flash_step):
            q, kv, seq_ids, tables, positions = _decode_cache(batch, ctx, width=width)
            if launch == "flash":  # every copy on the same step: one plan for all
                return lambda: _decode_flash_mla(q, kv, *flash, 192**-0.5, 512)
            if isinstance(launch, int):  # the op, groups of `launch` splits
                return lambda: mla_attention_triton(
                    q, kv, seq_ids, tables, positions, scale=192**-0.5, v_dim=512,
                    group_splits=launch,
                )  # fmt: skip
            return lambda: _attend(
                q, kv, seq_ids, tables, positions, 192**-0.5, 512, SPLIT_BLOCKS, 4, launch[1],
                is_whole_query=True, is_table_ahead=True, group_splits=8,
                group_tail=SPLIT_BLOCKS,
            )  # fmt: skip

        flash = _graph_ms(partial(make, "flash"), read, 8) * 1e3
        text = [f"{flash:.1f}"]
        for launch in (0, 4, 8, *forms):
            us = _graph_ms(partial(make, launch), read, 8) * 1e3
            text.append(f"{us:.1f} ({us / flash:.2f})")
        bits = make(8)()
        text.append(str(all(torch.equal(make(form)(), bits) for form in forms)))
        print(f"| {batch} | {ctx} | " + " | ".join(text) + " |")


@triton.jit
def _read_blocks_kernel(kv_ptr, tables_ptr, out_ptr, table_width, num_blocks,
                        BLOCKS: tl.constexpr, BS: tl.constexpr, C: tl.constexpr,
                        STAGES: tl.constexpr):  # fmt: skip
    """Read-only floor of a decode attention launch: program (query, p) reads cache blocks
    p * BLOCKS .. of its query through the block table (the next entry read a block ahead, as
    the attention kernels do) in 64-column tiles, adds them elementwise into one fp32 tile
    (no reduction across threads until the end) and writes its sum: the bytes the attention
    reads, with none of its arithmetic, partials or merge."""
    t = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCKS
    last = tl.minimum(first + BLOCKS, num_blocks)
    offs = tl.arange(0, BS)[:, None] * C + tl.arange(0, 64)[None, :]
    table = tables_ptr + t * table_width
    total = tl.zeros((BS, 64), dtype=tl.float32)
    next_id = tl.load(table + first).to(tl.int64)
    for j in tl.range(first, last, num_stages=STAGES):
        block_id = next_id
        next_id = tl.load(table + tl.minimum(j + 1, last - 1)).to(tl.int64)
        base = kv_ptr + block_id * BS * C + offs
        for c in tl.static_range(C // 64):
            total += tl.load(base + c * 64).to(tl.float32)
    tl.store(out_ptr + t * tl.num_programs(1) + tl.program_id(1), tl.sum(total))


@triton.jit
def _read_blocks_tma_kernel(kv_desc, tables_ptr, out_ptr, table_width, num_blocks,
                            BLOCKS: tl.constexpr, BS: tl.constexpr, C: tl.constexpr,
                            STAGES: tl.constexpr):  # fmt: skip
    """_read_blocks_kernel with each cache block copied by TMA (a tensor descriptor over the
    cache as [blocks * BS, C] rows, 64-column boxes), the other way a Hopper kernel reads."""
    t = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCKS
    last = tl.minimum(first + BLOCKS, num_blocks)
    table = tables_ptr + t * table_width
    total = tl.zeros((BS, 64), dtype=tl.float32)
    next_id = tl.load(table + first).to(tl.int32)  # TMA coordinates are 32-bit
    for j in tl.range(first, last, num_stages=STAGES):
        block_id = next_id
        next_id = tl.load(table + tl.minimum(j + 1, last - 1)).to(tl.int32)
        for c in tl.static_range(C // 64):
            total += kv_desc.load([block_id * BS, c * 64]).to(tl.float32)
    tl.store(out_ptr + t * tl.num_programs(1) + tl.program_id(1), tl.sum(total))


def bench_read_floor() -> None:
    """How close any decode attention launch can come to the copy ceiling at 16 heads' shapes
    (the decode-speed issue's >= 80% goal): the time to merely read the same KV bytes, under
    graph replay over L2-missing caches, beside the invariant op (16 heads) and fast mode's
    (FlashMLA where installed): a device copy of the cache (its read and write counted, the
    ceiling's own measure at this size), a flat bf16 -> fp32 torch.sum of it (a tuned library
    reduction, no table), and _read_blocks_kernel (plain loads) and _read_blocks_tma_kernel
    through the block tables at several blocks a program (4: the split launch's programs; a
    whole query: the whole-query launch's), warps and stages, the best of each given with its
    shape. Each % is of the 1 GiB copy ceiling, as every attention figure in BENCHMARKS.md."""
    from moe_kernels.fast_attention import mla_decode_fast
    from moe_kernels.triton_attention import mla_attention_triton

    ceiling = copy_bandwidth(torch.device("cuda")) / 1e12
    print(f"\n## reading the KV cache, no arithmetic, vs decode attention at 16 heads (graph "
          f"replay); copy ceiling {ceiling:.2f} TB/s")  # fmt: skip
    print("| B | ctx | MB read | copy of the cache µs (% of copy) | torch.sum µs (% of copy) "
          "| table read, best µs (% of copy) "
          "[blocks a program, warps, stages] | TMA table read, best µs (% of copy) [same] "
          "| table read, 4 blocks a program µs | table read, "
          "a whole query µs | invariant op µs (% of copy) | fast op µs (% of copy) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch, ctx in ((64, 1024), (64, 4096), (128, 1024), (256, 1024)):
        blocks = ctx // 64
        read = batch * ctx * 576 * 2

        def cache(batch=batch, blocks=blocks):
            return _decode_cache(batch, blocks * 64)

        def flat():
            kv = cache()[1]
            return lambda: kv.sum(dtype=torch.float32)

        def copy():
            kv = cache()[1]
            dst = torch.empty_like(kv)
            return lambda: dst.copy_(kv)

        def table_read(is_tma, per_prog, warps, stages, batch=batch, blocks=blocks):
            _, kv, _, tables, _ = cache()
            progs = -(-blocks // per_prog)
            out = torch.empty(batch * progs, device="cuda")
            if is_tma:
                kernel = _read_blocks_tma_kernel
                source = TensorDescriptor.from_tensor(kv.view(-1, 576), [64, 64])
            else:
                kernel, source = _read_blocks_kernel, kv
            return lambda: kernel[(batch, progs)](
                source, tables, out, tables.shape[1], blocks, BLOCKS=per_prog, BS=64, C=576,
                STAGES=stages, num_warps=warps,
            )  # fmt: skip

        first_step = {}  # fast mode's copies share the first one's step: one plan, as layers do

        def op(fn, is_shared=False, first_step=first_step):
            q, kv, *step = cache()
            if is_shared:
                step = first_step.setdefault("step", step)
            return lambda: fn(q, kv, *step, scale=192**-0.5, v_dim=512)

        def pct(us, read=read):
            return f"{us:.1f} ({read / us / 1e6 / ceiling:.0%})"

        t_flat = _graph_ms(flat, read) * 1e3
        t_copy = _graph_ms(copy, 2 * read) * 1e3
        copied = 2 * read / t_copy / 1e6 / ceiling
        shapes = [
            (b, w, s) for b in sorted({1, 2, 4, 8, 16, blocks}) if b <= blocks
            for w in (4, 8) for s in (2, 3, 4)
        ]  # fmt: skip
        timed = {c: _graph_ms(partial(table_read, False, *c), read) * 1e3 for c in shapes}
        tma = {c: _graph_ms(partial(table_read, True, *c), read) * 1e3 for c in shapes}
        best_tma = min(tma, key=tma.get)
        best = min(timed, key=timed.get)
        four = min(timed[c] for c in shapes if c[0] == 4)
        whole = min(timed[c] for c in shapes if c[0] == blocks)
        t_inv = _graph_ms(partial(op, mla_attention_triton), read, ATTENTION_GRAPH_CALLS) * 1e3
        t_fast = _graph_ms(partial(op, mla_decode_fast, True), read, ATTENTION_GRAPH_CALLS) * 1e3
        print(
            f"| {batch} | {ctx} | {read / 1e6:.1f} | {t_copy:.1f} ({copied:.0%}) | {pct(t_flat)} "
            f"| {pct(timed[best])} "
            f"{list(best)} | {pct(tma[best_tma])} {list(best_tma)} | {four:.1f} | {whole:.1f} "
            f"| {pct(t_inv)} | {pct(t_fast)} |"
        )


def bench_split_size() -> None:
    """The invariant decode attention's KV split size (SPLIT_BLOCKS cache blocks of 64) at 16
    heads, engine-wide block tables (128 entries), each batch's value split, graph replay: the
    constant against 2 and 1 blocks. A query's bits follow the split size, so it is one
    constant for every batch; this shows what each would cost where."""
    from moe_kernels.attention_launch import SPLIT_BLOCKS, value_split
    from moe_kernels.triton_attention import _attend

    sizes = (SPLIT_BLOCKS, 2, 1)
    print("\n## decode attention's KV split size, 16 heads (graph replay)")
    print("| B | ctx | " + " | ".join(f"{b} blocks µs" for b in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    for batch in (1, 8, 64, 256):
        for ctx in (1024, 4096):
            v_parts, lat_chunk = value_split(batch, 512, 128 // SPLIT_BLOCKS)  # 128-wide tables

            def make(split_blocks, batch=batch, ctx=ctx, v_parts=v_parts, lat_chunk=lat_chunk):
                args = (*_decode_cache(batch, ctx), 192**-0.5, 512, split_blocks, 4, 3)
                return lambda: _attend(*args, 16, v_parts, lat_chunk)

            read = batch * ctx * 576 * 2
            us = [_graph_ms(partial(make, b), read) * 1e3 for b in sizes]
            print(f"| {batch} | {ctx} | " + " | ".join(f"{u:.1f}" for u in us) + " |")


def bench_split_larger() -> None:
    """The 16-head invariant decode attention with KV splits of a constant 4, 8 and 16 cache
    blocks, each with the launch rules the op applies to its own splits (value split and table
    read ahead by (query, split) pairs, a program a whole query from 128 queries), beside the
    op as configured, the op with long splits (of 8 from LONG_BLOCKS blocks: a split size that
    follows the query's own length, never the batch; kernels.attention_long_blocks) and
    FlashMLA with one plan a step (where installed), and where the long launch has at most
    16 (query, split) pairs (few_pairs), the long launch with value parts of 64 columns (8
    parts, where the op takes 4 of 128; "!=" where its bits are not the long op's). Since
    51bf165 the op as configured has long splits itself (NARROW_LAUNCH), so its column and
    the long one time the same launch; the 4-block column is the op before.
    Tables as wide as the engine's graph, graph replay over L2-missing caches, µs (/ FlashMLA)."""
    from moe_kernels.attention_launch import (
        LONG_BLOCKS,
        TABLE_AHEAD_MAX_PAIRS,
        split_count,
        table_split_count,
        value_split,
        whole_query_stages,
    )
    from moe_kernels.fast_attention import _decode_flash_mla
    from moe_kernels.triton_attention import _attend, mla_attention_triton

    sizes = (4, 8, 16)
    print("\n## 16-head decode attention, KV splits of 4, 8, 16 blocks and the op (graph replay)")
    cols = " | ".join(f"{s} blocks µs" for s in sizes)
    few_pairs = 16
    print(
        f"| B | ctx | FlashMLA µs | {cols} | op µs | op, long splits from {LONG_BLOCKS} µs "
        f"| long, 8 value parts (<= {few_pairs} pairs) µs |"
    )
    print("|---|---|---|" + "---|" * (len(sizes) + 3))
    shapes = (
        (1, 1024), (1, 2048), (1, 4096), (1, 8192), (8, 1024), (8, 4096), (8, 8192),
        (16, 4096), (32, 2048), (32, 4096), (64, 1024), (64, 2048), (64, 4096), (64, 8192),
        (128, 4096), (256, 4096),
    )  # fmt: skip
    for batch, ctx in shapes:
        width, read, flash_step = _engine_step(batch, ctx)

        def make(split_blocks, batch=batch, ctx=ctx, width=width, flash=flash_step):
            q, kv, seq_ids, tables, positions = _decode_cache(batch, ctx, width=width)
            if split_blocks == "flash":
                return lambda: _decode_flash_mla(q, kv, *flash, 192**-0.5, 512)
            if split_blocks == "long_v8":
                return lambda: _attend(
                    q, kv, seq_ids, tables, positions, 192**-0.5, 512, 4, 4, 3, 16, 8, 64,
                    is_table_ahead=True, long_blocks=LONG_BLOCKS,
                    long_split_blocks=NARROW_LAUNCH.long_split_blocks,
                )  # fmt: skip
            if split_blocks in ("op", "long"):
                long = {"long_blocks": LONG_BLOCKS} if split_blocks == "long" else {}
                return lambda: mla_attention_triton(
                    q, kv, seq_ids, tables, positions, scale=192**-0.5, v_dim=512, **long
                )
            splits = split_count(width, split_blocks, 0)
            v_parts, lat_chunk = value_split(batch, 512, splits)
            whole = whole_query_stages(batch) if v_parts == 1 else None
            ahead = whole is not None or batch * splits <= TABLE_AHEAD_MAX_PAIRS
            return lambda: _attend(
                q, kv, seq_ids, tables, positions, 192**-0.5, 512, split_blocks, 4,
                whole or 3, 16, v_parts, lat_chunk, is_whole_query=whole is not None,
                is_table_ahead=ahead,
            )  # fmt: skip

        try:
            flash = _graph_ms(partial(make, "flash"), read, 8) * 1e3
        except Exception as exc:  # FlashMLA not installed: no ratios
            print(f"FlashMLA: {type(exc).__name__}: {exc}")
            flash = None
        text = [f"{flash:.1f}" if flash else "-"]
        long_split = NARROW_LAUNCH.long_split_blocks
        is_few = batch * table_split_count(width, 4, 0, LONG_BLOCKS, long_split) <= few_pairs
        for launch in (*sizes, "op", "long", *(["long_v8"] if is_few else [])):
            us = _graph_ms(partial(make, launch), read, 8) * 1e3
            text.append(f"{us:.1f} ({us / flash:.2f})" if flash else f"{us:.1f}")
        if is_few:  # the same bits as the op with long splits, or the column is no choice
            same = torch.equal(make("long_v8")(), make("long")())
            text[-1] += "" if same else " !="
        else:
            text.append("-")
        print(f"| {batch} | {ctx} | " + " | ".join(text) + " |")


def bench_long_ahead() -> None:
    """The 16-head op with its long splits where the engine's table is 64 blocks wide (queries
    of 33 to 64 blocks): the table read a block ahead off (the op's choice there: the table's
    most splits of any query, 16 for a query of 63 blocks, make every launch from 9 queries
    256 pairs or more) and on (forced), at mixed batches of one length, each pair's bits
    compared (the read ahead changes none). What the choice's pair count costs where every
    query is long (64 blocks: 8 splits each) and where none is (33-63 blocks: 9-16 splits).
    Graph replay over L2-missing caches, µs."""
    from moe_kernels.triton_attention import _attend, mla_attention_triton

    long = dict(
        long_blocks=NARROW_LAUNCH.long_blocks, long_split_blocks=NARROW_LAUNCH.long_split_blocks
    )
    print("\n## 16-head op, long splits, tables 64 wide: the table read ahead off / on")
    print("| B | ctx | op µs (ahead off) | ahead on µs | on / off |")
    print("|---|---|---|---|---|")
    for batch in (8, 12, 16, 24, 32):
        for ctx in (2200, 3000, 3600, 4096):
            width = _graph_width(-(-ctx // 64))
            read = batch * ctx * 576 * 2

            def make(ahead, batch=batch, ctx=ctx, width=width):
                step = _decode_cache(batch, ctx, width=width)
                if not ahead:
                    return lambda: mla_attention_triton(
                        *step, scale=192**-0.5, v_dim=512, **long
                    )  # fmt: skip
                return lambda: _attend(
                    *step, 192**-0.5, 512, 4, 4, 3, 16, is_table_ahead=True, **long
                )  # fmt: skip

            if not torch.equal(make(False)(), make(True)()):
                raise AssertionError(f"B = {batch} ctx {ctx}: the read ahead moved bits")
            off, on = (_graph_ms(partial(make, a), read, 8) * 1e3 for a in (False, True))
            print(f"| {batch} | {ctx} | {off:.1f} | {on:.1f} | {on / off:.2f} |")


def bench_wide_split_larger() -> None:
    """The 128-head invariant decode attention (the Gluon kernel, 64 heads a program) with KV
    splits of a constant 16 blocks (WIDE_LAUNCH's), 32 and 64, each with the op's tail and its
    value split (wide_value_parts), beside the op and fast mode's op with one plan a step
    (FlashMLA from 8 queries where installed), and the op with long splits (a split size of
    the query's own length: long_split blocks from long_blocks, "long L from B"; kernels.
    attention_long_blocks and attention_long_split_blocks). Tables as wide as the engine's
    graph, graph replay over L2-missing caches, µs (/ fast)."""
    from moe_kernels.attention_launch import WIDE_LAUNCH, split_count, wide_value_parts
    from moe_kernels.fast_attention import mla_decode_fast
    from moe_kernels.triton_attention import _attend, mla_attention_triton

    sizes = (16, 32, 64)
    longs = ((64, 64), (64, 32), (32, 32))  # (long_blocks, long_split_blocks)
    tail = WIDE_LAUNCH.tail_blocks
    print("\n## 128-head decode attention, KV splits of 16, 32, 64 blocks (graph replay)")
    cols = " | ".join(f"{s} blocks µs" for s in sizes)
    long_cols = " | ".join(f"long {size} from {start} µs" for start, size in longs)
    print(f"| B | ctx | fast µs | {cols} | op µs | {long_cols} |")
    print("|---|---|---|" + "---|" * (len(sizes) + 1 + len(longs)))
    # 8000: a table of 126 blocks (the widest graph's 128)
    shapes = (
        (1, 4096), (8, 4096), (8, 8000), (32, 4096), (64, 1024), (64, 2048), (64, 4096),
        (64, 8000), (128, 4096), (256, 1024), (256, 4096),
    )  # fmt: skip
    for batch, ctx in shapes:
        blocks = ctx // 64 + 1  # the engine's decode: a context past a block's end
        width = _graph_width(blocks, 128)
        read = batch * (ctx + 1) * 576 * 2
        step = engine_decode_step(batch, ctx, 128)

        def make(launch, batch=batch, blocks=blocks, step=step, width=width):
            kv = torch.randn(batch * blocks, 64, 576, device="cuda").bfloat16()
            q = torch.randn(batch, 128, 576, device="cuda").bfloat16()
            if launch == "fast":
                return lambda: mla_decode_fast(q, kv, *step, scale=192**-0.5, v_dim=512)
            if launch == "op":
                return lambda: mla_attention_triton(q, kv, *step, scale=192**-0.5, v_dim=512)
            if isinstance(launch, tuple):
                long = dict(long_blocks=launch[0], long_split_blocks=launch[1])
                return lambda: mla_attention_triton(
                    q, kv, *step, scale=192**-0.5, v_dim=512, **long
                )  # fmt: skip
            v_parts = wide_value_parts(batch, split_count(width, launch, tail))
            return lambda: _attend(
                q, kv, *step, 192**-0.5, 512, launch, WIDE_LAUNCH.num_warps,
                WIDE_LAUNCH.num_stages, WIDE_LAUNCH.block_h, is_gluon=True, tail_blocks=tail,
                v_parts=v_parts,
            )  # fmt: skip

        fast = _graph_ms(partial(make, "fast"), read, ATTENTION_GRAPH_CALLS) * 1e3
        text = [f"{fast:.1f}"]
        for launch in (*sizes, "op", *longs):
            us = _graph_ms(partial(make, launch), read, ATTENTION_GRAPH_CALLS) * 1e3
            text.append(f"{us:.1f} ({us / fast:.2f})")
        print(f"| {batch} | {ctx} | " + " | ".join(text) + " |")


def bench_split_sweep() -> None:
    """The 16-head split launch (fewer than 128 programs of whole queries: B < 128) at long
    contexts, every launch shape that keeps its bits: value split (v_parts, lat_chunk), warps,
    stages, the table read a block ahead; graph replay over L2-missing caches, engine-wide
    tables (128 entries, -1 padding), each shape's bits compared with the op's. Shapes that do
    not compile (shared memory) are skipped. The op's own launch and the best are printed."""
    from moe_kernels.attention_launch import SPLIT_BLOCKS
    from moe_kernels.triton_attention import _attend, mla_attention_triton

    print("\n## the 16-head split launch's shapes at long contexts (graph replay)")
    print("| B | ctx | the op µs | best µs [v_parts, lat_chunk, warps, stages, ahead] "
          "| next three | shapes run | shapes with other bits than the op's |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    parts = ((1, None), (2, None), (2, 128), (4, 128))
    shapes = [
        (v, c, w, st, ahead) for v, c in parts for w in (4, 8) for st in (2, 3)
        for ahead in (False, True)
    ]  # fmt: skip
    for batch, ctx in ((8, 8192), (16, 4096), (32, 4096), (64, 2048), (64, 4096)):
        read = batch * ctx * 576 * 2

        def make(shape=None, batch=batch, ctx=ctx):
            q, kv, seq_ids, tables, positions = _decode_cache(batch, ctx)
            if shape is None:
                return lambda: mla_attention_triton(
                    q, kv, seq_ids, tables, positions, scale=192**-0.5, v_dim=512
                )
            v, c, w, st, ahead = shape
            args = (q, kv, seq_ids, tables, positions, 192**-0.5, 512, SPLIT_BLOCKS, w, st)
            return lambda: _attend(*args, 16, v, c, is_table_ahead=ahead)

        bits = make()()
        timed, differ = {}, []
        for shape in shapes:
            try:
                if not torch.equal(make(shape)(), bits):
                    differ.append(list(shape))
                timed[shape] = _graph_ms(partial(make, shape), read) * 1e3
            except triton.runtime.errors.OutOfResources:  # out of shared memory: cannot run
                continue
        op = _graph_ms(make, read) * 1e3
        ranked = sorted(timed, key=timed.get)
        best = ranked[0]
        rest = ", ".join(f"{timed[r]:.1f} {list(r)}" for r in ranked[1:4])
        print(
            f"| {batch} | {ctx} | {op:.1f} | {timed[best]:.1f} {list(best)} | {rest} "
            f"| {len(timed)} | {differ or 'all the same'} |"
        )


def _attention_op(heads: int, batch: int, ctx: int, width: int):
    """The invariant op on a fresh decode step: batch queries of `heads` heads at position
    ctx - 1, each over its own shuffled cache blocks of 64, bf16, tables padded with -1 to
    width blocks."""
    from moe_kernels.triton_attention import mla_attention_triton

    blocks = -(-ctx // 64)
    kv = torch.randn(batch * blocks, 64, 576, device="cuda").bfloat16()
    q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
    tables = torch.full((batch, width), -1, device="cuda", dtype=torch.int64)
    tables[:, :blocks] = torch.randperm(batch * blocks, device="cuda").view(batch, -1)
    seq_ids = torch.arange(batch, device="cuda")
    positions = torch.full((batch,), ctx - 1, device="cuda")
    args = (q, kv, seq_ids, tables, positions)
    return lambda: mla_attention_triton(*args, scale=192**-0.5, v_dim=512)


@contextlib.contextmanager
def _wide_tail(tail_blocks: int):
    """The op's wide launch with tail_blocks (the op reads its launch from head_launch, and a
    launch of 64 heads a program is the wide one whatever its tail: HeadLaunch.is_wide)."""
    import moe_kernels.triton_attention as attention

    saved = attention.head_launch
    tailed = dataclasses.replace(WIDE_LAUNCH, tail_blocks=tail_blocks)
    attention.head_launch = lambda heads: tailed if heads >= WIDE_HEADS else NARROW_LAUNCH
    try:
        yield
    finally:
        attention.head_launch = saved


def bench_tail() -> None:
    """The wide (128-head) launch's tail: a query's last KV split taking up to T blocks past
    its last whole split of 16 instead of a split of its own (one split fewer: no fold in a
    whole-query program, one partial fewer for the merge). The op at 128 heads, graph replay
    (ATTENTION_GRAPH_CALLS calls a graph), contexts of 17 to 33 blocks, tables padded with -1
    to the engine's graph widths (16, 32, 64), T = 0 (no tail) to 8; the op picks the split
    or whole-query launch by the batch as it does in the engine."""

    tails = (0, 1, 2, 4, 8)
    print("\n## the wide launch's tail: 128 heads, µs a call (graph replay)")
    print("| B | ctx | blocks | " + " | ".join(f"T = {t}" for t in tails) + " |")
    print("|---|---|---|" + "---|" * len(tails))
    for batch in (1, 8, 64, 256):
        for ctx in (1088, 1152, 1280, 1344, 2112):
            blocks = -(-ctx // 64)
            make = partial(_attention_op, 128, batch, ctx, _graph_width(blocks))
            read = batch * ctx * 576 * 2
            us = []
            for tail in tails:
                with _wide_tail(tail):
                    us.append(_graph_ms(make, read, ATTENTION_GRAPH_CALLS) * 1e3)
            cells = " | ".join(f"{u:.1f}" for u in us)
            print(f"| {batch} | {ctx} | {blocks} | {cells} |")


@contextlib.contextmanager
def _merge_heads(count: int):
    """The op's merge launch at `count` heads a program (attention_launch.merge_heads's pick
    swapped for the block)."""
    import moe_kernels.triton_attention as attention

    saved = attention.merge_heads
    attention.merge_heads = lambda heads: count
    try:
        yield
    finally:
        attention.merge_heads = saved


def bench_fast_split_kv() -> None:
    """Fast mode's split-KV decode attention, the path it takes at 128 heads up to
    SPLIT_KV_MAX_QUERIES queries, by KV split size and the merge's heads a program, beside its
    rule's choice (choose_split_blocks: WAVES programs an SM), FlashMLA with one plan a step
    where installed, and the invariant op; tables as wide as the engine's graph, graph replay
    over L2-missing caches, µs. Why: at B = 1 context 1024 the rule gave 17 splits of one
    block, and the merge of them took 19.5 of the path's 27.3 µs a layer (fifty-ninth session,
    `layer_kernels_128`), so the fast baseline of the 128-head B = 1 price may be weak."""
    from moe_kernels.attention_launch import merge_heads
    from moe_kernels.fast_attention import (
        HAS_FLASH_MLA,
        NUM_STAGES,
        NUM_WARPS,
        _decode_flash_mla,
        _num_sms,
        choose_split_blocks,
    )
    from moe_kernels.triton_attention import _attend, mla_attention_triton

    sizes, merge_counts = (1, 2, 4, 8, 16), (1, 8)
    cols = [f"{b} blocks, {h} heads a merge" for b in sizes for h in merge_counts]
    print("\n## fast mode's split-KV attention at 128 heads: split size and merge (graph replay)")
    print(f"| B | ctx | rule's split | rule µs | {' | '.join(cols)} | FlashMLA µs | invariant µs |")
    print("|---|---|---|---|" + "---|" * (len(cols) + 2))
    for batch in (1, 2, 4):
        for ctx in (1024, 4096):
            blocks = ctx // 64 + 1
            step = engine_decode_step(batch, ctx, 128)
            read = batch * (ctx + 1) * 576 * 2
            rule = choose_split_blocks(batch, 128, step[1].shape[1], _num_sms(torch.device("cuda")))

            def make(op, batch=batch, blocks=blocks, step=step):
                kv = torch.randn(batch * blocks, 64, 576, device="cuda").bfloat16()
                q = torch.randn(batch, 128, 576, device="cuda").bfloat16()
                return lambda: op(q, kv, *step)

            def split_kv(split_blocks, merge_heads=None):
                return lambda q, kv, *rest: _attend(
                    q, kv, *rest, 192**-0.5, 512, split_blocks, NUM_WARPS, NUM_STAGES,
                    merge_heads_per_program=merge_heads,
                )  # fmt: skip

            def flash(q, kv, seq_ids, tables, positions):
                return _decode_flash_mla(q, kv, tables, positions, 192**-0.5, 512)

            def invariant(q, kv, *rest):
                return mla_attention_triton(q, kv, *rest, scale=192**-0.5, v_dim=512)

            def us(op, read=read, make=make):
                return _graph_ms(partial(make, op), read, ATTENTION_GRAPH_CALLS) * 1e3

            cells = {(b, h): us(split_kv(b, h)) for b in sizes for h in merge_counts}
            # The rule's launch: a cell already timed where its split is one of the sizes.
            rule_key = (rule, merge_heads(128))  # the path's merge: merge_heads's default
            rule_us = cells[rule_key] if rule_key in cells else us(split_kv(rule))
            flash_us = f"{us(flash):.1f}" if HAS_FLASH_MLA else "not installed"
            print(
                f"| {batch} | {ctx} | {rule} | {rule_us:.1f} | "
                f"{' | '.join(f'{c:.1f}' for c in cells.values())} | {flash_us} | "
                f"{us(invariant):.1f} |"
            )


def bench_merge() -> None:
    """The merge launch's heads a program: the op (split launch, then the merge of the fp32
    partials; a query of one split skips the merge) at 1 head a program (the launch before),
    4, 8 and 16, graph replay (ATTENTION_GRAPH_CALLS calls a graph), queries at one context
    in their own shuffled blocks, tables padded with -1 to the engine's graph width for that
    context (128 heads: 18, 34, 66, ... blocks; 16 heads: 16, 32, ... up to 128). 128 heads at
    context 1100 in a 34-block table is a merge where every query has one split (a decode
    step whose table is one width past its queries); in an 18-block table, no merge launch."""
    from moe_kernels.attention_launch import head_launch, split_count

    counts = (1, 4, 8, 16)
    cases = (
        (128, 64, 1100, 18), (128, 256, 1100, 18), (128, 8, 1100, 34), (128, 64, 1100, 34),
        (128, 256, 1100, 34), (128, 64, 2100, 34), (128, 256, 2100, 34), (128, 64, 4100, 66),
        (16, 64, 1100, 32), (16, 64, 4100, 128), (16, 32, 8100, 128),
    )  # fmt: skip
    print("\n## the merge launch's heads a program: the op, µs a call (graph replay)")
    print(
        "| heads | B | ctx | table | splits | "
        + " | ".join(f"{c} a program" for c in counts)
        + " |"
    )
    print("|---|---|---|---|---|" + "---|" * len(counts))
    for heads, batch, ctx, width in cases:
        blocks = -(-ctx // 64)
        make = partial(_attention_op, heads, batch, ctx, width)
        launch = head_launch(heads)
        splits = split_count(blocks, launch.split_blocks, launch.tail_blocks)
        us = []
        for count in counts:
            with _merge_heads(count):
                us.append(_graph_ms(make, batch * ctx * 576 * 2, ATTENTION_GRAPH_CALLS) * 1e3)
        cells = " | ".join(f"{u:.1f}" for u in us)
        print(f"| {heads} | {batch} | {ctx} | {width} | {splits} | {cells} |")


def _linear_graph_us(op, num_rows: int, in_dim: int, out_dim: int) -> float:
    """µs of op(x [num_rows, in_dim], w [out_dim, in_dim]) in bf16 under graph replay, each
    copy on its own random x and w (~1/sqrt(K) weights): _graph_ms's L2-missing copies."""

    def make():
        w = torch.randn(out_dim, in_dim, device="cuda").bfloat16() * in_dim**-0.5
        x = torch.randn(num_rows, in_dim, device="cuda").bfloat16()
        return lambda: op(x, w)

    return _graph_ms(make, 2 * (out_dim * in_dim + num_rows * (in_dim + out_dim))) * 1e3


# V2-Lite weights the tree is measured on (name, K, N): mlp_down, the row-parallel one (its K
# is what TP splits); o_proj and shared_down, row-parallel until they moved to token shares.
ROW_PARALLEL_SHAPES = (
    ("o_proj", 2048, 2048),
    ("shared_down", 2816, 2048),
    ("mlp_down", 10944, 2048),
)


def bench_row_parallel() -> None:
    """The row-parallel linear with the fixed tp_max K split (moe_kernels/triton_tp_linear.py, at
    tp 1: the whole tree on one GPU) vs the invariant linear without it (its own shape-based K
    split) vs cuBLAS, on the row-parallel V2-Lite weights, graph replay (inputs missing L2)
    at every row count: eager do_bench at prefill sizes timed the TMA linear's host-side
    descriptor set-up too (o_proj's linear 45-131 us at 1024 rows across runs, 26 replayed)."""
    from moe_kernels.config import KernelConfig
    from moe_kernels.triton_tp_linear import row_parallel_linear_triton

    tp_max = KernelConfig().tp_max
    arrivals = arrival_counts("cuda")  # as the engine's op table binds them

    def tp1(x, w):
        return row_parallel_linear_triton(x, w, 1, None, None, tp_max=tp_max, arrivals=arrivals)

    ops = {
        "cuBLAS": lambda a, b: torch.matmul(a, b.t()),
        "linear": partial(linear_triton, arrivals=arrivals),
        "tp": tp1,
    }
    print(f"\n## row-parallel linear: tp_max={tp_max} K chunks + tree (tp 1) vs linear vs cuBLAS")
    columns = ("cuBLAS µs", "linear µs", "tp_max µs", "tp / linear", "tp / cuBLAS")
    print("| weight | K | N | M | " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, in_dim, out_dim in ROW_PARALLEL_SHAPES:
        for m in ROW_COUNTS:
            us = {k: _linear_graph_us(op, m, in_dim, out_dim) for k, op in ops.items()}
            print(
                f"| {name} | {in_dim} | {out_dim} | {m} | {us['cuBLAS']:.1f} | "
                f"{us['linear']:.1f} | {us['tp']:.1f} | {us['tp'] / us['linear']:.2f} | "
                f"{us['tp'] / us['cuBLAS']:.2f} |"
            )


LOOP_CONFIGS = (
    LinearConfig(64, 64, 64, 8, 4, 4),
    LinearConfig(128, 64, 64, 8, 4, 3),
    LinearConfig(128, 64, 64, 8, 8, 3),
    LinearConfig(128, 128, 64, 8, 8, 3),
)


def bench_tree_loops() -> None:
    """The in-program tree (o_proj, the shared experts' down: tp_max chunks) and chain (kv_a,
    o_proj at tp_max 1: the linear's own K split) at prefill rows, the kernel's two loop
    forms (`is_chunk_loop` False / True: /0, /1) on a few tiles, graph replay, µs, with
    cuBLAS; '=' where a form gave the default launch's bits."""
    from moe_kernels.config import KernelConfig
    from moe_kernels.triton_chunk_tree import chain_config, linear_chunk_tree
    from moe_kernels.triton_linear_config import k_split_count

    tp_max = KernelConfig().tp_max
    cases = [(name, k, n, tp_max, True) for name, k, n in ROW_PARALLEL_SHAPES[:2]]
    for name, k, n in (("kv_a", 2048, 576), ("o_proj", 2048, 2048), ("shared_down", 2816, 2048)):
        cases.append((name, k, n, k_split_count(n, k, torch.bfloat16), False))
    print("\n## in-program tree / chain: loop forms x tiles, µs (graph replay)")
    for name, in_dim, out_dim, chunks, is_tree in cases:
        kind = "tree" if is_tree else "chain"
        for m in (1024, 8192):
            x = torch.randn(m, in_dim, device="cuda").bfloat16()
            w = torch.randn(out_dim, in_dim, device="cuda").bfloat16() * in_dim**-0.5
            base_cfg = None if is_tree else chain_config(out_dim, in_dim, chunks, torch.bfloat16, m)
            kw = {} if base_cfg is None else {"config": base_cfg}
            want = linear_chunk_tree(x, w, chunks, torch.bfloat16, is_tree=is_tree, **kw)
            cublas = _linear_graph_us(lambda a, b: a @ b.t(), m, in_dim, out_dim)
            cells = [f"cuBLAS {cublas:.1f}"]
            for c in LOOP_CONFIGS:
                for form in (False, True):

                    def op(a, b, c=c, form=form, chunks=chunks, is_tree=is_tree):
                        return linear_chunk_tree(
                            a, b, chunks, torch.bfloat16, c, is_tree=is_tree, is_chunk_loop=form
                        )

                    try:
                        same = "=" if torch.equal(op(x, w), want) else "x"
                    except Exception as err:  # out of shared memory etc.: report, keep going
                        cells.append(f"{_tag(c)}/{form:d}:fail:{type(err).__name__}")
                        continue
                    cells.append(
                        f"{_tag(c)}/{form:d}{same} {_linear_graph_us(op, m, in_dim, out_dim):.1f}"
                    )
            print(f"{name} {kind} x{chunks} M={m}: " + " | ".join(cells), flush=True)


CHAIN_TMA_CONFIGS = (
    LinearConfig(128, 128, 64, 8, 8, 3, True),
    LinearConfig(128, 128, 64, 8, 8, 4, True),
    LinearConfig(128, 256, 64, 8, 8, 3, True),
    LinearConfig(256, 128, 64, 8, 8, 3, True),
    LinearConfig(128, 64, 64, 8, 4, 4, True),
    LinearConfig(64, 128, 64, 8, 4, 4, True),
    LinearConfig(64, 64, 64, 8, 4, 4, True),
)


def bench_chain_tma() -> None:
    """The linear's fixed K split at prefill rows as the chain of chunk sums: the pointer
    kernel's chain (chain_config's tiles; what the launch took before) against the TMA
    persistent kernel's chain (NUM_CHUNKS) on a few tiles and cuBLAS, graph replay, µs; '='
    where the TMA chain gave the pointer chain's bits."""
    from moe_kernels.triton_chunk_tree import (
        CHAIN_CONFIG_16BIT,
        CHAIN_WIDE_CONFIG,
        CHAIN_WIDE_OUT,
        linear_chunk_tree,
    )
    from moe_kernels.triton_linear import _launch_persistent
    from moe_kernels.triton_linear_config import k_split_count

    print("\n## the fixed K split's chain at prefill rows: pointer vs TMA, µs (graph replay)")
    shapes = (
        ("kv_a", 2048, 576), ("o_proj", 2048, 2048), ("shared_down", 2816, 2048),
        ("o_proj_h128", 16384, 2048),
    )  # fmt: skip
    for name, in_dim, out_dim in shapes:
        chunks = k_split_count(out_dim, in_dim, torch.bfloat16)
        pointer = CHAIN_WIDE_CONFIG if out_dim >= CHAIN_WIDE_OUT else CHAIN_CONFIG_16BIT
        for m in (1024, 2048, 8192):

            def chain(a, b, chunks=chunks, pointer=pointer):
                return linear_chunk_tree(a, b, chunks, torch.bfloat16, pointer, is_tree=False)

            x = torch.randn(m, in_dim, device="cuda").bfloat16()
            w = torch.randn(out_dim, in_dim, device="cuda").bfloat16() * in_dim**-0.5
            want = chain(x, w)
            cells = [
                f"cuBLAS {_linear_graph_us(lambda a, b: a @ b.t(), m, in_dim, out_dim):.1f}",
                f"pointer {_tag(pointer)} {_linear_graph_us(chain, m, in_dim, out_dim):.1f}",
            ]
            for c in CHAIN_TMA_CONFIGS:

                def op(a, b, c=c, chunks=chunks):
                    return _launch_persistent(
                        a, b, a.new_empty((a.shape[0], b.shape[0])), c, chunks
                    )

                try:
                    same = "=" if torch.equal(op(x, w), want) else "x"
                except Exception as err:  # out of shared memory etc.: report, keep going
                    cells.append(f"{_tag(c)}:fail:{type(err).__name__}")
                    continue
                cells.append(f"{_tag(c)}{same} {_linear_graph_us(op, m, in_dim, out_dim):.1f}")
            print(f"{name} x{chunks} M={m}: " + " | ".join(cells), flush=True)


def bench_tree_split() -> None:
    """The row-parallel tree at prefill rows split over programs: each sums a subtree of
    adjacent chunks (`launch_split_k`'s chunks_per_program; G2/G4: its fp32 parts added in the
    tree's top levels by a second launch, H1/H2/H4: handed up the tree as the programs
    finish), against the in-program tree (all tp_max chunks in one program, four live fp32
    tiles) and cuBLAS; graph replay, µs; '=' where a split gave the tree's bits."""
    from moe_kernels.config import KernelConfig
    from moe_kernels.triton_chunk_tree import linear_chunk_tree

    tp_max = KernelConfig().tp_max
    arrivals = arrival_counts("cuda")
    configs = (
        LinearConfig(64, 64, 64, 8, 4, 4),
        LinearConfig(128, 64, 64, 8, 8, 3),
        LinearConfig(128, 128, 64, 8, 8, 3),
    )
    print(f"\n## tp_max={tp_max} tree at prefill rows: one program vs G chunks a program")
    for name, in_dim, out_dim in ROW_PARALLEL_SHAPES[:2]:
        chunk_k = in_dim // tp_max
        for m in (1024, 8192):
            x = torch.randn(m, in_dim, device="cuda").bfloat16()
            w = torch.randn(out_dim, in_dim, device="cuda").bfloat16() * in_dim**-0.5
            want = linear_chunk_tree(x, w, tp_max, torch.bfloat16)
            cublas = _linear_graph_us(lambda a, b: a @ b.t(), m, in_dim, out_dim)
            tree = _linear_graph_us(
                lambda a, b: linear_chunk_tree(a, b, tp_max, torch.bfloat16), m, in_dim, out_dim
            )
            cells = [f"cuBLAS {cublas:.1f}", f"tree {tree:.1f}"]
            ways = [(g, False) for g in (2, 4)] + [(g, True) for g in (1, 2, 4)]
            for c in configs:
                for per_program, is_handoff in ways:

                    def op(a, b, c=c, g=per_program, k=chunk_k, h=is_handoff):
                        out = torch.empty(a.shape[0], b.shape[0], device="cuda").bfloat16()
                        return launch_split_k(
                            a, b, out, k, c, is_tree=True, chunks_per_program=g,
                            arrivals=arrivals, is_handoff=h,
                        )  # fmt: skip

                    tag = f"{_tag(c)} {'H' if is_handoff else 'G'}{per_program}"
                    try:
                        same = "=" if torch.equal(op(x, w), want) else "x"
                    except Exception as err:  # out of shared memory etc.: report, keep going
                        cells.append(f"{tag}:fail:{type(err).__name__}")
                        continue
                    us = _linear_graph_us(op, m, in_dim, out_dim)
                    cells.append(f"{tag}{same} {us:.1f}")
            print(f"{name} M={m}: " + " | ".join(cells), flush=True)


def bench_tree_pairs() -> None:
    """The row-parallel tree's paired form (two chunks side by side, PAIRED_TREE_CONFIG, the
    default for chunks of whole K steps) against the one-loop tree (TREE_CONFIG), the chunk
    launch (fp32 parts) and the invariant linear without the tp_max split, with cuBLAS, at
    o_proj's shape (8 chunks of 256 columns), graph replay, µs; '=' where the paired form gave
    the chunk launch's bits."""
    from moe_kernels.config import KernelConfig
    from moe_kernels.triton_chunk_tree import TREE_CONFIG, linear_chunk_tree
    from moe_kernels.triton_tp_linear import launch_tp_chunks

    tp_max = KernelConfig().tp_max
    arrivals = arrival_counts("cuda")
    ops = {
        "cuBLAS": lambda a, b: a @ b.t(),
        "linear": partial(linear_triton, arrivals=arrivals),
        "chunk launch": lambda a, b: launch_tp_chunks(a, b, tp_max, torch.bfloat16),
        "tree": lambda a, b: linear_chunk_tree(a, b, tp_max, torch.bfloat16, TREE_CONFIG),
        "paired": lambda a, b: linear_chunk_tree(a, b, tp_max, torch.bfloat16),
    }
    print(f"\n## tp_max={tp_max} tree at prefill rows: paired form vs one loop, µs (graph replay)")
    print("| weight | M | " + " | ".join(ops) + " | paired / tree | paired / linear |")
    print("|---|---|" + "---|" * (len(ops) + 2))
    for name, in_dim, out_dim in ROW_PARALLEL_SHAPES[:1]:
        for m in (256, 512, 1024, 2048, 8192, 16384):
            x = torch.randn(m, in_dim, device="cuda").bfloat16()
            w = torch.randn(out_dim, in_dim, device="cuda").bfloat16() * in_dim**-0.5
            same = "=" if torch.equal(ops["paired"](x, w), ops["chunk launch"](x, w)) else "x"
            us = {k: _linear_graph_us(op, m, in_dim, out_dim) for k, op in ops.items()}
            cells = " | ".join(f"{v:.1f}" for v in us.values())
            print(
                f"| {name} | {m} | {cells}{same} | {us['paired'] / us['tree']:.2f} | "
                f"{us['paired'] / us['linear']:.2f} |",
                flush=True,
            )


def bench_router() -> None:
    """The router's fp32 logits (V2-Lite 64 x 2048, V3 256 x 7168; bf16 x and weight) four
    ways, graph replay, µs: the invariant linear on the bf16 weight with fp32 output (tensor
    cores, the op), the invariant ieee fp32 GEMM of the upcast weight (CUDA-core FMAs, the op
    before), cuBLAS bf16 with fp32 output (fast mode) and cuBLAS fp32 (F.linear of the upcast
    operands); the max |error| of each against the float64 product, and whether the op gave
    a row the same bits alone as in the 8192-row batch."""
    from moe_kernels.triton_router import router_logits_triton

    arrivals = arrival_counts("cuda")
    print("\n## router logits (fp32 out): µs, graph replay; max |err| vs float64 at 8192 rows")
    print(
        "| experts x hidden | M | op: bf16 tensor cores | ieee fp32 FMAs | cuBLAS bf16->fp32 "
        "| cuBLAS fp32 |"
    )
    print("|---|---|---|---|---|---|")
    for experts, hidden in ((64, 2048), (256, 7168)):
        x_all = torch.randn(8192, hidden, device="cuda").bfloat16()
        w_all = (torch.randn(experts, hidden, device="cuda") * hidden**-0.5).bfloat16()
        exact = (x_all.double() @ w_all.double().t()).float()
        full = router_logits_triton(x_all, w_all, arrivals=arrivals)
        ways = (
            lambda x, w, wf: router_logits_triton(x, w, arrivals=arrivals),
            lambda x, w, wf: linear_triton(x, wf, arrivals=arrivals),
            lambda x, w, wf: torch.mm(x, w.t(), out_dtype=torch.float32),
            lambda x, w, wf: torch.nn.functional.linear(x.float(), wf),
        )
        errs = [(way(x_all, w_all, w_all.float()) - exact).abs().max().item() for way in ways]
        print(f"| {experts} x {hidden} | errors | " + " | ".join(f"{e:.2e}" for e in errs) + " |")
        for m in (1, 8, 64, 256, 1024, 8192):
            same = torch.equal(router_logits_triton(x_all[:m], w_all, arrivals=arrivals), full[:m])
            cells = []
            for way in ways:

                def make(way=way, m=m, e=experts, k=hidden):
                    x = torch.randn(m, k, device="cuda").bfloat16()
                    w = (torch.randn(e, k, device="cuda") * k**-0.5).bfloat16()
                    wf = w.float()
                    return lambda: way(x, w, wf)

                cells.append(_graph_ms(make, 2 * (m + experts) * hidden) * 1e3)
            print(
                f"| {experts} x {hidden} | {m} | {cells[0]:.1f}{'' if same else ' DIFF'} | "
                + " | ".join(f"{c:.1f}" for c in cells[1:])
                + " |",
                flush=True,
            )


def bench_tree_crossover() -> None:
    """Where the in-program tree should take over from the chunk launch (TREE_MIN_ROWS in
    moe_kernels/triton_tp_linear.py): the two paths of the tp_max split side by side at tp 1 on
    the short-chunk weights (o_proj, the shared experts' down), bits checked equal; graph
    replay up to 512 rows, do_bench (L2 flushed) above."""
    from moe_kernels.config import KernelConfig
    from moe_kernels.triton_chunk_tree import linear_chunk_tree
    from moe_kernels.triton_tp_linear import launch_tp_chunks

    tp_max = KernelConfig().tp_max
    arrivals = arrival_counts("cuda")

    def chunks(x, w):
        return launch_tp_chunks(x, w, tp_max, x.dtype, arrivals=arrivals)

    def tree(x, w):
        return linear_chunk_tree(x, w, tp_max, x.dtype)

    print(f"\n## tp_max={tp_max} split: chunk launch vs in-program tree (tp 1)")
    print("| weight | K | N | M | timing | chunk launch µs | tree µs | tree / chunks | same bits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, in_dim, out_dim in ROW_PARALLEL_SHAPES[:2]:
        for m in (128, 256, 512, 1024, 2048, 4096, 8192, 16384):
            w = torch.randn(out_dim, in_dim, device="cuda").bfloat16() * in_dim**-0.5
            x = torch.randn(m, in_dim, device="cuda").bfloat16()
            same = torch.equal(chunks(x, w), tree(x, w))
            if m <= 512:
                timing = "graph"
                us = [_linear_graph_us(op, m, in_dim, out_dim) for op in (chunks, tree)]
            else:
                timing = "eager"
                us = [_ms(partial(op, x, w)) * 1e3 for op in (chunks, tree)]
            print(
                f"| {name} | {in_dim} | {out_dim} | {m} | {timing} | {us[0]:.1f} | {us[1]:.1f} | "
                f"{us[1] / us[0]:.2f} | {same} |"
            )


def _chain(x, w, out, *, num_chunks: int, config: LinearConfig):
    from moe_kernels.triton_chunk_tree import linear_chunk_tree

    return linear_chunk_tree(x, w, num_chunks, out.dtype, config, is_tree=False, out=out)


def bench_split_prefill() -> None:
    """The linear's fixed K split at prefill rows, two paths of the same adds side by side:
    kv_a's chunk launch (fp32 parts, then their sum) vs the in-program chain that replaces it
    from CHAIN_MIN_ROWS; the fp32 router's chunk launch on its earlier large-M tiles vs the
    tiles it takes from FP32_PREFILL_ROWS. cuBLAS beside (x.float() for the router); graph
    replay over L2-missing copies; bits of each pair compared."""
    from moe_kernels.triton_chunk_tree import CHAIN_CONFIG_16BIT
    from moe_kernels.triton_linear_config import (
        BLOCK_K_FP32,
        k_split_chunk,
        k_split_chunks_per_program,
        k_split_count,
    )

    earlier_fp32 = LinearConfig(64, 64, BLOCK_K_FP32, 8, 4, 2)
    print("\n## the linear's fixed K split at prefill rows (graph replay)")
    print("| weight | K | N | chunks | M | cuBLAS µs | A µs | B µs | B / A | same bits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, out_dim, in_dim, w_dtype in (
        ("kv_a", 576, 2048, torch.bfloat16),
        ("router fp32", 64, 2048, torch.float32),
    ):
        num_chunks = k_split_count(out_dim, in_dim, w_dtype)
        chunk_k = k_split_chunk(in_dim, num_chunks)
        for m in (512, 1024, 2048, 4096, 8192):
            op_config = linear_config(out_dim, in_dim, w_dtype, m)
            if w_dtype == torch.float32:  # A: earlier tiles, B: the op's
                paths = [
                    partial(
                        launch_split_k,
                        chunk_k=chunk_k,
                        config=c,
                        is_tree=True,
                        chunks_per_program=k_split_chunks_per_program(w_dtype, num_chunks, m),
                    )
                    for c in (earlier_fp32, op_config)
                ]
            else:  # A: the chunk launch, B: the in-program chain
                paths = [
                    partial(launch_split_k, chunk_k=chunk_k, config=op_config, is_tree=False),
                    partial(_chain, num_chunks=num_chunks, config=CHAIN_CONFIG_16BIT),
                ]

            def make(path, m=m, out_dim=out_dim, in_dim=in_dim, w_dtype=w_dtype):
                w = (torch.randn(out_dim, in_dim, device="cuda") * in_dim**-0.5).to(w_dtype)
                x = torch.randn(m, in_dim, device="cuda").bfloat16()
                out = torch.empty((m, out_dim), dtype=w_dtype, device="cuda")
                if path is None:
                    return lambda: x.to(w_dtype) @ w.t()
                return lambda: path(x, w, out)

            x_bytes = 2 * m * in_dim + out_dim * in_dim * w_dtype.itemsize
            us = [_graph_ms(partial(make, p), x_bytes) * 1e3 for p in (None, *paths)]
            w = (torch.randn(out_dim, in_dim, device="cuda") * in_dim**-0.5).to(w_dtype)
            x = torch.randn(m, in_dim, device="cuda").bfloat16()
            outs = [torch.empty((m, out_dim), dtype=w_dtype, device="cuda") for _ in paths]
            for path, out in zip(paths, outs, strict=True):
                path(x, w, out)
            same = torch.equal(*outs)
            print(
                f"| {name} | {in_dim} | {out_dim} | {num_chunks} | {m} | {us[0]:.1f} | "
                f"{us[1]:.1f} | {us[2]:.1f} | {us[2] / us[1]:.2f} | {same} |"
            )


def _layer_graph(fn) -> torch.cuda.CUDAGraph:
    """fn() captured in a CUDA graph, after one warm-up run on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _layer_graph_us(fn, num_layers: int) -> float:
    """Median µs per layer of fn() (which runs all layers once), replayed in a CUDA graph."""
    graph = _layer_graph(fn)
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median")
    return ms * 1e3 / num_layers


def _layer_parts(model, batch_size: int, ctx: int, block: int) -> dict:
    """Closures running one part of every MoE layer of `model` at a decode step of B tokens."""
    from moe_runtime.forward_batch import ForwardBatch

    layers = model.model.layers[1:]
    blocks = -(-(ctx + 1) // block)
    caches = [
        torch.randn(batch_size * blocks, block, 576, device="cuda").bfloat16() for _ in layers
    ]
    tables = torch.arange(batch_size * blocks, device="cuda").view(batch_size, blocks)
    batch = ForwardBatch(
        torch.zeros(batch_size, dtype=torch.int64, device="cuda"),
        torch.full((batch_size,), ctx, device="cuda"),
        torch.arange(batch_size, device="cuda"),
        tables,
        tables[:, ctx // block] * block + ctx % block,
        torch.arange(batch_size, device="cuda"),
    )
    x = torch.randn(batch_size, 2048, device="cuda").bfloat16()
    moes = [layer.mlp for layer in layers]
    for moe in moes:  # the worker binds these at start-up; world size 1 here
        moe.replica_row = moe.replica_row.cuda()
    routes = [moe.gate(x) for moe in moes]
    phys = [moe.replica_row[ids] for moe, (ids, _) in zip(moes, routes, strict=True)]
    sent = [
        moe.dispatcher.dispatch(x, p, w) for moe, p, (_, w) in zip(moes, phys, routes, strict=True)
    ]
    ys = [moe.experts(rows, sizes) for moe, (rows, sizes, _) in zip(moes, sent, strict=True)]
    with_cache = list(zip(layers, caches, strict=True))
    return {
        "attention": lambda: [layer.attention_part(x, batch, c) for layer, c in with_cache],
        "router": lambda: [moe.gate(x) for moe in moes],
        "dispatch": lambda: [
            moe.dispatcher.dispatch(x, p, w)
            for moe, p, (_, w) in zip(moes, phys, routes, strict=True)
        ],
        "experts": lambda: [
            moe.experts(rows, sizes) for moe, (rows, sizes, _) in zip(moes, sent, strict=True)
        ],
        "combine": lambda: [
            moe.dispatcher.combine(y, handle, w)
            for moe, y, (_, _, handle), (_, w) in zip(moes, ys, sent, routes, strict=True)
        ],
        "shared": lambda: [moe.shared_experts(x) for moe in moes],
        "layer": lambda: [layer(x, batch, c) for layer, c in with_cache],
    }


def bench_layer() -> None:
    """One MoE decoder layer of V2-Lite at decode sizes, part by part, each part run over 8
    layers (8 sets of weights: no L2 reuse, as in a step) in a CUDA graph: µs per layer."""
    from moe_kernels import KernelConfig, build_op_table
    from moe_runtime.model.loader import build_model

    cfg = load_config(
        ROOT / "launch" / "configs" / "v2_lite_gpu.yaml", {"model.num_hidden_layers": 9}
    )
    print("\n## one MoE layer at decode (µs per layer, CUDA graph over 8 layers, ctx 1024)")
    print("| mode | B | attention | router | dispatch | experts | combine | shared | sum | layer |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode in ("invariant", "fast"):
        model = build_model(cfg.model, build_op_table(KernelConfig(mode=mode), "cuda"), "cuda")
        for batch_size in (1, 64):
            parts = _layer_parts(model, batch_size, 1024, cfg.cache.block_size)
            us = {name: _layer_graph_us(fn, 8) for name, fn in parts.items()}
            total = sum(v for k, v in us.items() if k != "layer")
            cells = " | ".join(f"{v:.1f}" for k, v in us.items() if k != "layer")
            print(f"| {mode} | {batch_size} | {cells} | {total:.1f} | {us['layer']:.1f} |")
        del model
        torch.cuda.empty_cache()


def bench_layer_kernels(
    heads: int = 16, modes: tuple[str, ...] = ("invariant",), batches: tuple[int, ...] = (1, 64)
) -> None:
    """One V2-Lite MoE layer at decode (context 1024) with `heads` attention heads, in each of
    `modes`, 8 layers in a CUDA graph, its kernels timed by the profiler over 10 replays:
    count and µs a layer each, against the layer's graph-replay time; without PDL (a kernel
    launched with it counts the time its programs wait for the one before) and on one stream
    (moe_kernels/streams.py: the branches' kernels would overlap), then the layer's time with
    PDL and with both. Two modes side by side say which kernels make a step's price."""
    from torch.profiler import ProfilerActivity, profile

    from moe_kernels import KernelConfig, build_op_table, triton_pdl
    from moe_runtime.model.loader import build_model

    cfg = load_config(
        ROOT / "launch" / "configs" / "v2_lite_gpu.yaml",
        {"model.num_hidden_layers": 9, "model.num_attention_heads": heads},
    )
    for mode in modes:
        model = build_model(cfg.model, build_op_table(KernelConfig(mode=mode), "cuda"), "cuda")
        side = model.ops.side_stream  # None where the mode's table has no side stream
        side_rows = side.max_rows if side else 0
        for batch_size in batches:
            layer = _layer_parts(model, batch_size, 1024, cfg.cache.block_size)["layer"]
            with_both = _layer_graph_us(layer, 8)
            if side:
                side.max_rows = 0  # every branch inline: one stream
            with_pdl = _layer_graph_us(layer, 8)
            was_enabled, triton_pdl.ENABLED = triton_pdl.ENABLED, False
            try:
                wall = _layer_graph_us(layer, 8)
                graph = _layer_graph(layer)
                graph.replay()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        graph.replay()
                    torch.cuda.synchronize()
            finally:
                triton_pdl.ENABLED = was_enabled
                if side:
                    side.max_rows = side_rows
            _print_layer_kernels(prof, f"{mode}, {heads} heads, B = {batch_size}", wall,
                                 with_pdl, with_both)  # fmt: skip
        del model
        torch.cuda.empty_cache()


def _print_layer_kernels(prof, label: str, wall: float, with_pdl: float, with_both: float):
    times: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(event.name[:60], []).append(event.device_time)
    num_layers = 8 * 10
    busy = sum(sum(v) for v in times.values()) / num_layers
    count = sum(len(v) for v in times.values()) / num_layers
    print(
        f"\n## {label}: {wall:.1f} us a layer without PDL on one stream "
        f"({with_pdl:.1f} with PDL, {with_both:.1f} with PDL and the side stream), "
        f"{count:.0f} kernels, {busy:.1f} us of kernel time"
    )
    print("| kernel | launches a layer | us each | us a layer |")
    print("|---|---|---|---|")
    for name, v in sorted(times.items(), key=lambda item: -sum(item[1])):
        print(f"| {name} | {len(v) / num_layers:.0f} | {sum(v) / len(v):.1f} | "
              f"{sum(v) / num_layers:.1f} |")  # fmt: skip


def _print_row(label: str, num_bytes: int, t_triton: float, t_torch: float, ceiling: float):
    tbs_triton, tbs_torch = num_bytes / t_triton / 1e9, num_bytes / t_torch / 1e9
    print(
        f"{label}: triton {t_triton * 1e3:8.1f} us {tbs_triton:5.2f} TB/s "
        f"({tbs_triton / ceiling:4.0%} of copy) | torch {t_torch * 1e3:8.1f} us "
        f"{tbs_torch:5.2f} TB/s ({tbs_torch / ceiling:4.0%})"
    )


def bench_rows() -> None:
    print("\n## row ops: bandwidth (read + write) vs device copy")
    src = torch.empty(2**28, device="cuda", dtype=torch.bfloat16).normal_()  # 512 MiB
    dst = torch.empty_like(src)
    copy_tbs = 2 * src.numel() * 2 / (_ms(lambda dst=dst, src=src: dst.copy_(src)) * 1e-3) / 1e12
    print(f"device copy ceiling: {copy_tbs:.2f} TB/s")
    del src, dst
    weight = torch.rand(2048, device="cuda", dtype=torch.bfloat16) + 0.5
    for m in (1, 64, 4096, 65536):
        x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
        num_bytes = 2 * x.numel() * 2
        t_triton = _ms(lambda x=x: rms_norm_triton(x, weight, 1e-6))
        t_torch = _ms(lambda x=x: rms_norm_fast(x, weight, 1e-6))
        _print_row(f"rms_norm    T={m:6} D=2048 bf16", num_bytes, t_triton, t_torch, copy_tbs)
    for m in (1, 64, 1024, 4096):
        x = torch.randn(m, 102400, device="cuda", dtype=torch.float32)
        num_bytes = 2 * x.numel() * 4
        t_triton = _ms(lambda x=x: log_softmax_triton(x))
        t_torch = _ms(lambda x=x: torch.log_softmax(x, dim=-1))
        _print_row(f"log_softmax T={m:6} V=102400 fp32", num_bytes, t_triton, t_torch, copy_tbs)


# One decode row's linears (V2-Lite, B = 1): (name, out_dim, in_dim, routed experts; 0: plain).
DECODE_ROW_LINEARS = (
    ("q_proj", 3072, 2048, 0),
    ("kv_a", 576, 2048, 0),
    ("o_proj", 2048, 2048, 0),
    ("shared_gate_up", 5632, 2048, 0),
    ("shared_down", 2048, 2816, 0),
    ("routed_gate_up", 2816, 2048, 6),
    ("routed_down", 2048, 1408, 6),
)
DECODE_TILE_SWEEP = [
    LinearConfig(16, n, k, 8, w, s)
    for k in (64, 128, 256)
    for n in (16, 32, 64)
    for w in (2, 4)
    for s in (3, 4, 6, 8)
    if k * s <= 1024
]


def bench_decode_tiles() -> None:
    """Tile configs of the linears of a one-row decode step (the B = 1 engine's), graph replay
    over weight copies that miss L2, µs; each config's bits against the bucket's own config
    ('x': they differ, never used). Routed: 6 rows, one token's top-6 of 64 experts, the
    gated launch for gate_up; the plain ones with a fixed K split take it (launch_split_k)."""
    print("\n## one-row decode linears: tile configs, graph replay us (x: other bits)")
    arrivals = arrival_counts("cuda")
    for name, out_dim, in_dim, top_k in DECODE_ROW_LINEARS:
        _sweep_decode_linear(name, out_dim, in_dim, top_k, arrivals)


def _sweep_decode_linear(name, out_dim, in_dim, top_k, arrivals) -> None:
    from moe_kernels.triton_grouped_linear import _grouped

    rows = max(top_k, 1)
    counts = torch.zeros(64, dtype=torch.int64)
    counts[torch.randperm(64, generator=torch.Generator().manual_seed(0))[:top_k]] = 1
    counts = counts.cuda()
    shape = (64, out_dim, in_dim) if top_k else (out_dim, in_dim)

    def run(c, x, w):
        if top_k:
            return _grouped(x, w, counts, None, is_gated=out_dim > 2048, config=c)
        out = x.new_empty((x.shape[0], out_dim))
        return _launch(x, w, out, x.shape[0], c, arrivals=arrivals)

    def make(c, gen=None):
        w = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        x = torch.randn(rows, in_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        return lambda: run(c, x, w)

    if top_k:
        default = grouped_config(out_dim, in_dim, torch.bfloat16, rows, 64)
    else:
        default = linear_config(out_dim, in_dim, torch.bfloat16, rows)
    num_bytes = 2 * out_dim * in_dim * rows
    ref = make(default, torch.Generator(device="cuda").manual_seed(1))()
    cells = []
    for c in [default] + [c for c in DECODE_TILE_SWEEP if c != default]:
        try:
            same = torch.equal(make(c, torch.Generator(device="cuda").manual_seed(1))(), ref)
            cells.append((_graph_ms(partial(make, c), num_bytes), c, "" if same else "x"))
        except Exception as err:  # out of shared memory etc.: report, keep sweeping
            print(f"  {name} {_tag(c)}: {type(err).__name__}")
    floor_us = num_bytes / 4.2e6
    experts = f", {top_k} experts" if top_k else ""
    print(
        f"{name} ({out_dim} x {in_dim}{experts}; floor at 4.2 TB/s {floor_us:.1f} us): "
        f"default {_tag(default)} {cells[0][0] * 1e3:.1f}"
    )
    cells.sort(key=lambda item: item[0])
    print("  " + " ".join(f"{_tag(c)}{mark}={t * 1e3:.1f}" for t, c, mark in cells[:16]))


# The linears V3's 128 heads grow eightfold (V2-Lite's hidden size): (name, batch, K, N, row
# counts; x [batch, rows, K]); q_proj and o_proj plain (o_proj on its fixed K split), the
# absorbed W_UK / W_UV products one batched launch over the heads (at V2-Lite's 16 too).
def _sweep_tiles(make, triton_op, configs, num_bytes: int, label: str) -> dict:
    """{config: (graph-replay ms, whether its output has configs[0]'s bits)} over make's
    seeded inputs (make(op, generator) -> a call of op(x, w, out)); a config that fails to
    launch (out of shared memory etc.) is reported and left out."""
    seed = partial(torch.Generator(device="cuda").manual_seed, 1)
    ref = make(triton_op(configs[0]), seed())().clone()
    cells = {}
    for c in dict.fromkeys(configs):
        try:
            same = torch.equal(make(triton_op(c), seed())(), ref)
            cells[c] = (_graph_ms(partial(make, triton_op(c)), num_bytes), same)
        except Exception as err:  # report, keep sweeping
            print(f"  {label} {_tag(c)}: {type(err).__name__}")
    return cells


def _ranked_line(cells: dict) -> str:
    """The configs fastest first, 'x' after a tag whose bits differ from the first config's."""
    ranked = sorted(cells.items(), key=lambda item: item[1][0])
    return "  " + " ".join(f"{_tag(c)}{'' if s else 'x'}={t * 1e3:.1f}" for c, (t, s) in ranked)


HEADS_LINEARS = (
    ("q_proj", 0, 2048, 128 * 192, (64, 128, 256)),
    ("o_proj", 0, 128 * 128, 2048, (64, 128, 256)),
    ("w_uk", 128, 128, 512, (1, 16, 64, 128, 256)),
    ("w_uv", 128, 512, 128, (1, 16, 64, 128, 256)),
    ("w_uk", 16, 128, 512, (1, 16, 64, 128, 256)),
    ("w_uv", 16, 512, 128, (1, 16, 64, 128, 256)),
)
# The grouped sweep's tiles and the narrow ones the plain decode buckets take.
HEADS_SWEEP = [
    LinearConfig(16, 32, 64, 8, 4, 6),
    LinearConfig(64, 32, 64, 8, 4, 4),
    LinearConfig(128, 128, 64, 8, 4, 4),
    LinearConfig(64, 128, 64, 8, 4, 4, True),
] + GROUPED_SWEEP


def bench_heads() -> None:
    """Tile configs of the decode linears that grow with the head count, graph replay over
    weight copies that miss L2, us, against cuBLAS (torch.matmul) in the same run: the config
    the launch takes ('rule': batched_config for the batched products) and the plain row
    bucket's (linear_config) first, then every candidate, fastest first; 'x' marks a config
    whose bits differ from the rule's. Persistent configs run only where the launch takes
    them (plain, no K split)."""
    print("\n## decode linears by head count: tile configs, graph replay us (x: other bits)")
    arrivals = arrival_counts("cuda")
    for name, batch, in_dim, out_dim, row_counts in HEADS_LINEARS:
        for rows in row_counts:
            x_shape = (batch, rows, in_dim) if batch else (rows, in_dim)
            w_shape = (batch, out_dim, in_dim) if batch else (out_dim, in_dim)
            o_shape = (batch, rows, out_dim) if batch else (rows, out_dim)

            def make(op, gen=None, x_shape=x_shape, w_shape=w_shape, o_shape=o_shape):
                w = torch.randn(*w_shape, device="cuda", dtype=torch.bfloat16, generator=gen)
                x = torch.randn(*x_shape, device="cuda", dtype=torch.bfloat16, generator=gen)
                out = x.new_empty(o_shape)
                return lambda: op(x, w, out)

            def triton_op(c, rows=rows):
                return lambda x, w, out: _launch(x, w, out, rows, c, arrivals=arrivals)

            def cublas(x, w, out):
                return torch.matmul(x, w.transpose(-1, -2), out=out)

            plain = linear_config(out_dim, in_dim, torch.bfloat16, rows)
            rule = batched_config(out_dim, in_dim, torch.bfloat16, rows, batch) if batch else plain
            num_bytes = 2 * (max(batch, 1) * (out_dim * in_dim + rows * (in_dim + out_dim)))
            t_cublas = _graph_ms(partial(make, cublas), num_bytes)
            # (persistent configs left out here: o_proj's K split runs the pointer kernel's
            # split at these rows, and the batched products' TMA form is heads_prefill's)
            configs = [rule, plain] + [
                c for c in HEADS_SWEEP if not (c.is_persistent and (batch or name == "o_proj"))
            ]
            cells = _sweep_tiles(make, triton_op, configs, num_bytes, f"{name} M={rows}")
            print(
                f"{name} x{max(batch, 1)} M={rows} K={in_dim} N={out_dim} (floor "
                f"{num_bytes / 4.2e6:.1f} us): cublas {t_cublas * 1e3:.1f}, rule {_tag(rule)} "
                f"{cells[rule][0] * 1e3:.1f} ({cells[rule][0] / t_cublas:.2f}x), plain bucket "
                f"{_tag(plain)} {cells[plain][0] * 1e3:.1f} ({cells[plain][0] / t_cublas:.2f}x)"
            )
            print(_ranked_line(cells))


# Prefill rows of the absorbed products, in the engine's layout (moe_runtime/model/mla.py):
# W_UK reads q_nope out of the projected query [T, H, 192] and writes into the query buffer
# [T, H, 576]; W_UV reads the attention's [T, H, 512] and writes [T, H, 128].
PREFILL_HEADS = (128, 16)
PREFILL_HEAD_ROWS = (1024, 8192)
PREFILL_HEADS_SWEEP = [
    LinearConfig(128, 128, 64, 8, 8, 3),
    LinearConfig(128, 128, 64, 8, 4, 3),
    LinearConfig(128, 128, 64, 8, 4, 2),
    LinearConfig(128, 256, 64, 8, 8, 2),
    LinearConfig(128, 256, 64, 8, 8, 3),
    LinearConfig(256, 128, 64, 8, 8, 2),
    LinearConfig(64, 256, 64, 8, 4, 2),
    LinearConfig(128, 64, 64, 8, 4, 3),
    LinearConfig(64, 128, 64, 8, 4, 3),
    LinearConfig(256, 64, 64, 8, 8, 2),
    # The TMA kernel's batched form (3-d descriptors over the strided views; batched_config
    # takes 128x256/w8/s3 and 128x128/w8/s4 of these past MEDIUM_ROWS)
    LinearConfig(128, 128, 64, 8, 8, 3, True),
    LinearConfig(128, 128, 64, 8, 8, 4, True),
    LinearConfig(128, 256, 64, 8, 8, 3, True),
    LinearConfig(64, 128, 64, 8, 4, 4, True),
]


def bench_heads_prefill() -> None:
    """The absorbed W_UK / W_UV products at prefill rows in the engine's strided layout, graph
    replay, us: the config the launch takes (batched_config) against cuBLAS's bmm into the same
    views, then every candidate, fastest first ('x': bits differ from the rule's). Floor: the
    bytes read and written at 4.2 TB/s."""
    print("\n## absorbed products at prefill rows, engine layout: graph replay us (x: other bits)")
    for heads in PREFILL_HEADS:
        for name, in_dim, out_dim in (("w_uk", 128, 512), ("w_uv", 512, 128)):
            for rows in PREFILL_HEAD_ROWS:

                def make(op, gen=None, heads=heads, rows=rows, name=name, i=in_dim, o=out_dim):
                    w = torch.randn(heads, o, i, device="cuda", dtype=torch.bfloat16, generator=gen)
                    if name == "w_uk":
                        src = torch.randn(rows, heads, 192, device="cuda", generator=gen)
                        x = src.bfloat16()[..., :128].transpose(0, 1)
                        out = x.new_empty((rows, heads, 576))[..., :512].transpose(0, 1)
                    else:
                        src = torch.randn(rows, heads, 512, device="cuda", generator=gen)
                        x = src.bfloat16().transpose(0, 1)
                        out = x.new_empty((rows, heads, 128)).transpose(0, 1)
                    return lambda: op(x, w, out)

                def triton_op(c, rows=rows):
                    return lambda x, w, out: _launch(x, w, out, rows, c)

                def cublas(x, w, out):
                    return torch.bmm(x, w.transpose(1, 2), out=out)

                rule = batched_config(out_dim, in_dim, torch.bfloat16, rows, heads)
                num_bytes = 2 * heads * (out_dim * in_dim + rows * (in_dim + out_dim))
                t_cublas = _graph_ms(partial(make, cublas), num_bytes)
                configs = [rule] + PREFILL_HEADS_SWEEP
                cells = _sweep_tiles(make, triton_op, configs, num_bytes, f"{name} M={rows}")
                print(
                    f"{name} x{heads} M={rows} K={in_dim} N={out_dim} (floor "
                    f"{num_bytes / 4.2e6:.1f} us): cublas {t_cublas * 1e3:.1f}, rule {_tag(rule)} "
                    f"{cells[rule][0] * 1e3:.1f} ({cells[rule][0] / t_cublas:.2f}x)",
                    flush=True,
                )
                print(_ranked_line(cells))


# Rows of a decode step at the engine's graph batch sizes: where fast mode's kernel choice is
# measured (bench_fast_choice).
FAST_CHOICE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FAST_CHOICE_CONTEXTS = (1024, 4096)


@dataclasses.dataclass(frozen=True)
class FastChoiceModel:
    """The shapes of one model's decode step that fast mode picks a kernel for: the plain
    linears (name, out, in; lm_head last), the absorbed W_UK / W_UV products at `heads`, the
    router (experts, hidden, its top-k routing) and attention at `heads`."""

    name: str
    linears: tuple
    heads: int
    experts: int
    hidden: int
    routing: dict
    attention_heads: tuple
    routed: tuple = ()  # the routed experts' (name, out, in): fast mode's grouped GEMM rule


def _routing(*values) -> dict:
    """The router's top-k keywords (router_topk_fast's) from their values in its order."""
    keys = ("top_k", "num_groups", "topk_group", "scoring_func", "topk_method")
    return dict(zip((*keys, "norm_topk_prob", "routed_scaling_factor"), values, strict=True))


FAST_CHOICE_MODELS = {
    "v2_lite": FastChoiceModel(
        "V2-Lite",
        tuple((n, o, i) for n, o, i, k in DECODE_ROW_LINEARS if not k)
        + (("lm_head", 102400, 2048),),
        heads=16,
        experts=64,
        hidden=2048,
        routing=_routing(6, 1, 1, "softmax", "greedy", False, 1.0),
        attention_heads=(16, 128),
    ),  # fmt: skip
    # DeepSeek-V3's (hidden 7168, q_lora_rank 1536, 128 heads of 128 + 64 rope, v_head 128, one
    # shared expert of 2048, 256 routed experts top-8 in 8 groups of which 4, sigmoid with
    # the correction bias, vocabulary 129280).
    "v3": FastChoiceModel(
        "V3",
        (
            ("q_a", 1536, 7168),
            ("q_b", 24576, 1536),
            ("kv_a", 576, 7168),
            ("o_proj", 7168, 16384),
            ("shared_gate_up", 4096, 7168),
            ("shared_down", 7168, 2048),
            ("lm_head", 129280, 7168),
        ),
        heads=128,
        experts=256,
        hidden=7168,
        routing=_routing(8, 8, 4, "sigmoid", "noaux_tc", True, 2.5),
        attention_heads=(),  # 128 heads: the V2-Lite section's rows
        routed=(("routed_gate_up", 4096, 7168), ("routed_down", 7168, 2048)),
    ),  # fmt: skip
}


def bench_fast_choice(model: str = "v2_lite") -> None:
    """Fast mode's candidates at decode rows, graph replay over inputs that miss L2, µs: for
    each op of a decode step of `model` (FAST_CHOICE_MODELS), the vendor kernel fast mode
    runs (cuBLAS, torch's router, FlashMLA with one plan a step) against the repo's Triton
    kernel of the same op (the invariant one, which fast mode may run too). Where the Triton
    one is the faster, fast mode is not yet the best path a user could run
    (moe_kernels/op_table.py)."""
    from moe_kernels.fast_attention import HAS_FLASH_MLA, mla_decode_fast
    from moe_kernels.linear import batched_linear_fast, grouped_linear_cuda_fast
    from moe_kernels.router import router_logits_fast, router_topk_fast
    from moe_kernels.triton_attention import mla_attention_triton
    from moe_kernels.triton_linear import batched_linear_triton
    from moe_kernels.triton_router import router_logits_triton, router_topk_triton

    shape = FAST_CHOICE_MODELS[model]
    arrivals = arrival_counts("cuda")
    print(
        f"\n## fast mode's candidates at {shape.name} decode rows: vendor vs Triton, "
        "graph replay µs"
    )
    print("| op | shape | " + " | ".join(f"M={m}" for m in FAST_CHOICE_ROWS) + " |")
    print("|---|---|" + "---|" * len(FAST_CHOICE_ROWS))

    def row(name, dims, cell):
        cells = []
        for m in FAST_CHOICE_ROWS:
            vendor, ours = cell(m)
            cells.append(f"{vendor:.1f} / {ours:.1f}{' *' if ours < vendor else ''}")
        print(f"| {name} | {dims} | " + " | ".join(cells) + " |", flush=True)

    triton_linear = partial(linear_triton, arrivals=arrivals)
    for name, out_dim, in_dim in shape.linears:
        row(name, f"{out_dim} x {in_dim}", lambda m, o=out_dim, i=in_dim: (
            _linear_graph_us(torch.nn.functional.linear, m, i, o),
            _linear_graph_us(triton_linear, m, i, o),
        ))  # fmt: skip

    def batched(op, m, heads, in_dim, out_dim):
        def make():
            w = torch.randn(heads, out_dim, in_dim, device="cuda").bfloat16() * in_dim**-0.5
            x = torch.randn(m, heads, in_dim, device="cuda").bfloat16()
            out = torch.empty(m, heads, out_dim, device="cuda").bfloat16()
            return lambda: op(x.transpose(0, 1), w, out=out.transpose(0, 1))

        return _graph_ms(make, 2 * heads * (out_dim * in_dim + m * (in_dim + out_dim))) * 1e3

    heads = shape.heads
    for name, in_dim, out_dim in ((f"W_UK x{heads}", 128, 512), (f"W_UV x{heads}", 512, 128)):
        row(name, f"K {in_dim} N {out_dim}", lambda m, i=in_dim, o=out_dim: (
            batched(batched_linear_fast, m, heads, i, o),
            batched(batched_linear_triton, m, heads, i, o),
        ))  # fmt: skip
    experts, hidden = shape.experts, shape.hidden
    row("router logits", f"{experts} x {hidden} fp32", lambda m: (
        _linear_graph_us(router_logits_fast, m, hidden, experts),
        _linear_graph_us(partial(router_logits_triton, arrivals=arrivals), m, hidden, experts),
    ))  # fmt: skip

    def topk(op, m):
        def make():
            logits = torch.randn(m, experts, device="cuda")
            bias = None
            if shape.routing["topk_method"] == "noaux_tc":
                bias = torch.randn(experts, device="cuda") * 0.1
            return lambda: op(logits, bias, **shape.routing)

        return _graph_ms(make, m * experts * 4, min_copies=ATTENTION_GRAPH_CALLS) * 1e3

    top_k = shape.routing["top_k"]
    row("router top-k", f"{experts} experts, top {top_k}", lambda m: (
        topk(router_topk_fast, m), topk(router_topk_triton, m)
    ))  # fmt: skip

    def grouped(op, m, out_dim, in_dim):
        """A decode step's m tokens routed to top_k of the experts at random (one draw for
        both ops), the bytes of the experts touched."""
        gen = torch.Generator().manual_seed(m)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(m)])
        counts = torch.bincount(ids.reshape(-1), minlength=experts).cuda()
        num_bytes = int((counts > 0).sum()) * out_dim * in_dim * 2

        def make():
            w = torch.randn(experts, out_dim, in_dim, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(m * top_k, in_dim, device="cuda", dtype=torch.bfloat16)
            return lambda: op(x, w, counts)

        return _graph_ms(make, num_bytes) * 1e3

    for name, out_dim, in_dim in shape.routed:
        row(f"{name} x{experts}", f"{out_dim} x {in_dim}", lambda m, o=out_dim, i=in_dim: (
            grouped(grouped_linear_cuda_fast, m, o, i), grouped(grouped_linear_triton, m, o, i)
        ))  # fmt: skip
    if not shape.attention_heads:
        return
    if not HAS_FLASH_MLA:
        print("FlashMLA not installed: no attention rows")
        return
    for heads in shape.attention_heads:
        for ctx in FAST_CHOICE_CONTEXTS:

            def attention(op, m, ctx=ctx, heads=heads):
                blocks = -(-ctx // 64)
                width = _graph_width(blocks, heads)
                seq_ids = torch.arange(m, device="cuda")
                positions = torch.full((m,), ctx - 1, device="cuda")
                tables = torch.full((m, width), -1, device="cuda", dtype=torch.int64)
                tables[:, :blocks] = torch.randperm(m * blocks, device="cuda").view(m, blocks)

                def make():  # the step (tables, positions) shared: one FlashMLA plan
                    kv = torch.randn(m * blocks, 64, 576, device="cuda").bfloat16()
                    q = torch.randn(m, heads, 576, device="cuda").bfloat16()
                    args = (q, kv, seq_ids, tables, positions)
                    return lambda: op(*args, scale=192**-0.5, v_dim=512, whole_heads=heads)

                read = m * ctx * 576 * 2
                return _graph_ms(make, read, ATTENTION_GRAPH_CALLS) * 1e3

            row(f"attention {heads} heads", f"ctx {ctx}", lambda m, a=attention: (
                a(mla_decode_fast, m), a(mla_attention_triton, m)
            ))  # fmt: skip


def sections() -> dict:
    """Each section's name (the command-line words) and its function."""
    return {
        "rows": bench_rows,
        "linear": bench_linear,
        "grouped": bench_grouped,
        "grouped_sweep": bench_grouped_sweep,
        "sweep": bench_config_sweep,
        "attention": bench_attention,
        "whole_query": bench_whole_query,
        "groups": bench_groups,
        "layer": bench_layer,
        "layer_kernels": bench_layer_kernels,
        "layer_kernels_128": partial(bench_layer_kernels, 128, ("invariant", "fast"), (1,)),
        "row_parallel": bench_row_parallel,
        "tree_crossover": bench_tree_crossover,
        "tree_loops": bench_tree_loops,
        "tree_split": bench_tree_split,
        "chain_tma": bench_chain_tma,
        "tree_pairs": bench_tree_pairs,
        "router": bench_router,
        "prefill_linears": bench_prefill_linears,
        "split_prefill": bench_split_prefill,
        "value_split": bench_value_split,
        "wide_value_split": bench_wide_value_split,
        "split_size": bench_split_size,
        "split_larger": bench_split_larger,
        "wide_split_larger": bench_wide_split_larger,
        "long_ahead": bench_long_ahead,
        "tail": bench_tail,
        "merge": bench_merge,
        "fast_split_kv": bench_fast_split_kv,
        "split_sweep": bench_split_sweep,
        "read_floor": bench_read_floor,
        "decode_tiles": bench_decode_tiles,
        "heads": bench_heads,
        "heads_prefill": bench_heads_prefill,
        "fast_choice": bench_fast_choice,
        "fast_choice_v3": partial(bench_fast_choice, "v3"),
    }


def main() -> None:
    table = sections()
    names = sys.argv[1:] or ["rows", "linear", "grouped", "attention"]
    # Why before the device: `--help` or a mistyped name answered with the list, not a CUDA
    # error (no device) or a KeyError after the device line.
    if {"-h", "--help"} & set(names) or not set(names) <= set(table):
        unknown = [n for n in names if n not in table and n not in ("-h", "--help")]
        print(__doc__.split("\n")[0] + "\n\nusage: python bench/gpu_kernels.py [SECTION ...]")
        print("sections (default: rows linear grouped attention): " + " ".join(table))
        if unknown:
            print(f"unknown section(s): {' '.join(unknown)}", file=sys.stderr)
        sys.exit(2 if unknown else 0)
    print(
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"triton {triton.__version__}"
    )
    for name in names:
        table[name]()


if __name__ == "__main__":
    main()
