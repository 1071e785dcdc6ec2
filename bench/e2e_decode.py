"""End-to-end prefill and decode throughput of the DeepSeek-V2-Lite-shaped model, invariant vs
fast kernels, in one run on one GPU (decode attention alone: bench/gpu_kernels.py attention).

`--engine` times the runtime as a user gets it: per mode in `--modes`, an LLMEngine built from
the config (+ `--set` overrides, `kernels.mode` set per mode; whether CUDA graphs run is the
config's resolved `kernels.cuda_graphs`, shown per mode), random prompt ids from `--seed`,
greedy sampling with ignore_eos. Decode, per B in `--batches`: B prompts of `--context` tokens,
stepped until every one has its first token (prefill excluded), `--warmup-steps` steps, then
`--repeats` blocks of `--decode-steps` steps run back to back, timed with perf_counter from
one block's last `engine.step()` return to the next's (no synchronize between blocks: with
overlap_decode a step returns with the next one in flight); every timed step must return one
new token for each of the B requests. ms/step = median over blocks [min, max]. Prefill:
`--prefill-prompts` fresh random prompts of `--context` tokens submitted together, the steps
until all have a first token timed, median of `--repeats` after one warm-up. Floor: the bytes a
decode step reads (bench/hbm_floor.py) over a device copy's bandwidth measured in the same run.
One engine at a time: each is shut down and its memory freed before the next mode's is built.

Without `--engine` the model forward is timed directly (ForwardBatch in, logits out; no
scheduler, no sampler): prefill = P prompts of L tokens in one step; decode = B sequences, one
token each per step, S steps from context L. Random weights from the loader (drawn on the
GPU); the KV cache is random too, since attention reads it all the same. Both modes run on
one set of weights: the op table is swapped in place.
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
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_bench import bench_engine  # noqa: E402
from launch.cli import add_override_argument, parse_overrides  # noqa: E402
from moe_kernels import KernelConfig, build_op_table, triton_pdl  # noqa: E402
from moe_runtime.config import load_config  # noqa: E402
from moe_runtime.forward_batch import ForwardBatch  # noqa: E402
from moe_runtime.model.loader import build_model  # noqa: E402
from moe_runtime.worker.cuda_graphs import DecodeGraphRunner  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "launch" / "configs" / "v2_lite_gpu.yaml"


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
    model = build_model(cfg.model, ops["invariant"], "cuda")
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
    model = build_model(cfg.model, build_op_table(KernelConfig(), "cuda"), "cuda")
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
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="--engine decode sampling (0: greedy)"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="--engine decode nucleus (with --temperature)"
    )
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="decode eager vs CUDA graphs, then exit"
    )
    parser.add_argument(
        "--graph-batches", type=int, nargs="*", default=[], help="decode batch sizes to time"
    )
    parser.add_argument(
        "--no-pdl", action="store_true", help="launch without PDL (moe_kernels/triton_pdl.py)"
    )
    parser.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="--engine: leave start-up's objects in the cyclic collector's view (serve_ep "
        "freezes them: moe_runtime/heap.py)",
    )
    args = parser.parse_args()
    if args.no_pdl:
        triton_pdl.ENABLED = False
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


if __name__ == "__main__":
    main()
