"""The measured cost of batch invariance on one GPU, in one run.

Invariant Triton linear vs cuBLAS (torch.matmul, bf16) over the DeepSeek-V2-Lite linear
shapes and a sweep of token counts M; Triton RMSNorm and log-softmax bandwidth against a
device copy measured in the same run (the ceiling), with the torch versions beside them.
Times are medians of triton.testing.do_bench (CUDA events, warm-up, L2 flushed per call).

    PYTHONUNBUFFERED=1 python bench/gpu_kernels.py [rows linear grouped attention sweep]
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.testing

# Run as a script from anywhere: the repository root holds the top-level packages.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.linear import grouped_linear_fast  # noqa: E402
from kernels.rmsnorm import rms_norm_fast  # noqa: E402
from kernels.triton_linear import (  # noqa: E402
    LinearConfig,
    _launch,
    grouped_linear_triton,
    linear_config,
    linear_triton,
)
from kernels.triton_rmsnorm import rms_norm_triton  # noqa: E402
from kernels.triton_softmax import log_softmax_triton  # noqa: E402
from moe_runtime.config import load_config  # noqa: E402

# (name, in_dim K, out_dim N) of DeepSeek-V2-Lite (hidden 2048), from the shipped config.
LINEAR_SHAPES = load_config(ROOT / "launch" / "configs" / "v2_lite_gpu.yaml").model.linear_shapes()
ROW_COUNTS = (1, 16, 64, 256, 1024, 4096, 16384)
L2_BYTES = 60 << 20


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _graph_ms(make_fn, num_bytes: int) -> float:
    """Median time of one call, replayed in a CUDA graph (no launch gaps) over enough copies
    of the inputs that they do not fit in L2 (each call reads from HBM, as in a decode step)."""
    copies = max(1, min(32, -(-4 * L2_BYTES // max(num_bytes, 1))))
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
    for name, in_dim, out_dim in LINEAR_SHAPES:
        w = torch.randn(out_dim, in_dim, device="cuda", dtype=torch.bfloat16) * in_dim**-0.5
        for m in ROW_COUNTS:
            x = torch.randn(m, in_dim, device="cuda", dtype=torch.bfloat16)
            t_cublas = _ms(lambda x=x, w=w: torch.matmul(x, w.t()))
            t_triton = _ms(lambda x=x, w=w: linear_triton(x, w))
            g_cublas = g_triton = float("nan")
            if m <= 256:  # graph replay: the kernels alone, as a decode step under a graph

                def make(op, m=m, in_dim=in_dim, out_dim=out_dim):
                    wc = torch.randn(out_dim, in_dim, device="cuda", dtype=torch.bfloat16)
                    xc = torch.randn(m, in_dim, device="cuda", dtype=torch.bfloat16)
                    return lambda: op(xc, wc)

                num_bytes = 2 * (out_dim * in_dim + m * (in_dim + out_dim))
                g_cublas = _graph_ms(lambda: make(lambda a, b: torch.matmul(a, b.t())), num_bytes)
                g_triton = _graph_ms(lambda: make(linear_triton), num_bytes)
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
    print("\n## grouped expert GEMM (8 local experts, 2048 -> 2x1408): Triton vs torch loop")
    w = torch.randn(8, 2 * 1408, 2048, device="cuda", dtype=torch.bfloat16) * 2048**-0.5
    for rows_per_expert in (1, 16, 128, 1024):
        sizes = [rows_per_expert] * 8
        x = torch.randn(sum(sizes), 2048, device="cuda", dtype=torch.bfloat16)
        t_fast = _ms(lambda x=x, s=sizes: grouped_linear_fast(x, w, s))
        t_triton = _ms(lambda x=x, s=sizes: grouped_linear_triton(x, w, s))
        print(
            f"rows/expert {rows_per_expert:5}: torch {t_fast * 1e3:8.1f} us  "
            f"triton {t_triton * 1e3:8.1f} us  ratio {t_triton / t_fast:5.2f}"
        )


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
    return f"{c.block_m}x{c.block_n}/w{c.num_warps}/s{c.num_stages}{kind}"


def bench_config_sweep() -> None:
    """Every candidate config on every shape and M: time (us), and whether its 600-row output
    is bit-identical to 64x64/w4/s4 (all share BLOCK_K = 64). Best per (shape, M) last."""
    print("\n## linear config sweep: us (= bits equal to 64x64/w4/s4, x differs)")
    for name, in_dim, out_dim in LINEAR_SHAPES:
        w = torch.randn(out_dim, in_dim, device="cuda", dtype=torch.bfloat16) * in_dim**-0.5
        x600 = torch.randn(600, in_dim, device="cuda", dtype=torch.bfloat16)
        ref = _launch(x600, w, x600.new_empty((600, out_dim)), None, 600, SWEEP_SMALL[8])
        same = {}
        for c in dict.fromkeys(SWEEP_SMALL + SWEEP_LARGE):
            try:
                out = _launch(x600, w, x600.new_empty((600, out_dim)), None, 600, c)
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
                t = _ms(lambda x=x, w=w, out=out, c=c, m=m: _launch(x, w, out, None, m, c))
                cells.append((t / t_cublas, c))
            cells.sort(key=lambda item: item[0])
            print(
                f"  {name:14} M={m:5} cublas {t_cublas * 1e3:7.1f}us | "
                + " ".join(f"{_tag(c)}={r:.2f}" for r, c in cells)
            )
        del w


def _bound_attend(make, args):
    """A fresh set of attention inputs and a call on them (one copy for _graph_ms)."""
    from kernels.triton_attention import _attend

    inputs = make()
    return lambda: _attend(*inputs, *args)


def bench_attention() -> None:
    """Decode attention (16 heads, latent 512 + rope 64, blocks of 64): bytes = KV read once;
    eager do_bench and CUDA-graph replay over several caches (HBM reads) for launch variants."""
    from kernels.triton_attention import SPLIT_BLOCKS, _attend, mla_attention_triton

    src = torch.empty(2**29, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    ceiling = 2 * src.numel() / (_ms(lambda dst=dst, src=src: dst.copy_(src)) * 1e-3) / 1e12
    del src, dst
    print(f"\n## decode attention vs device copy ceiling {ceiling:.2f} TB/s")
    # (split blocks, warps, stages): the default first, then the old 4/8/2 and others.
    variants = [(SPLIT_BLOCKS, 4, 3), (4, 8, 2), (2, 4, 3), (8, 4, 3), (8, 8, 3)]
    for batch, ctx in ((64, 1024), (64, 4096), (256, 1024), (8, 8192), (1, 4096)):
        blocks = -(-ctx // 64)
        read = batch * ctx * 576 * 2

        def make(batch=batch, blocks=blocks, ctx=ctx):
            kv = torch.randn(batch * blocks, 64, 576, device="cuda").bfloat16()
            q = torch.randn(batch, 16, 576, device="cuda").bfloat16()
            tables = torch.randperm(batch * blocks, device="cuda").view(batch, blocks)
            seq_ids = torch.arange(batch, device="cuda")
            positions = torch.full((batch,), ctx - 1, device="cuda")
            return q, kv, seq_ids, tables, positions

        inputs = make()
        t_eager = _ms(lambda i=inputs: mla_attention_triton(*i, scale=192**-0.5, v_dim=512))
        ref = mla_attention_triton(*inputs, scale=192**-0.5, v_dim=512)
        cells = []
        for sb, w, st in variants:
            args = (192**-0.5, 512, sb, w, st)
            try:
                got = _attend(*inputs, *args)
                t = _graph_ms(partial(_bound_attend, make, args), read)
            except Exception as err:
                cells.append(f"{sb}/{w}/{st}=fail:{type(err).__name__}")
                continue
            bits = "=" if torch.equal(got, ref) else "x"
            cells.append(f"{sb}/{w}/{st}={read / t / 1e9 / ceiling:.0%}{bits}")
        print(
            f"B={batch:4} ctx={ctx:5}: eager default {t_eager * 1e3:7.1f} us "
            f"{read / t_eager / 1e9 / ceiling:4.0%} of copy | graph split/warps/stages: "
            + " ".join(cells)
        )


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


def main() -> None:
    print(
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"triton {triton.__version__}"
    )
    sections = sys.argv[1:] or ["rows", "linear", "grouped", "attention"]
    for section in sections:
        {
            "rows": bench_rows,
            "linear": bench_linear,
            "grouped": bench_grouped,
            "sweep": bench_config_sweep,
            "attention": bench_attention,
        }[section]()


if __name__ == "__main__":
    main()
