"""Tokens computed and thrown away by preemption, at each scheduler.admission_reserve.

No model: one DP rank's real Scheduler and BlockManager, a fake sample for every chunk that
ends a sequence's known tokens, every request queued at once (a rollout's batch), prompts of
64-512 tokens, outputs log-normal (median 200, sigma 1, at most 1500), prefix caching off. A
cache too small for max_num_seqs sequences at once makes the running ones preempt the newest
as they grow; a preempted sequence computes its whole context again. "Thrown away" is the
tokens computed beyond each sequence's own (prompt + outputs - 1); steps count the scheduler's
steps (the run's length where steps cost about the same; recomputed tokens make a step cost
more, which this does not model). No GPU timing.

    python bench/admission.py [--blocks 1000 1500 2200] [--reserves 0 1 2] [--seeds 0 1 2 3 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.scheduler_sim import finish_step  # noqa: E402
from moe_runtime.config import SchedulerConfig  # noqa: E402
from moe_runtime.engine.block_manager import BlockManager  # noqa: E402
from moe_runtime.engine.request import Request  # noqa: E402
from moe_runtime.engine.scheduler import Scheduler  # noqa: E402
from moe_runtime.sampling_params import SamplingParams  # noqa: E402
from moe_runtime.tokenizer import ByteTokenizer  # noqa: E402

BLOCK_SIZE = 16
TOKENIZER = ByteTokenizer(512)


def run(args: argparse.Namespace, num_blocks: int, reserve: int, seed: int) -> dict:
    rng = random.Random(seed)
    config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.budget,
        max_model_len=2048,
        admission_reserve=reserve,
    )
    scheduler = Scheduler(config, BlockManager(num_blocks, BLOCK_SIZE, False), eos_token_ids=())
    needed = 0
    for index in range(args.requests):
        max_tokens = max(1, min(1500, int(rng.lognormvariate(0, 1) * 200)))
        prompt = [rng.randrange(1, 400) for _ in range(rng.randint(64, 512))]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        for seq in Request(f"r{index}", prompt, params, seed=0).expand_samples(index, TOKENIZER):
            scheduler.add(seq)
        needed += len(prompt) + max_tokens - 1
    steps = computed = 0
    while scheduler.has_unfinished():
        chunks = scheduler.schedule()
        computed += sum(c.num_tokens for c in chunks)
        finish_step(scheduler, chunks)
        steps += 1
    return {
        "steps": steps,
        "thrown_away": computed / needed - 1,
        "preemptions": scheduler.num_preemptions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1000, 1500, 2200])
    parser.add_argument("--reserves", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    args = parser.parse_args()
    print(
        f"{args.requests} requests queued at once, max_num_seqs {args.max_num_seqs}, budget "
        f"{args.budget}, blocks of {BLOCK_SIZE}; medians over seeds {args.seeds} [min, max]",
        flush=True,
    )
    print("| KV blocks | admission_reserve | tokens thrown away | preemptions | steps |")
    print("|---|---|---|---|---|")
    for num_blocks in args.blocks:
        base = None
        for reserve in args.reserves:
            runs = [run(args, num_blocks, reserve, seed) for seed in args.seeds]
            steps = [r["steps"] for r in runs]
            base = base or steps
            ratio = [s / b for s, b in zip(steps, base, strict=True)]
            waste = [100 * r["thrown_away"] for r in runs]
            preemptions = [r["preemptions"] for r in runs]
            print(
                f"| {num_blocks} | {reserve} | {statistics.median(waste):.1f}% "
                f"[{min(waste):.1f}, {max(waste):.1f}] | {statistics.median(preemptions):.0f} "
                f"[{min(preemptions)}, {max(preemptions)}] | {statistics.median(steps):.0f} "
                f"({statistics.median(ratio):.3f}x reserve {args.reserves[0]}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
