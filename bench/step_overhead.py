"""Host-side cost of one decode step at the driver/worker boundary, without the model.

The driver state is what LLMEngine holds mid-decode: real Schedulers and BlockManagers, B
sequences of C tokens each (a prompt, then output tokens that each carry a logprob, a top-5
logprobs dict and routed experts [MoE layer][K]), spread over the DP ranks as the engine
spreads them, and each rank's worker-side copy of its sequences. Each timed step is a real
step through the engine's and the worker's own code: driver (schedule + every rank's
`StepInput`), serialize and deserialize (pickle protocol 5 of every rank's message and of its
reply, as Ray does for actor call arguments and results), apply (the worker bringing its
sequences up to date, and the replies recorded into the driver's sequences with the output
deltas built, as LLMEngine.step ends). Times are summed over ranks (CPU cost, not latency), all
in this one process with the garbage collector on, as in Ray. Context C is a sequence's token
count at the first timed step (bytes are that step's; the warm-up step before it sends each
sequence whole, once); each step adds a token. Only `rank_messages`, `rank_reply` and
`apply_replies` know the wire format.

    python bench/step_overhead.py [--contexts 64 4096] [--repeats 7] [--shape v2_lite|v3]
"""

from __future__ import annotations

import argparse
import gc
import pickle
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moe_runtime.config import RuntimeConfig, load_config  # noqa: E402
from moe_runtime.engine.block_manager import BlockManager  # noqa: E402
from moe_runtime.engine.request import Request, Sequence, SequenceStatus  # noqa: E402
from moe_runtime.engine.scheduler import ScheduledChunk, Scheduler  # noqa: E402
from moe_runtime.engine.step_io import (  # noqa: E402
    build_step_input,
    record_results,
    request_output,
)
from moe_runtime.sampling_params import SamplingParams  # noqa: E402
from moe_runtime.tokenizer import ByteTokenizer  # noqa: E402
from moe_runtime.worker.step_input import SampleResult, StepInput, StepOutput  # noqa: E402
from moe_runtime.worker.worker import Worker  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "launch" / "configs" / "v2_lite_gpu.yaml"
# Model keys that set the per-token payload (MoE layers, K, expert and vocab ranges); the
# cache and scheduler sections stay those of the V2-Lite GPU config.
SHAPES: dict[str, dict[str, int]] = {
    "v2_lite": {},
    "v3": {
        "model.num_hidden_layers": 61,
        "model.first_k_dense_replace": 3,
        "model.n_routed_experts": 256,
        "model.num_experts_per_tok": 8,
        "model.n_group": 8,
        "model.topk_group": 4,
        "model.vocab_size": 129280,
    },
}
PICKLE_PROTOCOL = 5  # what Ray's serializer uses for actor call arguments and results
NUM_TOP_LOGPROBS = 5
NUM_ROUTING_ROWS = 4096  # distinct [K] expert rows to draw from; each use is a fresh list
PHASES = ("driver", "serialize", "deserialize", "apply")


class TokenSource:
    """Per-token values as the sampler and the MoE layers produce them: ids in the vocabulary,
    top-logprobs dicts, and [L_moe, K] int32 arrays of distinct logical experts."""

    def __init__(self, config: RuntimeConfig, seed: int) -> None:
        model = config.model
        self.rng = random.Random(seed)
        self.vocab_size = model.vocab_size
        self.num_moe_layers = model.num_moe_layers
        self.top_k = model.num_experts_per_tok
        experts = range(model.n_routed_experts)
        self._rows = [self.rng.sample(experts, self.top_k) for _ in range(NUM_ROUTING_ROWS)]

    def token_id(self) -> int:
        return self.rng.randrange(self.vocab_size)

    def logprob(self) -> float:
        return -self.rng.expovariate(1.0)

    def top_logprobs(self) -> dict[int, float]:
        return {self.token_id(): self.logprob() for _ in range(NUM_TOP_LOGPROBS)}

    def routed(self) -> np.ndarray:
        """[L_moe, K] int32, as the worker returns them."""
        return np.array(self.rng.choices(self._rows, k=self.num_moe_layers), dtype=np.int32)


@dataclass
class DriverState:
    """What LLMEngine holds between steps: one Scheduler per DP rank, the TP degree, and the
    chunks of the step in flight (to merge the replies into)."""

    schedulers: list[Scheduler]
    tp_size: int
    routed_width: tuple[int, int]  # (MoE layers, K): LLMEngine's, for request_output
    scheduled: list[list[ScheduledChunk]] = field(default_factory=list)
    # Per worker rank: its copy of the sequences it serves (Worker.seqs).
    workers: list[Worker] = field(default_factory=list)


# --- The wire format: port these three when the driver/worker messages change. ---


def rank_messages(state: DriverState) -> list[object]:
    """One step's StepInput per worker rank, as LLMEngine.step builds it: each DP rank's
    deltas, the same object for every TP rank of the group."""
    state.scheduled = [scheduler.schedule() for scheduler in state.schedulers]
    inputs = [
        build_step_input(scheduler.collect_released(), chunks)
        for scheduler, chunks in zip(state.schedulers, state.scheduled, strict=True)
    ]
    return [step for step in inputs for _ in range(state.tp_size)]


def rank_reply(
    rank: int, message: StepInput, state: DriverState, source: TokenSource
) -> tuple[StepOutput, float]:
    """The worker's side: its sequences brought up to date from the message (Worker's own
    code, timed), then one sample and its routed experts per sequence that asks for them."""
    started = time.perf_counter()
    chunks = Worker._apply(state.workers[rank], message)
    seconds = time.perf_counter() - started
    out = StepOutput()
    for chunk in chunks:
        seq_id = chunk.seq.seq_id
        out.samples[seq_id] = SampleResult(
            source.token_id(), source.logprob(), source.top_logprobs()
        )
        if chunk.seq.params.return_routed_experts:
            out.routed[seq_id] = source.routed()
    return out, seconds


def apply_replies(state: DriverState, replies: list[StepOutput]) -> list[Sequence]:
    """The end of LLMEngine.step: TP rank 0's reply of each group recorded into the sequences,
    then every request's output delta; returns the sequences that finished."""
    results = replies[:: state.tp_size]
    finished = []
    for scheduler, chunks, result in zip(state.schedulers, state.scheduled, results, strict=True):
        record_results(scheduler, chunks, result)
        for chunk in chunks:
            request_output(chunk.seq.request, 0, True, state.routed_width)
            finished.extend([chunk.seq] if chunk.seq.is_finished else [])
    return finished


# --- State setup, timing and the table: independent of the wire format. ---


def bench_config(args: argparse.Namespace) -> RuntimeConfig:
    """The V2-Lite GPU config at the requested layout, with room for every step to run."""
    max_model_len = max(args.contexts) + args.warmup + args.repeats + 1
    probe = load_config(CONFIG)
    dp_size = args.world_size // args.tp_size
    blocks_per_seq = -(-max_model_len // probe.cache.block_size)
    overrides = {
        "parallel.world_size": args.world_size,
        "parallel.tp_size": args.tp_size,
        "scheduler.max_model_len": max_model_len,
        "scheduler.max_num_seqs": max(probe.scheduler.max_num_seqs, args.num_seqs),
        "cache.num_blocks": -(-args.num_seqs // dp_size) * blocks_per_seq,
        **SHAPES[args.shape],
    }
    return load_config(CONFIG, overrides)


def make_sequence(
    seq_id: int, num_prompt: int, num_output: int, max_tokens: int, source: TokenSource
) -> Sequence:
    params = SamplingParams(
        max_tokens=max_tokens,
        seed=seq_id,
        logprobs=NUM_TOP_LOGPROBS,
        ignore_eos=True,
        return_routed_experts=True,
    )
    prompt = [source.token_id() for _ in range(num_prompt)]
    request = Request(f"req-{seq_id}", prompt, params, seed=seq_id)
    (seq,) = request.expand_samples(seq_id, ByteTokenizer(max(source.vocab_size, 256)))
    for _ in range(num_output):
        seq.output_token_ids.append(source.token_id())
        seq.output_logprobs.append(source.logprob())
        seq.output_top_logprobs.append(source.top_logprobs())
        seq.routed_experts.append(source.routed())
        seq.detokenizer.update(seq.output_token_ids)  # as the engine does after each token
    seq.num_reported = num_output
    return seq


def build_state(
    config: RuntimeConfig, args: argparse.Namespace, num_tokens: int, source: TokenSource
) -> DriverState:
    """num_seqs running sequences of `num_tokens` tokens (at least one of them output), as
    the previous decode step left them: every token but the last computed and committed."""
    cache = config.cache
    schedulers = [
        Scheduler(
            config.scheduler,
            BlockManager(cache.num_blocks, cache.block_size, cache.enable_prefix_caching),
            config.model.eos_token_ids,
        )
        for _ in range(config.parallel.dp_size)
    ]
    num_prompt = min(args.prompt_len, num_tokens - 1)
    for seq_id in range(args.num_seqs):
        seq = make_sequence(
            seq_id, num_prompt, num_tokens - num_prompt, config.scheduler.max_model_len, source
        )
        # LLMEngine._pick_dp_rank's choice for requests arriving one at a time.
        seq.dp_rank = seq_id % len(schedulers)
        scheduler = schedulers[seq.dp_rank]
        seq.num_computed_tokens = seq.num_tokens - 1
        if not scheduler.blocks.allocate(seq.block_table, seq.num_computed_tokens):
            raise RuntimeError(f"cache.num_blocks={cache.num_blocks} is too small")
        seq.num_committed_blocks, seq.commit_parent = scheduler.blocks.commit(
            seq.block_table, seq.token_ids, seq.num_computed_tokens
        )
        seq.status = SequenceStatus.RUNNING
        scheduler.running.append(seq)
    workers = [Worker(config, rank) for rank in range(config.parallel.world_size)]
    return DriverState(
        schedulers, config.parallel.tp_size, config.model.routed_width, workers=workers
    )


def time_step(state: DriverState, source: TokenSource) -> tuple[dict[str, float], int, int]:
    """One step: seconds per phase (summed over ranks), mean request and reply bytes per rank."""
    clock = time.perf_counter
    t0 = clock()
    messages = rank_messages(state)
    t1 = clock()
    sent = [pickle.dumps(message, protocol=PICKLE_PROTOCOL) for message in messages]
    t2 = clock()
    received = [pickle.loads(payload) for payload in sent]
    t3 = clock()
    answered = [rank_reply(rank, m, state, source) for rank, m in enumerate(received)]
    replies = [reply for reply, _ in answered]
    t4 = clock()
    returned = [pickle.dumps(reply, protocol=PICKLE_PROTOCOL) for reply in replies]
    t5 = clock()
    merged = [pickle.loads(payload) for payload in returned]
    t6 = clock()
    finished = apply_replies(state, merged)
    t7 = clock()
    if finished:
        raise RuntimeError(f"{len(finished)} sequences finished mid-benchmark")
    seconds = {
        "driver": t1 - t0,
        "serialize": (t2 - t1) + (t5 - t4),
        "deserialize": (t3 - t2) + (t6 - t5),
        "apply": (t7 - t6) + sum(seconds for _, seconds in answered),
    }
    num_ranks = len(messages)
    return seconds, sum(map(len, sent)) // num_ranks, sum(map(len, returned)) // num_ranks


def measure(config: RuntimeConfig, args: argparse.Namespace, context: int) -> dict:
    """Per phase and total: milliseconds of each timed step; bytes of the first, which runs at
    `context` tokens per sequence (each warm-up step before it adds one)."""
    source = TokenSource(config, args.seed)
    state = build_state(config, args, context - args.warmup, source)
    for _ in range(args.warmup):
        time_step(state, source)
    samples: dict[str, list[float]] = {phase: [] for phase in (*PHASES, "total")}
    step_bytes = []
    for _ in range(args.repeats):
        gc.collect()  # start each step from the same heap; collections inside it still count
        seconds, request_bytes, reply_bytes = time_step(state, source)
        for phase, value in seconds.items():
            samples[phase].append(value * 1e3)
        samples["total"].append(sum(seconds.values()) * 1e3)
        step_bytes.append((request_bytes, reply_bytes))
    request_bytes, reply_bytes = step_bytes[0]
    return {"ms": samples, "request_bytes": request_bytes, "reply_bytes": reply_bytes}


def _ms(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def spread(values: list[float]) -> str:
    return f"{_ms(statistics.median(values))} [{_ms(min(values))}, {_ms(max(values))}]"


def print_table(rows: dict[int, dict]) -> None:
    columns = [f"{phase} ms" for phase in (*PHASES, "total")]
    header = f"{'context':>8}{'req B/rank':>14}{'reply B/rank':>14}" + "".join(
        f"{name:>24}" for name in columns
    )
    print(header)
    print("-" * len(header))
    for context, row in rows.items():
        cells = "".join(f"{spread(row['ms'][phase]):>24}" for phase in (*PHASES, "total"))
        print(f"{context:>8}{row['request_bytes']:>14,}{row['reply_bytes']:>14,}{cells}")
    base_context, base = next(iter(rows.items()))
    base_total = statistics.median(base["ms"]["total"])
    for context, row in list(rows.items())[1:]:
        ratio = statistics.median(row["ms"]["total"]) / base_total
        print(f"total({context}) / total({base_context}) = {ratio:.1f}x (medians)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="v2_lite")
    parser.add_argument("--num-seqs", type=int, default=64, help="over all DP ranks")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=64, help="the rest are output tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.repeats < 1 or args.warmup < 0 or min(args.contexts) < args.warmup + 2:
        parser.error("need --repeats >= 1, --warmup >= 0 and every context >= warmup + 2")

    config = bench_config(args)
    source = TokenSource(config, args.seed)
    print(
        f"shape={args.shape} moe_layers={source.num_moe_layers} top_k={source.top_k} "
        f"seqs={args.num_seqs} world_size={args.world_size} tp_size={args.tp_size} "
        f"block_size={config.cache.block_size} prompt_len<={args.prompt_len} "
        f"repeats={args.repeats} python={sys.version.split()[0]}"
    )
    print("ms: median [min, max], summed over ranks; B: bytes per rank per step")
    rows = {context: measure(config, args, context) for context in args.contexts}
    print_table(rows)


if __name__ == "__main__":
    main()
