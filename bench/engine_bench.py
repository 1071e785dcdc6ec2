"""The runtime as a user gets it, timed through LLMEngine.step: decode ms/step per batch size
and prefill tok/s, per kernel mode, against the HBM floor of a decode step (bench/e2e_decode.py
--engine runs it; the command and the method are in that file's docstring)."""

from __future__ import annotations

import datetime
import gc
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import triton

from bench.hbm_floor import copy_bandwidth, decode_step_bytes
from launch.cli import parse_overrides
from moe_runtime import heap
from moe_runtime.config import RuntimeConfig, load_config
from moe_runtime.engine import LLMEngine
from moe_runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class DecodeRun:
    """One B's decode through the engine: ms/step of each timed block, and the mean number of
    cached positions a sequence attends over during the timed steps."""

    block_ms: list[float]
    mean_context: float
    num_fill_steps: int  # steps until all B had their first token (prefill, not timed)


def fill_bound(num_seqs: int, context: int, budget: int) -> int:
    """Most steps chunked prefill can take to give B prompts their first token (each step
    spends at most B of its token budget on the sequences already decoding), plus one: the
    output tokens a request may have when the last one starts; max_tokens adds them, so no
    request runs out during the timed steps."""
    return -(-num_seqs * context // max(budget - num_seqs, 1)) + 1


def engine_config(args, mode: str) -> tuple[RuntimeConfig, list[str]]:
    """The config plus the user's overrides and this mode's, with the cache and batch limits
    B x context needs (raised, never lowered, so no step preempts); -> (config, notes)."""
    overrides = {**parse_overrides(args.set), "kernels.mode": mode}
    cfg, notes = load_config(args.config, overrides), []
    budget, block_size = cfg.scheduler.max_num_batched_tokens, cfg.cache.block_size
    timed = args.warmup_steps + args.repeats * args.decode_steps
    lengths = [(args.prefill_prompts, args.context + 1)] + [
        (b, args.context + fill_bound(b, args.context, budget) + timed) for b in args.batches
    ]
    # Each of n sequences' blocks, and the free blocks scheduler.admission_reserve keeps for
    # each running one as the next is admitted: without them the last prompts waited.
    reserve = cfg.scheduler.admission_reserve
    blocks = max(n * (-(-length // block_size) + reserve) for n, length in lengths)
    if 0 < cfg.cache.num_blocks < blocks:
        overrides["cache.num_blocks"] = blocks
        notes.append(f"cache.num_blocks {cfg.cache.num_blocks} -> {blocks}")
    seqs = max(args.prefill_prompts, *args.batches)
    if cfg.scheduler.max_num_seqs < seqs:
        overrides["scheduler.max_num_seqs"] = seqs
        notes.append(f"scheduler.max_num_seqs {cfg.scheduler.max_num_seqs} -> {seqs}")
    return load_config(args.config, overrides), notes


def random_prompts(rng: np.random.Generator, num: int, length: int, vocab: int) -> list[list]:
    return rng.integers(0, vocab, size=(num, length)).tolist()


def step_until_started(engine: LLMEngine, request_ids: set[str]) -> tuple[int, dict[str, int]]:
    """Step until every request has its first token; -> (steps, output tokens per request)."""
    num_out = dict.fromkeys(request_ids, 0)
    steps = 0
    while min(num_out.values()) == 0:
        for out in engine.step():
            num_out[out.request_id] += len(out.token_ids)
        steps += 1
    return steps, num_out


def bench_engine_prefill(engine: LLMEngine, args, rng: np.random.Generator) -> list[float]:
    """tok/s of each repeat (the first run, a warm-up, is dropped). Fresh random prompts each
    time, so the prefix cache cannot serve a block (checked)."""
    vocab = engine.config.model.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    num, tok_s = args.prefill_prompts, []
    for repeat in range(1 + args.repeats):
        hits = engine.stats().num_prefix_hit_blocks
        prompts = random_prompts(rng, num, args.context, vocab)
        requests = engine.add_requests(prompts, [params] * num)
        start = time.perf_counter()
        steps, _ = step_until_started(engine, {r.request_id for r in requests})
        seconds = time.perf_counter() - start
        assert engine.stats().num_prefix_hit_blocks == hits, "a prefill hit the prefix cache"
        assert not engine.has_unfinished()
        if repeat:
            tok_s.append(num * args.context / seconds)
    print(f"  prefill {num}x{args.context}: {steps} step(s), tok/s {[round(t) for t in tok_s]}")
    return tok_s


def check_decode_step(outputs, num_seqs: int) -> None:
    """A pure decode step of all B: one new token for each request, none finished."""
    num_tokens = sum(len(o.token_ids) for o in outputs)
    assert len(outputs) == num_seqs and num_tokens == num_seqs, (
        f"a timed step gave {num_tokens} tokens for {len(outputs)} requests, expected {num_seqs}"
    )
    assert not any(o.is_finished for o in outputs), "a request finished during the timed steps"


def bench_engine_decode(
    engine: LLMEngine, num_seqs: int, args, rng: np.random.Generator
) -> DecodeRun:
    cfg = engine.config
    bound = fill_bound(num_seqs, args.context, cfg.scheduler.max_num_batched_tokens)
    timed = args.repeats * args.decode_steps
    params = SamplingParams(
        max_tokens=bound + args.warmup_steps + timed,
        temperature=args.temperature,  # 0: greedy; > 0: every row draws its Gumbel noise
        top_p=args.top_p,  # < 1 (with a temperature): every row's sort and top-p mass scan
        ignore_eos=True,
    )
    prompts = random_prompts(rng, num_seqs, args.context, cfg.model.vocab_size)
    requests = engine.add_requests(prompts, [params] * num_seqs)
    num_fill_steps, num_out = step_until_started(engine, {r.request_id for r in requests})
    assert num_fill_steps < bound, f"prefill took {num_fill_steps} steps, bound {bound}"
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (num_seqs, 0), stats
    # The token a step feeds sits at prompt + outputs - 1 and attends over prompt + outputs.
    first_context = args.context + statistics.mean(num_out.values()) + args.warmup_steps
    # Why back to back, no synchronize and no check between blocks: with
    # scheduler.overlap_decode (on with graphs at world size 1) step() returns with the next
    # decode step already launched, so a synchronize or host work between blocks let that
    # step's device time pass outside every timer (a block of S steps timed S - 1 steps' device
    # work: ms/step low by up to 1/S). Each block runs from the previous block's last return
    # (the last warm-up step's for the first), so every boundary sits at the same point of the
    # pipeline and the blocks tile the timed steps; the outputs are checked afterwards.
    outputs = [engine.step() for _ in range(args.warmup_steps)]
    marks = [time.perf_counter()]
    for _ in range(args.repeats):
        for _ in range(args.decode_steps):
            outputs.append(engine.step())
        marks.append(time.perf_counter())
    block_ms = [(b - a) * 1e3 / args.decode_steps for a, b in zip(marks, marks[1:], strict=False)]
    for step_outputs in outputs:
        check_decode_step(step_outputs, num_seqs)
    assert engine.stats().num_preemptions == stats.num_preemptions, "a timed step preempted"
    for request in requests:  # they have tokens left; free their blocks for the next B
        engine.abort(request.request_id)
    return DecodeRun(block_ms, first_context + (timed - 1) / 2, num_fill_steps)


class CollectorPauses:
    """Python's cyclic collections while registered: (generation, ms) of each one of them."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0

    def __enter__(self) -> CollectorPauses:
        gc.callbacks.append(self._on_collect)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_collect)

    def _on_collect(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], (time.perf_counter() - self._start) * 1e3))

    def summary(self) -> str:
        full = [ms for generation, ms in self.pauses if generation == 2]
        longest = max((ms for _, ms in self.pauses), default=0.0)
        return (
            f"{len(self.pauses)} collections, the longest {longest:.1f} ms; "
            f"{len(full)} full ({sum(full):.1f} ms)"
        )


def bench_engine_mode(cfg: RuntimeConfig, notes: list[str], args, rng: np.random.Generator) -> dict:
    start = time.perf_counter()
    engine = LLMEngine(cfg)
    start_s = time.perf_counter() - start
    # As serve_ep and the rollout tool run it: start-up's objects out of the collector's view.
    num_frozen = 0 if args.no_gc_freeze else heap.freeze()
    label = cfg.kernels.mode + (" +graphs" if cfg.kernels.cuda_graphs else "")
    print(
        f"\n{label}: engine start {start_s:.1f} s; {num_frozen} objects frozen"
        + "".join(f"; {n}" for n in notes)
    )
    try:
        with CollectorPauses() as collections:
            prefill = bench_engine_prefill(engine, args, rng)
            decode = {}
            for num_seqs in args.batches:
                run = decode[num_seqs] = bench_engine_decode(engine, num_seqs, args, rng)
                graphs = cfg.kernels.cuda_graphs and num_seqs <= max(
                    cfg.kernels.cuda_graph_batch_sizes
                )
                print(
                    f"  decode B={num_seqs}: {spread(run.block_ms)} ms/step over {args.repeats} "
                    f"blocks of {args.decode_steps} ({'graphs' if graphs else 'eager'}); "
                    f"fill {run.num_fill_steps} steps, mean context {run.mean_context:.0f}"
                )
        print(f"  Python's collector over the run: {collections.summary()}")
    finally:
        heap.unfreeze()  # the engine's cycles collectable again, for the next mode's engine
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
            print(f"  freed: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated")
    return {"label": label, "cfg": cfg, "start_s": start_s, "prefill": prefill, "decode": decode}


def spread(values: list[float]) -> str:
    """median [min, max]"""
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def print_engine_tables(args, results: dict, bandwidth: float) -> None:
    modes = list(results)
    ms = {
        m: {b: statistics.median(r.block_ms) for b, r in results[m]["decode"].items()}
        for m in modes
    }
    labels = [results[m]["label"] for m in modes]
    pair = len(modes) == 2
    head = ["phase", "B", *(f"{lab} ms/step [min, max]" for lab in labels)]
    head += [f"{modes[0]}/{modes[1]}"] if pair else []
    head += ["floor ms", *(f"{m}/floor" for m in modes), *(f"{m} tok/s" for m in modes)]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    model_cfg = results[modes[0]]["cfg"].model
    for b in args.batches:
        context = results[modes[0]]["decode"][b].mean_context
        floor_ms = decode_step_bytes(model_cfg, b, context).total / bandwidth * 1e3
        row = [f"decode ctx {args.context}", str(b)]
        row += [spread(results[m]["decode"][b].block_ms) for m in modes]
        row += [f"{ms[modes[0]][b] / ms[modes[1]][b]:.2f}"] if pair else []
        row += [f"{floor_ms:.3g}", *(f"{ms[m][b] / floor_ms:.1f}" for m in modes)]
        row += [f"{b / ms[m][b] * 1e3:.0f}" for m in modes]
        print("| " + " | ".join(row) + " |")
    print(
        f"\nfloor: bench/hbm_floor.py bytes at each B's mean timed context (log above) / the "
        f"{bandwidth / 1e12:.3f} TB/s copy ceiling; tok/s = B / median ms/step"
    )
    tok_s = {m: statistics.median(results[m]["prefill"]) for m in modes}
    head = ["phase", *(f"{lab} tok/s [min, max]" for lab in labels)]
    head += [f"{modes[0]}/{modes[1]} time"] if pair else []
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    row = [f"prefill {args.prefill_prompts}x{args.context}"]
    row += [
        f"{tok_s[m]:.0f} [{min(results[m]['prefill']):.0f}, {max(results[m]['prefill']):.0f}]"
        for m in modes
    ]
    row += [f"{tok_s[modes[1]] / tok_s[modes[0]]:.2f}"] if pair else []
    print("| " + " | ".join(row) + " |")
    print("\nengine start: " + ", ".join(f"{m} {results[m]['start_s']:.1f} s" for m in modes))


def fast_decode_attention() -> str:
    """Which decode attention fast mode can take here. Why printed: FlashMLA is an optional
    wheel; without it fast mode falls back to the split-KV Triton kernel with no word, and the
    baseline every invariant / fast ratio is read against is a weaker one."""
    from moe_kernels import fast_attention

    if not fast_attention.HAS_FLASH_MLA:
        return "FlashMLA not importable: the split-KV Triton kernel (a weaker baseline)"
    version = getattr(fast_attention.flash_mla, "__version__", "?")
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if capability != fast_attention.FLASH_MLA_CAPABILITY:
        return f"FlashMLA {version} present but needs SM90, device is {capability}: split-KV"
    return f"FlashMLA {version} (dense bf16 decode where it fits, else the split-KV kernel)"


def bench_engine(args) -> None:
    """Every mode through the engine, one after the other in this process."""
    # Every mode's config is checked before the first (slow) engine start.
    configs = {mode: engine_config(args, mode) for mode in args.modes}
    cfg = configs[args.modes[0]][0]
    device = torch.device(cfg.parallel.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
    print(f"command: {shlex.join(sys.argv)}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"device: {name or 'cpu'}; torch {torch.__version__}, triton {triton.__version__}")
    print(
        f"model: {cfg.model.num_hidden_layers} layers, hidden {cfg.model.hidden_size}, "
        f"{cfg.model.n_routed_experts} experts top-{cfg.model.num_experts_per_tok}, "
        f"{cfg.model.dtype}; budget {cfg.scheduler.max_num_batched_tokens} tokens/step"
    )
    if "fast" in args.modes and device.type == "cuda":
        print(f"fast mode's decode attention: {fast_decode_attention()}")
    # Measured first, on an empty device: a 1 GiB buffer there, 64 MiB on the host.
    nbytes = 2**30 if device.type == "cuda" else 2**26
    bandwidth = copy_bandwidth(device, nbytes)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the buffers' memory back before the engine sizes its cache
    mib = nbytes >> 20
    print(f"{device.type} copy ceiling: {bandwidth / 1e12:.3f} TB/s (read + write, {mib} MiB)")
    results = {  # every mode draws the same prompts
        mode: bench_engine_mode(cfg, notes, args, np.random.default_rng(args.seed))
        for mode, (cfg, notes) in configs.items()
    }
    print_engine_tables(args, results, bandwidth)
