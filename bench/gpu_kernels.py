"""The measured cost of batch invariance on one GPU, in one run.

Invariant Triton linear vs cuBLAS (torch.matmul, bf16) over the DeepSeek-V2-Lite linear
shapes and a sweep of token counts M; Triton RMSNorm and log-softmax bandwidth against a
device copy measured in the same run (the ceiling), with the torch versions beside them.
Times are medians of triton.testing.do_bench (CUDA events, warm-up, L2 flushed per call).

    PYTHONUNBUFFERED=1 python bench/gpu_kernels.py [rows linear grouped sweep probe]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.testing

# Run as a script from anywhere: the repository root holds the top-level packages.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.linear import grouped_linear_fast  # noqa: E402
from kernels.rmsnorm import rms_norm_fast  # noqa: E402
from kernels.triton_linear import (  # noqa: E402
    LinearConfig,
    _launch,
    grouped_linear_triton,
    linear_triton,
)
from kernels.triton_rmsnorm import rms_norm_triton  # noqa: E402
from kernels.triton_softmax import log_softmax_triton  # noqa: E402

# (name, in_dim K, out_dim N) of DeepSeek-V2-Lite (hidden 2048).
LINEAR_SHAPES = [
    ("q_proj", 2048, 3072),
    ("kv_a", 2048, 576),
    ("kv_b", 512, 4096),
    ("o_proj", 2048, 2048),
    ("mlp_gate_up", 2048, 2 * 10944),
    ("mlp_down", 10944, 2048),
    ("expert_gate_up", 2048, 2 * 1408),
    ("expert_down", 1408, 2048),
    ("lm_head", 2048, 102400),
]
ROW_COUNTS = (1, 16, 64, 256, 1024, 4096, 16384)
CONFIG_SWEEP = [
    LinearConfig(64, 64, 64, 8, 4, 4),
    LinearConfig(64, 128, 64, 8, 4, 4),
    LinearConfig(128, 128, 64, 8, 8, 3),
    LinearConfig(128, 256, 64, 8, 8, 3),
]


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_linear() -> None:
    print("\n## linear: invariant Triton vs cuBLAS (bf16)")
    print(
        f"{'shape':16} {'K':>6} {'N':>7} {'M':>6} {'cublas_us':>10} {'triton_us':>10} "
        f"{'ratio':>6} {'cublas_TF':>9} {'triton_TF':>9}"
    )
    for name, in_dim, out_dim in LINEAR_SHAPES:
        w = torch.randn(out_dim, in_dim, device="cuda", dtype=torch.bfloat16) * in_dim**-0.5
        for m in ROW_COUNTS:
            x = torch.randn(m, in_dim, device="cuda", dtype=torch.bfloat16)
            t_cublas = _ms(lambda x=x, w=w: torch.matmul(x, w.t()))
            t_triton = _ms(lambda x=x, w=w: linear_triton(x, w))
            flops = 2 * m * in_dim * out_dim
            print(
                f"{name:16} {in_dim:6} {out_dim:7} {m:6} {t_cublas * 1e3:10.1f} "
                f"{t_triton * 1e3:10.1f} {t_triton / t_cublas:6.2f} "
                f"{flops / t_cublas / 1e9:9.1f} {flops / t_triton / 1e9:9.1f}"
            )
        del w


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


def bench_config_sweep() -> None:
    """Fixed configs a future choice could take (each one invariant if used for every M)."""
    print("\n## linear config sweep (us): block_m/block_n/block_k/warps/stages")
    for name, in_dim, out_dim in (LINEAR_SHAPES[0], LINEAR_SHAPES[4], LINEAR_SHAPES[8]):
        w = torch.randn(out_dim, in_dim, device="cuda", dtype=torch.bfloat16) * in_dim**-0.5
        for m in (1, 64, 4096):
            x = torch.randn(m, in_dim, device="cuda", dtype=torch.bfloat16)
            out = x.new_empty((m, out_dim))
            cells = []
            for c in CONFIG_SWEEP:
                t = _ms(lambda x=x, w=w, out=out, c=c, m=m: _launch(x, w, out, None, m, c))
                cells.append(
                    f"{c.block_m}/{c.block_n}/{c.block_k}/{c.num_warps}/"
                    f"{c.num_stages}={t * 1e3:.1f}"
                )
            print(f"{name:12} M={m:5}: " + "  ".join(cells))


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


def probe_config_bits() -> None:
    """Do tiles other than BLOCK_K change a row's bits? Same BLOCK_K, other BLOCK_M/N/warps."""
    print("\n## bits across configs with BLOCK_K = 64 (bf16), vs 64/64/64/4/4")
    probes = CONFIG_SWEEP + [LinearConfig(64, 32, 64, 8, 4, 4), LinearConfig(16, 64, 64, 8, 4, 4)]
    for name, in_dim, out_dim in (LINEAR_SHAPES[5], LINEAR_SHAPES[0]):
        w = torch.randn(out_dim, in_dim, device="cuda", dtype=torch.bfloat16) * in_dim**-0.5
        x = torch.randn(300, in_dim, device="cuda", dtype=torch.bfloat16)
        outs = [_launch(x, w, x.new_empty((300, out_dim)), None, 300, c) for c in probes]
        same = [torch.equal(o, outs[0]) for o in outs]
        print(
            f"{name}: "
            + "  ".join(
                f"{c.block_m}/{c.block_n}/{c.num_warps}={e}"
                for c, e in zip(probes, same, strict=True)
            )
        )


def main() -> None:
    print(
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"triton {triton.__version__}"
    )
    sections = sys.argv[1:] or ["rows", "linear", "grouped", "sweep", "probe"]
    for section in sections:
        {
            "rows": bench_rows,
            "linear": bench_linear,
            "grouped": bench_grouped,
            "sweep": bench_config_sweep,
            "probe": probe_config_bits,
        }[section]()


if __name__ == "__main__":
    main()
