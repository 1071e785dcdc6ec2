"""Where one engine decode step spends its time: GPU kernels (torch.profiler) and host Python
(cProfile), at batch B and context L, for one kernel mode.

B random prompts of L tokens are prefilled, a few decode steps warm up (compiles, captures the
graphs), then `--steps` steps run under cProfile and the same number under torch.profiler.
Printed: wall ms/step, GPU kernel time per step (sum of kernel durations; kernels inside CUDA
graph replays are traced one by one), the top kernels by time, and the top host functions.

    PYTHONUNBUFFERED=1 python bench/profile_step.py --batch 64 --context 1024 \
        [--set kernels.mode=fast] [--config launch/configs/v2_lite_gpu.yaml] [--by-grid]
        [--no-pdl]

With PDL on (the default on sm90) a kernel's duration includes the time its programs waited
for the kernel before it, and at decode sizes a layer's branches run on two streams
(moe_kernels/streams.py; `--set kernels.side_stream_rows=0` for one), so the sum of kernel
durations overstates the GPU's busy time: --by-grid also prints the busy time as the union of
the kernels' intervals; --no-pdl for kernel durations, the default for the step's wall time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_bench import random_prompts, step_until_started  # noqa: E402
from launch.cli import add_override_argument, parse_overrides  # noqa: E402
from moe_kernels import triton_pdl  # noqa: E402
from moe_runtime.config import load_config  # noqa: E402
from moe_runtime.engine.engine import LLMEngine  # noqa: E402
from moe_runtime.sampling_params import SamplingParams  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "launch" / "configs" / "v2_lite_gpu.yaml"


def start_decoding(engine: LLMEngine, num_seqs: int, context: int, max_tokens: int) -> None:
    """Add B random prompts and step until every one of them has its first token."""
    prompts = random_prompts(
        np.random.default_rng(0), num_seqs, context, engine.config.model.vocab_size
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = engine.add_requests(prompts, [params] * num_seqs)
    step_until_started(engine, {r.request_id for r in requests})


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_table(
    totals: dict[tuple, list[float]], columns: tuple[str, ...], num_steps: int, top: int
) -> list[str]:
    """Markdown lines of totals {key: [µs, calls]} over num_steps, most time first; the key's
    items fill `columns` (strings cut at 90 characters, tuples shown as lists)."""
    head = [*columns, "calls/step", "us/step", "us/call"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for key, (total, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        cells = [str(list(k)) if isinstance(k, tuple) else str(k)[:90] for k in key]
        cells += [f"{count / num_steps:.0f}", f"{total / num_steps:.0f}", f"{total / count:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def kernel_table(prof, num_steps: int, top: int) -> None:
    """Prints the kernels' time per step by name (durations summed: kernels that overlap
    count each)."""
    totals: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[(event.name,)]
            entry[0] += event.time_range.elapsed_us()  # a kernel event's own duration
            entry[1] += 1
    busy = sum(t for t, _ in totals.values()) / num_steps
    launches = sum(c for _, c in totals.values()) // num_steps
    print(f"GPU kernel time per step: {busy / 1e3:.2f} ms over {launches} kernels")
    print("\n".join(time_table(totals, ("kernel",), num_steps, top)))


def grid_table(trace: dict, num_steps: int, top: int) -> list[str]:
    """The kernel events of an exported torch.profiler trace grouped by (name, grid, block):
    one launch shape per row, most time first (e.g. each linear's weight at B = 1, which the
    name alone lumps together). Markdown lines."""
    totals: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in trace.get("traceEvents", []):
        if event.get("cat") != "kernel":
            continue
        args = event.get("args", {})
        key = (event["name"], tuple(args.get("grid", ())), tuple(args.get("block", ())))
        totals[key][0] += event.get("dur", 0.0)
        totals[key][1] += 1
    return time_table(totals, ("kernel", "grid", "block"), num_steps, top)


# A GPU idle gap at least this long is the host's (scheduling, batch build, copies, output
# bookkeeping between steps, or an eager launch); shorter ones are launch latency inside a
# graph replay or a burst of queued launches.
HOST_GAP_US = 20.0


def idle_split(trace: dict) -> tuple[float, float, float, int] | None:
    """(span, short, long, number of long gaps) in µs over the traced kernels: the time from
    the first kernel's start to the last one's end, and the gaps between consecutive kernels
    (by start time, overlaps counted as no gap) split at HOST_GAP_US; None for fewer than
    two kernels."""
    spans = sorted(
        (event["ts"], event["ts"] + event.get("dur", 0.0))
        for event in trace.get("traceEvents", [])
        if event.get("cat") == "kernel"
    )
    if len(spans) < 2:
        return None
    short, long, num_long, end = 0.0, 0.0, 0, spans[0][1]
    for start, stop in spans[1:]:
        gap = start - end
        if gap >= HOST_GAP_US:
            long, num_long = long + gap, num_long + 1
        elif gap > 0:
            short += gap
        end = max(end, stop)
    return spans[-1][1] - spans[0][0], short, long, num_long


def idle_lines(trace: dict, num_steps: int) -> list[str]:
    """Where the GPU was idle between the first and last kernel of the profiled steps
    (idle_split per step). Lines of text."""
    split = idle_split(trace)
    if split is None:
        return ["idle: fewer than two kernels traced"]
    span, short, long, num_long = split
    return [
        f"GPU timeline per step: {span / num_steps:.1f} us from first kernel to last; idle "
        f"{short / num_steps:.1f} us in gaps < {HOST_GAP_US:.0f} us (launch latency) and "
        f"{long / num_steps:.1f} us in {num_long / num_steps:.1f} longer gaps a step (the host); "
        f"busy {(span - short - long) / num_steps:.1f} us (kernels that overlap, on two streams "
        "or waiting under PDL, counted once)"
    ]


def print_grid_table(prof, num_steps: int, top: int) -> tuple[float, float] | None:
    """Prints the idle split and the kernels by launch shape; -> (launch-gap, busy) µs a
    step, busy the union of the kernels' intervals."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    print("\n".join(idle_lines(trace, num_steps)))
    print("\nkernels by launch shape:")
    print("\n".join(grid_table(trace, num_steps, top)))
    split = idle_split(trace)
    if split is None:
        return None
    span, short, long, _ = split
    return short / num_steps, (span - short - long) / num_steps


def profile_prefill(engine: LLMEngine, args) -> None:
    """Kernels of `--steps` prefills of B fresh prompts (one warm-up first), one step each
    when B x context fits the step budget."""
    rng = np.random.default_rng(1)
    vocab = engine.config.model.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prefill() -> None:
        prompts = random_prompts(rng, args.batch, args.context, vocab)
        engine.add_requests(prompts, [params] * args.batch)
        while engine.has_unfinished():
            engine.step()

    prefill()
    sync()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            prefill()
        sync()
    wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    print(
        f"mode {engine.config.kernels.mode}, prefill {args.batch}x{args.context}: {wall_ms:.1f} ms"
    )
    kernel_table(prof, args.steps, args.top)
    if args.by_grid:
        print_grid_table(prof, args.steps, args.top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(CONFIG))
    add_override_argument(parser)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--prefill", action="store_true", help="profile prefill steps of B x context instead"
    )
    parser.add_argument(
        "--by-grid",
        action="store_true",
        help="also group kernels by launch grid and block, and split the GPU's idle time",
    )
    parser.add_argument(
        "--no-pdl",
        action="store_true",
        help="launch without PDL: a kernel launched with it counts the time its programs wait "
        "for the one before as its own (moe_kernels/triton_pdl.py)",
    )
    args = parser.parse_args()
    if args.no_pdl:
        triton_pdl.ENABLED = False
    cfg = load_config(args.config, parse_overrides(args.set))
    engine = LLMEngine(cfg)
    try:
        if args.prefill:
            profile_prefill(engine, args)
            return
        start_decoding(engine, args.batch, args.context, max_tokens=1000)
        for _ in range(4):  # warm-up: compiles and captures this size's graphs
            engine.step()
        sync()
        # Why a plain timing first: the profilers' own host work inflates the host's gaps
        # (the --by-grid split's "longer gaps"); the plain wall minus kernel and launch-gap
        # time is what the host costs the step.
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        sync()
        plain_us = (time.perf_counter() - start) * 1e6 / args.steps
        host = cProfile.Profile()
        start = time.perf_counter()
        host.enable()
        for _ in range(args.steps):
            engine.step()
        host.disable()
        wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
        print(
            f"mode {cfg.kernels.mode}, graphs {cfg.kernels.cuda_graphs}, B={args.batch}, "
            f"context {args.context}: {wall_ms:.2f} ms/step wall (under cProfile)"
        )
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            sync()
        kernel_table(prof, args.steps, args.top)
        if args.by_grid:
            split = print_grid_table(prof, args.steps, args.top)
            if split is not None:
                # Why the union, not the summed durations: kernels on the side stream
                # (moe_kernels/streams.py) run beside others, and a PDL kernel's duration includes
                # its wait.
                gaps_us, busy_us = split
                print(
                    f"unprofiled: {plain_us / 1e3:.2f} ms a step; kernels busy "
                    f"{busy_us / 1e3:.2f} + launch gaps {gaps_us / 1e3:.2f} ms leave "
                    f"{(plain_us - busy_us - gaps_us) / 1e3:.2f} ms a step to the host"
                )
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(args.top)
        print("\nhost functions by own time (cProfile, all steps):")
        print("\n".join(text.getvalue().splitlines()[: args.top + 12]))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
