"""Benchmark the EPLB planner on a skewed synthetic load.

Load: Zipf over experts (exponent --zipf) with a different hot set per layer (a per-layer
random permutation of expert ranks). Reports balancedness (mean / max rank load) of the
default placement without redundancy and of the plans of both policies, and the median plan
time after warm-up. Weight-movement time is not measured here.

    python bench/eplb_plan.py --layers 61 --experts 256 --ranks 64 --nodes 8 \
        --redundant-frac 0.25 --seed 0
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

# Run as a script from anywhere: the repository root holds the top-level packages.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eplb import balancedness, load_per_rank, rebalance_experts  # noqa: E402


def zipf_load(num_layers: int, num_experts: int, exponent: float, seed: int) -> torch.Tensor:
    """[num_layers, num_experts] int64 token counts; expert ranks permuted per layer."""
    generator = torch.Generator().manual_seed(seed)
    base = 1_000_000 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** exponent
    ranks = torch.stack(
        [torch.randperm(num_experts, generator=generator) for _ in range(num_layers)]
    )
    return base[ranks].round().to(torch.int64)


def time_plan(args: argparse.Namespace, weight: torch.Tensor, num_replicas: int, policy: str):
    def plan():
        return rebalance_experts(
            weight, num_replicas, args.groups, args.nodes, args.ranks, policy=policy
        )

    for _ in range(args.warmup):
        plan()
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        physical_to_logical = plan()[0]
        seconds.append(time.perf_counter() - start)
    return physical_to_logical, statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8, help="expert groups (router groups)")
    parser.add_argument("--redundant-frac", type=float, default=0.25)
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    num_replicas = args.experts + round(args.experts * args.redundant_frac)
    weight = zipf_load(args.layers, args.experts, args.zipf, args.seed)
    default = torch.arange(args.experts).expand(args.layers, -1)
    before = balancedness(load_per_rank(weight, default, args.ranks))

    print(
        f"layers={args.layers} experts={args.experts} replicas={num_replicas} "
        f"ranks={args.ranks} nodes={args.nodes} groups={args.groups} zipf={args.zipf} "
        f"seed={args.seed} threads={torch.get_num_threads()}"
    )
    header = f"{'placement':<28}{'bal mean':>10}{'bal min':>10}{'plan ms':>10}"
    print(header)
    print("-" * len(header))
    print(f"{'default, no redundancy':<28}{before.mean():>10.4f}{before.min():>10.4f}{'-':>10}")
    policies = ["auto", "global"]
    for policy in policies:
        physical_to_logical, seconds = time_plan(args, weight, num_replicas, policy)
        after = balancedness(load_per_rank(weight, physical_to_logical, args.ranks))
        kind = "hierarchical" if policy == "auto" and args.groups % args.nodes == 0 else "global"
        label = f"plan, {policy} ({kind})"
        print(f"{label:<28}{after.mean():>10.4f}{after.min():>10.4f}{seconds * 1e3:>10.1f}")


if __name__ == "__main__":
    main()
