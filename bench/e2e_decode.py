"""End-to-end prefill and decode throughput of the DeepSeek-V2-Lite-shaped model, invariant vs
fast kernels, in one run on one GPU; plus decode attention bandwidth vs a device copy.

`--engine` times the runtime as a user gets it: per mode in `--modes`, an LLMEngine built from
the config (+ `--set` overrides, `kernels.mode` set per mode; whether CUDA graphs run is the
config's resolved `kernels.cuda_graphs`, shown per mode), random prompt ids from `--seed`,
greedy sampling with ignore_eos. Decode, per B in `--batches`: B prompts of `--context` tokens,
stepped until every one has its first token (prefill excluded), `--warmup-steps` steps, then
`--repeats` blocks of `--decode-steps` steps, each `engine.step()` (synchronous: it returns
host data) timed with perf_counter; every timed step must return one new token for each of the
B requests. ms/step = median over blocks [min, max]. Prefill: `--prefill-prompts` fresh random
prompts of `--context` tokens submitted together, the steps until all have a first token timed,
median of `--repeats` after one warm-up. Floor: the bytes a decode step reads
(bench/hbm_floor.py) over a device copy's bandwidth measured in the same run. One engine at a
time: each is shut down and its memory freed before the next mode's is built.

Without `--engine` the model forward is timed directly (ForwardBatch in, logits out; no
scheduler, no sampler): prefill = P prompts of L tokens in one step; decode = B sequences, one
token each per step, S steps from context L. Random weights drawn on the GPU (the loader's CPU
draw of 15.7B parameters would take minutes); the KV cache is random too, since attention
reads it all the same. Both modes run on one set of weights: the op table is swapped in place.
Times are CUDA-event medians after warm-up. `--cuda-graphs` instead times invariant decode
eagerly and through the DecodeGraphRunner (host batch in, as the ModelRunner feeds it), and
checks the two give the same logits bits.

    PYTHONUNBUFFERED=1 python bench/e2e_decode.py --engine [--batches 1 8 64 256] \
        [--set kernels.cuda_graphs=true --set 'kernels.cuda_graph_batch_sizes=[1,8,64,256]']
    python bench/e2e_decode.py --engine --config launch/configs/tiny_cpu.yaml \
        --batches 1 2 --context 16 --decode-steps 4 --repeats 5          # CPU smoke test
    PYTHONUNBUFFERED=1 python bench/e2e_decode.py [--set model.num_hidden_layers=8] ...
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.hbm_floor import copy_bandwidth, decode_step_bytes  # noqa: E402
from kernels import KernelConfig, build_op_table  # noqa: E402
from kernels.attention import mla_attention_fast  # noqa: E402
from kernels.triton_attention import mla_attention_triton  # noqa: E402
from launch.cli import add_override_argument, parse_overrides  # noqa: E402
from moe_runtime.config import RuntimeConfig, load_config  # noqa: E402
from moe_runtime.engine import LLMEngine  # noqa: E402
from moe_runtime.forward_batch import ForwardBatch  # noqa: E402
from moe_runtime.model.deepseek import DeepseekForCausalLM  # noqa: E402
from moe_runtime.sampling_params import SamplingParams  # noqa: E402
from moe_runtime.worker.cuda_graphs import DecodeGraphRunner  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "launch" / "configs" / "v2_lite_gpu.yaml"


def build_random_model(cfg, ops) -> DeepseekForCausalLM:
    with torch.device("cuda"):
        model = DeepseekForCausalLM(cfg.model, ops)
    gen = torch.Generator(device="cuda").manual_seed(cfg.model.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                param.zero_()
            else:
                param.normal_(0.0, cfg.model.init_std, generator=gen)
    model.after_weights_loaded()
    return model


def set_ops(model: torch.nn.Module, ops) -> None:
    """Rebind every module's op table (benchmark only: one set of weights for both modes)."""
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops


def make_batch(
    num_seqs: int, positions_per_seq: list[range], blocks_per_seq: int, block_size, device="cuda"
):
    token_ids, positions, seq_ids, slots, logit_rows = [], [], [], [], []
    for s, span in enumerate(positions_per_seq):
        for p in span:
            token_ids.append((s * 7919 + p * 104729) % 100000)
            positions.append(p)
            seq_ids.append(s)
            slots.append((s * blocks_per_seq + p // block_size) * block_size + p % block_size)
        logit_rows.append(len(token_ids) - 1)
    tables = torch.arange(num_seqs * blocks_per_seq).view(num_seqs, blocks_per_seq)
    return ForwardBatch(
        torch.tensor(token_ids),
        torch.tensor(positions),
        torch.tensor(seq_ids),
        tables,
        torch.tensor(slots),
        torch.tensor(logit_rows),
    ).to(torch.device(device))


def time_ms(fn, reps: int, warmup=None) -> float:
    (warmup or fn)()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_model(cfg, args) -> dict:
    block_size = cfg.cache.block_size
    ctx = args.prompt_len + args.decode_steps
    blocks_per_seq = -(-ctx // block_size)
    num_seqs = max(args.prefill_prompts, args.decode_batch)
    num_blocks = num_seqs * blocks_per_seq
    kv_caches = [
        torch.randn(num_blocks, block_size, cfg.model.latent_dim, device="cuda").bfloat16()
        for _ in range(cfg.model.num_hidden_layers)
    ]
    ops = {mode: build_op_table(KernelConfig(mode=mode), "cuda") for mode in ("invariant", "fast")}
    model = build_random_model(cfg, ops["invariant"])
    print(f"weights: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated with KV cache")
    prefill = make_batch(
        args.prefill_prompts,
        [range(args.prompt_len)] * args.prefill_prompts,
        blocks_per_seq,
        block_size,
    )
    decode_batches = [
        make_batch(
            args.decode_batch,
            [range(args.prompt_len + i, args.prompt_len + i + 1)] * args.decode_batch,
            blocks_per_seq,
            block_size,
        )
        for i in range(args.decode_steps)
    ]
    results = {}
    for mode in args.modes:
        set_ops(model, ops[mode])
        prefill_ms = time_ms(lambda: model(prefill, kv_caches), reps=3)

        def decode(batches):
            for batch in batches:
                model(batch, kv_caches)

        # One timed pass over all steps, after a few warm-up steps.
        decode_ms = time_ms(
            lambda: decode(decode_batches), reps=1, warmup=lambda: decode(decode_batches[:4])
        )
        results[mode] = {
            "prefill_tok_s": prefill.num_tokens / prefill_ms * 1e3,
            "prefill_ms": prefill_ms,
            "decode_tok_s": args.decode_batch * args.decode_steps / decode_ms * 1e3,
            "decode_step_ms": decode_ms / args.decode_steps,
        }
        print(mode, {k: round(v, 2) for k, v in results[mode].items()})
    return results


def bench_graphs(cfg, args, batch_sizes: list[int]) -> None:
    """Invariant decode, B sequences x S steps from context L, per B: eager vs CUDA graphs."""
    block_size = cfg.cache.block_size
    blocks_per_seq = -(-(args.prompt_len + args.decode_steps) // block_size)
    max_blocks = max(blocks_per_seq, -(-cfg.scheduler.max_model_len // block_size))
    num_blocks = max(batch_sizes) * blocks_per_seq
    kv_caches = [  # one extra block: the graphs' scratch block
        torch.randn(num_blocks + 1, block_size, cfg.model.latent_dim, device="cuda").bfloat16()
        for _ in range(cfg.model.num_hidden_layers)
    ]
    model = build_random_model(cfg, build_op_table(KernelConfig(), "cuda"))
    sizes = cfg.kernels.cuda_graph_batch_sizes
    graphs = DecodeGraphRunner(model, kv_caches, sizes, max_blocks, num_blocks)
    for num_seqs in batch_sizes:
        batches = [
            make_batch(
                num_seqs,
                [range(args.prompt_len + i, args.prompt_len + i + 1)] * num_seqs,
                blocks_per_seq,
                block_size,
                device="cpu",
            )
            for i in range(args.decode_steps)
        ]
        paths = {
            "eager": lambda b: model(b.to(torch.device("cuda")), kv_caches),
            "graphs": graphs.run,
        }
        step_ms, last = {}, {}
        for name, run in paths.items():

            def decode(steps, run=run, name=name, last=last):
                for batch in steps:
                    last[name] = run(batch)

            decode(batches[:2])  # warm-up: compiles, and captures the graphs of this size
            timed = partial(decode, batches)
            step_ms[name] = time_ms(timed, reps=3) / args.decode_steps
        bucket = next(n for n in sizes if n >= num_seqs)
        print(
            f"decode B={num_seqs} (graph size {bucket}) ctx={args.prompt_len}: "
            f"eager {step_ms['eager']:.2f} ms/step, graphs {step_ms['graphs']:.2f} ms/step "
            f"({step_ms['eager'] / step_ms['graphs']:.2f}x); "
            f"last step's logits bitwise equal: {torch.equal(last['eager'], last['graphs'])}; "
            f"replays {graphs.num_replays}, captures {graphs.num_captures}"
        )


def bench_attention(args) -> None:
    """Decode attention alone (B queries, 16 heads, latent 512 + rope 64) vs a device copy."""
    copy_src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    copy_ms = triton.testing.do_bench(lambda: copy_dst.copy_(copy_src), return_mode="median")
    ceiling = 2 * copy_src.numel() / copy_ms / 1e9
    print(f"\ndevice copy ceiling: {ceiling:.2f} TB/s (read + write)")
    for batch, ctx in ((64, 1024), (64, 4096), (256, 1024), (8, 8192)):
        block_size, blocks = 64, -(-ctx // 64)
        kv = torch.randn(batch * blocks, block_size, 576, device="cuda").bfloat16()
        q = torch.randn(batch, 16, 576, device="cuda").bfloat16()
        tables = torch.arange(batch * blocks, device="cuda").view(batch, blocks)
        seq_ids = torch.arange(batch, device="cuda")
        positions = torch.full((batch,), ctx - 1, device="cuda")
        inputs = (q, kv, seq_ids, tables, positions)
        times = [
            triton.testing.do_bench(
                partial(op, *inputs, scale=192**-0.5, v_dim=512), return_mode="median"
            )
            for op in (mla_attention_triton, mla_attention_fast)
        ]
        triton_ms, fast_ms = times
        read = batch * ctx * 576 * 2
        tbs = read / triton_ms / 1e9
        print(
            f"decode attention B={batch:4d} ctx={ctx:5d}: triton {triton_ms * 1e3:8.1f} us "
            f"{tbs:5.2f} TB/s ({tbs / ceiling:4.0%} of copy) | fast {fast_ms * 1e3:8.1f} us"
        )


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
    blocks = max(n * -(-length // block_size) for n, length in lengths)
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
        max_tokens=bound + args.warmup_steps + timed, temperature=0.0, ignore_eos=True
    )
    prompts = random_prompts(rng, num_seqs, args.context, cfg.model.vocab_size)
    requests = engine.add_requests(prompts, [params] * num_seqs)
    num_fill_steps, num_out = step_until_started(engine, {r.request_id for r in requests})
    assert num_fill_steps < bound, f"prefill took {num_fill_steps} steps, bound {bound}"
    for _ in range(args.warmup_steps):
        check_decode_step(engine.step(), num_seqs)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (num_seqs, 0), stats
    # The token a step feeds sits at prompt + outputs - 1 and attends over prompt + outputs.
    first_context = args.context + statistics.mean(num_out.values()) + args.warmup_steps
    block_ms = []
    for _ in range(args.repeats):
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()  # nothing pending; step() itself returns host data
        outputs = []
        start = time.perf_counter()
        for _ in range(args.decode_steps):
            outputs.append(engine.step())
        block_ms.append((time.perf_counter() - start) * 1e3 / args.decode_steps)
        for step_outputs in outputs:
            check_decode_step(step_outputs, num_seqs)
    assert engine.stats().num_preemptions == stats.num_preemptions, "a timed step preempted"
    for request in requests:  # they have tokens left; free their blocks for the next B
        engine.abort(request.request_id)
    return DecodeRun(block_ms, first_context + (timed - 1) / 2, num_fill_steps)


def bench_engine_mode(cfg: RuntimeConfig, notes: list[str], args, rng: np.random.Generator) -> dict:
    start = time.perf_counter()
    engine = LLMEngine(cfg)
    start_s = time.perf_counter() - start
    label = cfg.kernels.mode + (" +graphs" if cfg.kernels.cuda_graphs else "")
    print(f"\n{label}: engine start {start_s:.1f} s" + "".join(f"; {n}" for n in notes))
    try:
        prefill = bench_engine_prefill(engine, args, rng)
        decode = {}
        for num_seqs in args.batches:
            run = decode[num_seqs] = bench_engine_decode(engine, num_seqs, args, rng)
            graphs = cfg.kernels.cuda_graphs and num_seqs <= max(cfg.kernels.cuda_graph_batch_sizes)
            print(
                f"  decode B={num_seqs}: {spread(run.block_ms)} ms/step over {args.repeats} "
                f"blocks of {args.decode_steps} ({'graphs' if graphs else 'eager'}); "
                f"fill {run.num_fill_steps} steps, mean context {run.mean_context:.0f}"
            )
    finally:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(CONFIG))
    add_override_argument(parser)
    parser.add_argument("--prefill-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument(
        "--decode-steps", type=int, default=None, help="default 128 (forward), 32 (--engine)"
    )
    parser.add_argument("--modes", nargs="+", default=["invariant", "fast"])
    parser.add_argument("--engine", action="store_true", help="time LLMEngine.step, then exit")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--context", type=int, default=1024, help="--engine prompt length")
    parser.add_argument("--repeats", type=int, default=5, help="--engine timed blocks")
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="--engine prompt ids")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="decode eager vs CUDA graphs, then exit"
    )
    parser.add_argument(
        "--graph-batches", type=int, nargs="*", default=[], help="decode batch sizes to time"
    )
    args = parser.parse_args()
    if args.engine:
        args.decode_steps = args.decode_steps or 32
        bench_engine(args)
        return
    args.decode_steps = args.decode_steps or 128
    overrides = parse_overrides(args.set)
    cfg = load_config(args.config, overrides)
    print(
        f"model: {cfg.model.num_hidden_layers} layers, hidden {cfg.model.hidden_size}, "
        f"{cfg.model.n_routed_experts} experts top-{cfg.model.num_experts_per_tok}; "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    if args.cuda_graphs:
        bench_graphs(cfg, args, args.graph_batches or [args.decode_batch])
        return
    results = bench_model(cfg, args)
    if "invariant" in results and "fast" in results:
        inv, fast = results["invariant"], results["fast"]
        print("\n| phase | invariant tok/s | fast tok/s | invariant / fast time |")
        print("|---|---|---|---|")
        for phase in ("prefill", "decode"):
            key = f"{phase}_tok_s"
            print(f"| {phase} | {inv[key]:.0f} | {fast[key]:.0f} | {fast[key] / inv[key]:.2f} |")
    if not args.skip_attention:
        bench_attention(args)


if __name__ == "__main__":
    main()
