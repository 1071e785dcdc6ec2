"""Benchmark live expert rearrangement: EP ranks on a local Ray cluster (CPU, gloo).

Builds a model whose MoE layers have --experts experts of --hidden x --moe-intermediate,
drives a skewed load through it (prompts drawn from a few byte values, so routing is
concentrated), then times `rebalance()`: load gathering, planning, the per-layer weight
all_to_all and the commit. Prints balancedness before/after (planned), experts and bytes
moved, and seconds.

    python bench/eplb_move.py --ranks 8 --experts 64 --redundant 16 --hidden 512 \
        --moe-intermediate 256 --layers 4
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402

from moe_runtime import LLM, SamplingParams  # noqa: E402

TINY = Path(__file__).resolve().parent.parent / "launch" / "configs" / "tiny_cpu.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--redundant", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=args.ranks, include_dashboard=False, log_to_driver=False)
    overrides = {
        "parallel.world_size": args.ranks,
        "eplb.num_redundant_experts": args.redundant,
        "eplb.window_steps": 100_000,
        "model.n_routed_experts": args.experts,
        "model.n_group": 8,
        "model.topk_group": 4,
        "model.hidden_size": args.hidden,
        "model.moe_intermediate_size": args.moe_intermediate,
        "model.num_hidden_layers": args.layers + 1,
        "parallel.timeout_s": 300,
    }
    llm = LLM(TINY, **overrides)
    rng = random.Random(0)
    prompts = [[rng.choice([65, 66, 67, 97]) for _ in range(64)] for _ in range(32)]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    expert_bytes = 3 * args.hidden * args.moe_intermediate * 4
    print(
        f"ranks={args.ranks} layers={args.layers} experts={args.experts}+{args.redundant} "
        f"expert={expert_bytes / 2**20:.2f} MiB fp32"
    )
    print(
        f"{'run':>3} {'bal before':>10} {'bal after':>9} {'moved':>6} "
        f"{'MiB sent':>9} {'seconds':>8}"
    )
    for run in range(args.repeats):
        started = time.perf_counter()
        report = llm.rebalance()
        wall = time.perf_counter() - started
        print(
            f"{run:>3} {report['balancedness_before']:>10.3f} {report['balancedness_after']:>9.3f} "
            f"{report['experts_moved']:>6} {report['bytes_moved'] / 2**20:>9.1f} {wall:>8.3f}"
        )
        llm.generate(prompts[: 8 * (run + 1)], SamplingParams(max_tokens=4, temperature=0.0))
    llm.shutdown()


if __name__ == "__main__":
    main()
