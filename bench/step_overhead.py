"""Host-side cost of one decode step at the driver/worker boundary, without the model.

The driver state is what LLMEngine holds mid-decode: real Schedulers and BlockManagers, B
sequences of C tokens each (a prompt, then output tokens that each carry a logprob, a top-5
logprobs dict and routed experts [MoE layer][K]), spread over the DP ranks as the engine
spreads them. Each timed step is a real step: driver (schedule + every rank's message),
serialize and deserialize (pickle protocol 5 of every rank's message and of its reply, as Ray
does for actor call arguments and results), apply (the replies merged into the sequences, as
LLMEngine.step ends). Times are summed over ranks (CPU cost, not latency), all in this one
process with the garbage collector on, as in Ray. Context C is a sequence's token count at the
first timed step (bytes are that step's); each step adds a token. Only `rank_messages`,
`rank_reply` and `apply_replies` know the wire format.

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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moe_runtime.block_manager import BlockManager  # noqa: E402
from moe_runtime.config import RuntimeConfig, load_config  # noqa: E402
from moe_runtime.model_runner import StepOutput  # noqa: E402
from moe_runtime.sampler import SampleResult  # noqa: E402
from moe_runtime.sampling_params import SamplingParams  # noqa: E402
from moe_runtime.scheduler import ScheduledChunk, Scheduler  # noqa: E402
from moe_runtime.sequence import Sequence, SequenceStatus  # noqa: E402

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
    top-logprobs dicts, and [MoE layer][K] lists of distinct logical experts (fresh list
    objects, as `.tolist()` makes them, so pickle cannot share them)."""

    def __init__(self, config: RuntimeConfig, seed: int) -> None:
        model = config.model
        self.rng = random.Random(seed)
        self.vocab_size = model.vocab_size
        self.num_moe_layers = sum(
            model.is_moe_layer(layer_id) for layer_id in range(model.num_hidden_layers)
        )
        self.top_k = model.num_experts_per_tok
        experts = range(model.n_routed_experts)
        self._rows = [self.rng.sample(experts, self.top_k) for _ in range(NUM_ROUTING_ROWS)]

    def token_id(self) -> int:
        return self.rng.randrange(self.vocab_size)

    def logprob(self) -> float:
        return -self.rng.expovariate(1.0)

    def top_logprobs(self) -> dict[int, float]:
        return {self.token_id(): self.logprob() for _ in range(NUM_TOP_LOGPROBS)}

    def routed(self) -> list[list[int]]:
        return [list(row) for row in self.rng.choices(self._rows, k=self.num_moe_layers)]


@dataclass
class DriverState:
    """What LLMEngine holds between steps: one Scheduler per DP rank, the TP degree, and the
    chunks of the step in flight (to merge the replies into)."""

    schedulers: list[Scheduler]
    tp_size: int
    scheduled: list[list[ScheduledChunk]] = field(default_factory=list)


# --- The wire format: port these three when the driver/worker messages change. ---


def rank_messages(state: DriverState) -> list[object]:
    """One step's message per worker rank, as LLMEngine.step builds it: each DP rank's chunks
    (each carrying its whole Sequence), once per TP rank of the group."""
    state.scheduled = [scheduler.schedule() for scheduler in state.schedulers]
    return [chunks for chunks in state.scheduled for _ in range(state.tp_size)]


def rank_reply(message: list[ScheduledChunk], source: TokenSource) -> StepOutput:
    """What a rank returns for the message it received: one sample (token, logprob, top
    logprobs) and its routed experts per chunk that completes a generating sequence."""
    out = StepOutput()
    for chunk in message:
        if chunk.completes_sequence and not chunk.seq.is_score:
            seq_id = chunk.seq.seq_id
            out.samples[seq_id] = SampleResult(
                source.token_id(), source.logprob(), source.top_logprobs()
            )
            out.routed[seq_id] = source.routed()
    return out


def apply_replies(state: DriverState, replies: list[StepOutput]) -> list[Sequence]:
    """The end of LLMEngine.step: TP rank 0's reply of each group merged into the sequences;
    returns the sequences that finished."""
    results = replies[:: state.tp_size]
    finished = []
    for scheduler, chunks, result in zip(state.schedulers, state.scheduled, results, strict=True):
        for chunk in chunks:
            seq = chunk.seq
            seq.output_logprobs.extend(result.scored.get(seq.seq_id, []))
            if seq.seq_id in result.routed:
                seq.routed_experts.append(result.routed[seq.seq_id])
        finished.extend(scheduler.update(chunks, result.samples))
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
        max_tokens=max_tokens, seed=seq_id, logprobs=NUM_TOP_LOGPROBS, ignore_eos=True
    )
    prompt = [source.token_id() for _ in range(num_prompt)]
    seq = Sequence(seq_id, f"req-{seq_id}", 0, prompt, params, seed=seq_id)
    for _ in range(num_output):
        seq.output_token_ids.append(source.token_id())
        seq.output_logprobs.append(source.logprob())
        seq.output_top_logprobs.append(source.top_logprobs())
        seq.routed_experts.append(source.routed())
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
            config.model.eos_token_id,
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
        scheduler.blocks.commit(seq.block_table, seq.token_ids, seq.num_computed_tokens)
        seq.status = SequenceStatus.RUNNING
        scheduler.running.append(seq)
    return DriverState(schedulers, config.parallel.tp_size)


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
    replies = [rank_reply(message, source) for message in received]  # the model's part
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
        "apply": t7 - t6,
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
