"""Helpers for the end-to-end invariance tests: prompts, parameters and exact fingerprints."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from moe_runtime import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
TINY_CONFIG = ROOT / "launch" / "configs" / "tiny_cpu.yaml"
HASH_SEEDS = (1, 2)  # PYTHONHASHSEED of the fresh processes: str hashes differ between them


def mixed_prompts(num: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def mixed_params(num: int, max_tokens: int, logprobs: int = 5) -> list[SamplingParams]:
    """Even indices greedy, odd indices seeded sampling with temperature, top-k and top-p."""
    return [
        SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(
            max_tokens=max_tokens,
            temperature=0.9,
            top_k=50,
            top_p=0.95,
            seed=1000 + i,
            logprobs=logprobs,
            ignore_eos=True,
        )
        for i in range(num)
    ]


def fingerprint(output) -> tuple:
    """Token ids, chosen logprobs and top-k ids and logprobs; every float as its exact bits."""
    return (
        tuple(output.token_ids),
        tuple(float.hex(x) for x in output.logprobs),
        tuple(tuple((t, float.hex(lp)) for t, lp in top.items()) for top in output.top_logprobs),
    )


def run_in_batches(llm, prompts, params, batches: list[list[int]]) -> dict[int, tuple]:
    """Generate the prompts in the given index batches; -> {prompt index: fingerprint}."""
    results = {}
    for batch in batches:
        outputs = llm.generate([prompts[i] for i in batch], [params[i] for i in batch])
        results.update({i: fingerprint(o) for i, o in zip(batch, outputs, strict=True)})
    return results


def run_each_batch(llm, prompts, params, batches: list[list[int]]) -> tuple[list[dict], object]:
    """Each index batch generated alone (run_in_batches), then llm shut down; -> (per batch
    {prompt index: fingerprint}, the worker's model runner, kept past the shutdown)."""
    runner = llm.engine.executor.worker.runner  # shutdown drops the engine
    try:
        return [run_in_batches(llm, prompts, params, [batch]) for batch in batches], runner
    finally:
        llm.shutdown()


def random_sub_batches(num: int, seed: int, max_size: int = 16) -> list[list[int]]:
    rng = random.Random(seed)
    order = list(range(num))
    rng.shuffle(order)
    batches = []
    while order:
        size = rng.randint(1, max_size)
        batches.append(order[:size])
        order = order[size:]
    return batches


def record_steps(llm) -> list[list]:
    """Spy on the engine's executor: one list of ScheduledSeqs (all ranks) per step run."""
    steps: list[list] = []
    execute = llm.engine.executor.execute

    def spy(per_rank):
        steps.append([item for step in per_rank for item in step.scheduled])
        return execute(per_rank)

    llm.engine.executor.execute = spy
    return steps


def interrupt_at_call(engine, call: int) -> None:
    """Make the engine's executor raise KeyboardInterrupt after its `call`-th step (1-based),
    once the rank ran it: a Ctrl-C inside a step, which the driver records none of."""
    execute, num_calls = engine.executor.execute, [0]

    def interrupted(per_rank):
        outputs = execute(per_rank)
        num_calls[0] += 1
        if num_calls[0] == call:
            raise KeyboardInterrupt
        return outputs

    engine.executor.execute = interrupted


def in_fresh_processes(setup: str, expression: str) -> list:
    """`expression`'s value (JSON) after `setup` in one fresh Python process per HASH_SEEDS
    entry: what a restarted job would compute, with Python's str hash salted otherwise."""
    code = "; ".join(filter(None, ["import json", setup, f"print(json.dumps({expression}))"]))
    values = []
    for hash_seed in HASH_SEEDS:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": str(hash_seed)}
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-2000:]
        values.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return values


def replica_rows(stats: list[dict], num_experts: int, num_slots: int) -> int:
    """Rows the redundant replicas served, summed over ranks and layers: worker_stats'
    slot_load of the slots num_experts.. (a rank holds num_slots; slots past the logical
    experts hold the replicas)."""
    return sum(
        layer[slot]
        for s in stats
        for layer in s["slot_load"]
        for slot in range(num_slots)
        if s["rank"] * num_slots + slot >= num_experts
    )
