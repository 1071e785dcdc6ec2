"""Lockstep steps of a rollout-like batch over DP ranks, with and without share_waiting.

No model: the DP ranks' real Schedulers and BlockManagers stepped in lockstep as LLMEngine
steps them, requests placed as LLMEngine._enqueue places them (all queued at once, the fewest
unfinished sequences first), and a fake sample for every chunk that ends a sequence's known
tokens. Output lengths are drawn long-tailed (log-normal), as RL rollouts' are. Under EP every
step is a lockstep step of all ranks (their MoE exchanges meet), so a rank with nothing to run
still waits out the step: the run's length in steps is its length in time where steps cost
about the same (decode, weights-bound), and the slots used says how full the ranks ran.

    python bench/dp_share.py [--dp 8] [--requests 1024] [--n 8] [--max-num-seqs 64]
        [--median-tokens 200] [--max-tokens 1024] [--seeds 0 1 2 3 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.scheduler_sim import finish_step  # noqa: E402
from moe_runtime.config import SchedulerConfig  # noqa: E402
from moe_runtime.engine.block_manager import BlockManager  # noqa: E402
from moe_runtime.engine.request import Request  # noqa: E402
from moe_runtime.engine.scheduler import Scheduler, share_waiting  # noqa: E402
from moe_runtime.sampling_params import SamplingParams  # noqa: E402
from moe_runtime.tokenizer import ByteTokenizer  # noqa: E402

BLOCK_SIZE = 16
TOKENIZER = ByteTokenizer(512)


def workload(args: argparse.Namespace, seed: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) per request: prompts of 64-512 tokens, outputs log-normal around
    args.median_tokens, capped at args.max_tokens."""
    rng = random.Random(seed)
    rows = []
    for _ in range(args.requests):
        prompt = [rng.randrange(1, 500) for _ in range(rng.randint(64, 512))]
        length = int(rng.lognormvariate(0, args.sigma) * args.median_tokens)
        rows.append((prompt, max(1, min(args.max_tokens, length))))
    return rows


def run(args: argparse.Namespace, rows: list[tuple[list[int], int]], share: bool) -> dict:
    config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.budget,
        max_model_len=512 + args.max_tokens,
    )
    num_blocks = args.max_num_seqs * -(-config.max_model_len // BLOCK_SIZE)  # no preemption
    schedulers = [
        Scheduler(config, BlockManager(num_blocks, BLOCK_SIZE, False), eos_token_ids=())
        for _ in range(args.dp)
    ]
    for index, (prompt, max_tokens) in enumerate(rows):
        seq_id = index * args.n
        params = SamplingParams(max_tokens=max_tokens, n=args.n, ignore_eos=True, temperature=0.0)
        request = Request(f"r{index}", prompt, params, seed=0)
        loads = [s.num_unfinished for s in schedulers]
        dp_rank = loads.index(min(loads))
        for seq in request.expand_samples(seq_id, TOKENIZER):
            seq.dp_rank = dp_rank
            schedulers[dp_rank].add(seq)
    steps = slots = idle_while_waiting = moved = 0
    while any(s.has_unfinished() for s in schedulers):
        if share:
            moved += share_waiting(schedulers)
        is_waiting = any(s.waiting for s in schedulers)
        for scheduler in schedulers:
            # free slots of a rank with nothing of its own waiting, while another's waits
            is_short = is_waiting and not scheduler.waiting
            chunks = scheduler.schedule()
            slots += len(chunks)
            idle_while_waiting += is_short and args.max_num_seqs - len(chunks)
            finish_step(scheduler, chunks)
        steps += 1
    return {
        "steps": steps,
        "slots_used": slots / (steps * args.dp * args.max_num_seqs),
        "free_slots_while_work_waited": idle_while_waiting,
        "moved": moved,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--n", type=int, default=8, help="samples a request (GRPO: 8-16)")
    parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--median-tokens", type=int, default=200)
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma")
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    args = parser.parse_args()
    print(
        f"DP {args.dp}, {args.requests} requests of n = {args.n}, max_num_seqs "
        f"{args.max_num_seqs}, budget {args.budget}, outputs log-normal (median "
        f"{args.median_tokens}, sigma {args.sigma}, at most {args.max_tokens})",
        flush=True,
    )
    ratios = []
    print(
        "| seed | steps, placed on arrival | steps, shared | shared / placed | slots used "
        "| free slots while work waited elsewhere | sequences moved |"
    )
    print("|---|---|---|---|---|---|---|")
    for seed in args.seeds:
        rows = workload(args, seed)
        started = time.monotonic()
        placed, shared = run(args, rows, share=False), run(args, rows, share=True)
        ratio = shared["steps"] / placed["steps"]
        ratios.append(ratio)
        print(
            f"| {seed} | {placed['steps']} | {shared['steps']} | {ratio:.3f} | "
            f"{placed['slots_used']:.3f} -> {shared['slots_used']:.3f} | "
            f"{placed['free_slots_while_work_waited']} -> "
            f"{shared['free_slots_while_work_waited']} | {shared['moved']} |",
            flush=True,
        )
        print(f"  ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    print(
        f"shared / placed steps: median {statistics.median(ratios):.3f} "
        f"[{min(ratios):.3f}, {max(ratios):.3f}] over {len(ratios)} seeds"
    )


if __name__ == "__main__":
    main()
