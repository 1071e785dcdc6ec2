"""A rollout job through the engine: more requests than `scheduler.max_num_seqs` slots, all
submitted at once and stepped until every one has finished, per kernel mode.

Per mode in `--modes`: an LLMEngine with `--slots` slots (+ `--set` overrides), `--requests`
random prompts of `--context` tokens (ids from `--seed`), greedy with ignore_eos, each with its
own max_tokens drawn from [`--max-tokens` / 2, `--max-tokens`] so the sequences end apart and
the queue refills a slot at a time, as a rollout job's does; `--n` samples a request (sampled
at temperature 1 when above 1, each with its seed, as RL rollouts draw a group a prompt). One
warm-up job (compiles and captures every graph size the job meets), then `--repeats` timed
jobs: wall time of the steps until the engine has nothing left (prefill included). Reported:
generated tok/s as median [min, max], steps a job, prefix-cache hits a job (blocks), and the
worker's decode lookaheads a job (served / dropped / queued before the read:
`scheduler.overlap_decode`, which in invariant mode also runs while requests wait and holds
their admission a step where a sequence has just left; fast mode launches none while requests
wait).

    PYTHONUNBUFFERED=1 python bench/backlog.py --slots 64 --requests 256 --context 1024 \
        --max-tokens 128
    python bench/backlog.py --config launch/configs/tiny_cpu.yaml --slots 3 --requests 8 \
        --context 16 --max-tokens 8 --repeats 2          # CPU smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_bench import random_prompts, spread  # noqa: E402
from launch.cli import add_override_argument, parse_overrides  # noqa: E402
from moe_runtime.config import load_config  # noqa: E402
from moe_runtime.engine import LLMEngine  # noqa: E402
from moe_runtime.sampling_params import SamplingParams  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "launch" / "configs" / "v2_lite_gpu.yaml"
COUNTERS = ("num_lookahead_hits", "num_lookahead_misses", "num_unread_launches")


def run_job(engine: LLMEngine, args, rng: np.random.Generator) -> tuple[float, int, list[int]]:
    """One job; -> (generated tok/s, steps, [prefix hit blocks, the lookahead counters]'s
    increase)."""
    prompts = random_prompts(rng, args.requests, args.context, engine.config.model.vocab_size)
    lengths = rng.integers(max(args.max_tokens // 2, 1), args.max_tokens + 1, args.requests)
    temperature = 1.0 if args.n > 1 else 0.0
    params = [
        SamplingParams(n=args.n, max_tokens=int(m), temperature=temperature, ignore_eos=True)
        for m in lengths
    ]
    before = [engine.stats().num_prefix_hit_blocks, *map(engine.worker_stats()[0].get, COUNTERS)]
    steps = engine.num_steps
    engine.add_requests(prompts, params)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - start
    after = [engine.stats().num_prefix_hit_blocks, *map(engine.worker_stats()[0].get, COUNTERS)]
    return (
        int(lengths.sum()) * args.n / seconds,
        engine.num_steps - steps,
        [b - a for a, b in zip(before, after, strict=True)],
    )


def bench_mode(mode: str, args) -> str:
    overrides = {
        **parse_overrides(args.set),
        "kernels.mode": mode,
        "scheduler.max_num_seqs": args.slots,
    }
    cfg = load_config(args.config, overrides)
    engine = LLMEngine(cfg)
    try:
        rng = np.random.default_rng(args.seed)
        run_job(engine, args, rng)  # warm-up
        jobs = [run_job(engine, args, rng) for _ in range(args.repeats)]
    finally:
        engine.shutdown()
    tok_s = [tok for tok, _, _ in jobs]
    steps = statistics.median(s for _, s, _ in jobs)
    counts = [statistics.median(c[i] for _, _, c in jobs) for i in range(1 + len(COUNTERS))]
    label = mode + (" +graphs" if cfg.kernels.cuda_graphs else "")
    hits, lookaheads = counts[0], counts[1:]
    print(
        f"  {label}: {spread(tok_s)} tok/s, {steps:.0f} steps, {hits:.0f} prefix hit blocks, "
        f"lookaheads {lookaheads}",
        flush=True,
    )
    return f"| {label} | {spread(tok_s)} | {steps:.0f} | {hits:.0f} | " + " / ".join(
        f"{c:.0f}" for c in lookaheads
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(CONFIG))
    add_override_argument(parser)
    parser.add_argument("--modes", nargs="+", default=["invariant", "fast"])
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--n", type=int, default=1, help="samples a request")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"command: {' '.join(sys.argv)}")
    rows = [bench_mode(mode, args) for mode in args.modes]
    print(
        f"\n{args.requests} requests (n = {args.n}) of {args.context} tokens through "
        f"{args.slots} slots, max_tokens in [{max(args.max_tokens // 2, 1)}, {args.max_tokens}]\n"
        "| mode | generated tok/s [min, max] | steps a job | prefix hit blocks a job | "
        "lookaheads served / dropped / before the read |\n|---|---|---|---|---|"
    )
    print("\n".join(row + " |" for row in rows))


if __name__ == "__main__":
    main()
