"""Expert-parallel exchange throughput: dispatch + combine per rank against a raw all_to_all.

One process per rank (one GPU each over NCCL, or CPU processes over gloo for a smoke run).
For each shape (hidden size, top-k, routed experts) and tokens per rank: uniform random
routing (k distinct experts per token, experts spread evenly over the ranks), bf16 rows; then,
timed one call at a time after a barrier (the slowest rank's time counts, median of the
repeats):
- `AllToAllDispatcher` (uneven all_to_all_single, host split sizes) dispatch, then combine of
  the received rows (no expert GEMM: the exchange alone, combine's sum included);
- `FixedCapacityDispatcher` (equal blocks of T*K rows, counts on the device; eager here, so
  each call first agrees the token count with one small all_reduce, which a CUDA graph step
  does once per step instead);
- `DeepEPDispatcher` (DeepEP v2 as transport, comm/deepep_dispatch.py) when the backend is
  NCCL and `deep_ep` is installed (hidden sizes that are multiples of 256);
- a raw `all_to_all_single` of exactly the bytes AllToAllDispatcher moves (its split sizes),
  each way: the ceiling the backends are held to.
GB/s per rank = bf16 bytes of the rows this rank's experts receive (dispatch) or send back
(combine), local rows included, over the time (as DeepEP counts its bandwidth). Results go to
stdout as a markdown table with the command and the date.

    python bench/dispatch.py --world 2 --tokens 128 4096 --shapes v2_lite v3        # GPUs, NCCL
    python bench/dispatch.py --backend gloo --world 2 --tokens 8 --shapes tiny --repeats 2
"""

from __future__ import annotations

import argparse
import datetime
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from comm.capacity_dispatch import FixedCapacityDispatcher  # noqa: E402
from comm.deepep_dispatch import HIDDEN_MULTIPLE, DeepEPDispatcher, is_deepep_installed  # noqa: E402
from comm.dispatch import AllToAllDispatcher  # noqa: E402
from moe_kernels import KernelConfig, build_op_table  # noqa: E402

# name -> (hidden size, top-k, routed experts)
SHAPES = {"v2_lite": (2048, 6, 64), "v3": (7168, 8, 256), "tiny": (64, 2, 8)}
DEEPEP_TIMEOUT_S = 60.0


def _dispatchers(rank, world, device, name, tokens, moe_combine) -> dict:
    """label -> dispatcher for this shape (DeepEP's: only over NCCL with deep_ep installed)."""
    hidden, top_k, num_experts = SHAPES[name]
    args = (dist.group.WORLD, rank, world, num_experts // world)
    out = {
        "all_to_all": AllToAllDispatcher(*args, False, device, moe_combine),
        "fixed_capacity": FixedCapacityDispatcher(*args, False, device, moe_combine),
    }
    if device.type == "cuda" and is_deepep_installed() and hidden % HIDDEN_MULTIPLE == 0:
        # Collective: every rank builds DeepEP's buffer together.
        out["deepep"] = DeepEPDispatcher(
            *args, hidden, tokens, top_k, device, moe_combine, DEEPEP_TIMEOUT_S
        )
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int, warmup: int) -> tuple[float, object]:
    """Median over repeats of the slowest rank's seconds for one fn() call (after a barrier)."""
    result = None
    for _ in range(warmup):
        result = fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        _sync(device)
        # On the ranks' device: an NCCL group has no CPU backend (the max is taken after the
        # clock stopped, so its cost is not timed).
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return statistics.median(times), result


def _routing(rank: int, tokens: int, shape: str, device: torch.device):
    """This rank's rows [T, hidden] bf16, k distinct uniform experts per token, weights."""
    hidden, top_k, num_experts = SHAPES[shape]
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, num_experts, generator=gen).topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, generator=gen)
    return x.to(device), ids.to(device), weights.to(device)


def _bench_shape(rank, world, device, name, tokens, args, moe_combine) -> list[dict]:
    hidden, _, num_experts = SHAPES[name]
    if num_experts % world:
        raise ValueError(f"shape {name}: {num_experts} experts do not split over {world} ranks")
    x, ids, weights = _routing(rank, tokens, name, device)
    rows = []
    splits = None
    dispatchers = _dispatchers(rank, world, device, name, tokens, moe_combine)
    for label, d in dispatchers.items():
        t_dispatch, (recv, group_sizes, handle) = _timed(
            lambda d=d: d.dispatch(x, ids, weights), device, args.repeats, args.warmup
        )
        t_combine, _ = _timed(
            lambda d=d, recv=recv, handle=handle: d.combine(recv, handle, weights),
            device,
            args.repeats,
            args.warmup,
        )
        num_rows = int(group_sizes.sum())  # real rows this rank's experts received
        if label == "all_to_all":
            splits = (handle.send_splits, handle.recv_splits)
        rows.append(_row(name, tokens, label, num_rows * hidden * 2, t_dispatch, t_combine))
    if "deepep" in dispatchers:
        dispatchers["deepep"].close()  # collective: DeepEP's destroy barriers every rank
    send_splits, recv_splits = splits
    send = torch.randn(sum(send_splits), hidden).to(torch.bfloat16).to(device)
    recv = send.new_empty((sum(recv_splits), hidden))

    def raw(out, inp, out_splits, in_splits):
        return lambda: dist.all_to_all_single(out, inp, out_splits, in_splits)

    timing = (device, args.repeats, args.warmup)
    t_there, _ = _timed(raw(recv, send, recv_splits, send_splits), *timing)
    t_back, _ = _timed(raw(send, recv, send_splits, recv_splits), *timing)
    num_bytes = sum(recv_splits) * hidden * 2
    rows.append(_row(name, tokens, "raw all_to_all_single", num_bytes, t_there, t_back))
    return rows


def _row(shape, tokens, label, num_bytes, t_dispatch, t_combine) -> dict:
    return {
        "shape": shape,
        "tokens": tokens,
        "path": label,
        "bytes": num_bytes,
        "dispatch_us": t_dispatch * 1e6,
        "combine_us": t_combine * 1e6,
    }


def _worker(rank: int, world: int, backend: str, port: int, args, queue) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=args.timeout_s),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    try:
        moe_combine = build_op_table(KernelConfig(), device).moe_combine
        rows = []
        for name in args.shapes:
            for tokens in args.tokens:
                rows += _bench_shape(rank, world, device, name, tokens, args, moe_combine)
                if rank == 0:
                    print(f"  {name} x {tokens} tokens/rank done", file=sys.stderr, flush=True)
        gathered = [None] * world
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            queue.put(gathered)
    finally:
        dist.destroy_process_group()


def _table(per_rank: list[list[dict]]) -> str:
    """One line per (shape, tokens, path): times are already the slowest rank's; bytes and GB/s
    are the mean over ranks; the last column is the raw all_to_all's dispatch+combine time over
    the path's (1.0 = as fast as the raw exchange)."""
    lines = [
        "| shape | tokens/rank | path | dispatch µs | combine µs | dispatch GB/s/rank | "
        "combine GB/s/rank | raw / path time |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def total_us(row: dict) -> float:
        return row["dispatch_us"] + row["combine_us"]

    raw_us = {
        (row["shape"], row["tokens"]): total_us(row)
        for row in per_rank[0]
        if row["path"].startswith("raw")
    }
    for i, row in enumerate(per_rank[0]):
        mean_bytes = statistics.mean(rank_rows[i]["bytes"] for rank_rows in per_rank)
        ratio = raw_us[(row["shape"], row["tokens"])] / total_us(row)
        lines.append(
            f"| {row['shape']} | {row['tokens']} | {row['path']} | {row['dispatch_us']:.0f} | "
            f"{row['combine_us']:.0f} | {mean_bytes / row['dispatch_us'] / 1e3:.1f} | "
            f"{mean_bytes / row['combine_us'] / 1e3:.1f} | {ratio:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=None, help="ranks (default: GPU count)")
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["v2_lite", "v3"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    world = args.world or (torch.cuda.device_count() if backend == "nccl" else 2)
    if world < 2:
        parser.error(f"--world must be >= 2 (an exchange needs two ranks), got {world}")
    if backend == "nccl" and world > torch.cuda.device_count():
        parser.error(f"--world {world} needs {world} GPUs, found {torch.cuda.device_count()}")
    if any(t < 1 for t in args.tokens) or args.repeats < 1 or args.warmup < 0:
        parser.error("--tokens and --repeats must be >= 1, --warmup >= 0")
    print(f"command: bench/dispatch.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    device_name = torch.cuda.get_device_name() if backend == "nccl" else "CPU processes"
    print(f"backend: {backend}, world {world}, {device_name}; torch {torch.__version__}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(
        _worker,
        args=(world, backend, _free_port(), args, queue),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    print(_table(queue.get(timeout=args.timeout_s)))


if __name__ == "__main__":
    main()
