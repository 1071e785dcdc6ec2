"""Batch-invariant RL rollouts as a Ray job: JSONL prompts in, one JSONL row per sample out.

    python launch/rollout.py --config X.yaml --input prompts.jsonl --output out.jsonl \
        [--set section.key=value ...] [--batch-size 64] [--base-seed 0] [--no-routed-experts]
    python launch/rollout.py --config X.yaml --input out.jsonl --output scores.jsonl --score

Rows and seeds: launch.rollout_io. Each sample is its own request with its own seed, so its row
(the engine's CompletionOutput: token ids, logprobs, routed experts, seed) is the same bits in
any batch. Batches are appended and fsynced: a rerun with the same --output resumes without
losing or duplicating rows, and is refused if what a row's bits depend on changed (the settings
record beside the output). Every row is checked as the engine would before anything runs; a bad
one stops the job (--on-bad-row skip: report it, run the others). `--score`: teacher-forced
logprobs (LLM.score) of rows' "token_ids".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # the checkout on the path, not launch/ (whose openai/ would shadow)
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from launch import cli  # noqa: E402
from launch.rollout_io import (  # noqa: E402
    RowError,
    Sample,
    append_rows,
    check_settings,
    lock_output,
    read_done,
    read_samples,
    record_settings,
)
from moe_runtime import LLM, RequestOutput, heap  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--input", required=True, type=Path, help="JSONL rows")
    parser.add_argument("--output", required=True, type=Path, help="JSONL rows (appended)")
    cli.add_override_argument(parser)
    parser.add_argument("--score", action="store_true", help="teacher-forced logprobs instead")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per written batch")
    parser.add_argument("--base-seed", type=int, default=0, help="seeds rows that give none")
    parser.add_argument("--n", type=int, default=1)
    cli.add_sampling_arguments(parser, max_tokens=64, temperature=1.0, logprobs=0)
    parser.add_argument("--no-routed-experts", action="store_true", help="routed_experts: null")
    parser.add_argument(
        "--on-bad-row",
        choices=("stop", "skip"),
        default="stop",
        help="stop: exit 2 before generating anything; skip: report the row and go on",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser.parse_args(argv)


# Set by Ray for the entrypoint of `ray job submit`, whose working dir is Ray's temporary copy.
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"

# Config keys left out of the settings record: they change no output bit in any mode.
UNRECORDED_KEYS = frozenset(
    {"server", "parallel.timeout_s", "parallel.max_restarts", "parallel.restart_window_s"}
)
# Left out too while the invariance contract holds (invariant kernels, no multiple reduction):
# where rows run, how they are batched, cached, chunked and placed changes none of their bits
# (README's config table). A key not named here is recorded, so a new one errs on refusing:
# cache.block_size is (the attention's KV splits are runs of cache blocks), and so is
# scheduler.max_model_len (it decides which rows run at all).
INVARIANT_FREE_KEYS = frozenset(
    {
        "cache.num_blocks",
        "cache.enable_prefix_caching",
        "cache.gpu_memory_utilization",
        "scheduler.max_num_seqs",
        "scheduler.max_num_batched_tokens",
        "scheduler.enable_chunked_prefill",
        "scheduler.overlap_decode",
        "eplb",
        "parallel.world_size",
        "parallel.tp_size",
        "parallel.backend",
        "parallel.ep_capacity_dispatch",
        "parallel.ep_backend",
        "kernels.cuda_graphs",
        "kernels.cuda_graph_batch_sizes",
        "kernels.side_stream_rows",
    }
)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.batch_size < 1:
        print("error: --batch-size must be >= 1", file=sys.stderr)
        return 2
    try:
        output = _output_path(args.output)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"rollout: writing to {output}", file=sys.stderr)
    try:
        lock = lock_output(output)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with lock:  # held while this run reads and appends to the output
        return _run(args, output)


def _run(args: argparse.Namespace, output: Path) -> int:
    defaults = {"n": args.n, **cli.sampling_args(args)}
    defaults["return_routed_experts"] = not args.no_routed_experts
    skip_bad = args.on_bad_row == "skip"
    try:
        rows = read_samples(args.input, defaults, args.base_seed, args.score, skip_bad)
        done = read_done(output)
        llm = LLM(args.config, **cli.parse_overrides(args.set))
    except (ValueError, OSError) as exc:  # RowError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    heap.freeze()  # no full collection of start-up's objects in the run (moe_runtime/heap.py)
    settings = _run_settings(llm, args, defaults, rows.sha256)
    try:
        if done:
            check_settings(output, settings)
        samples, bad_rows = _checked(llm, rows.samples, args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        llm.shutdown()
        return 2
    bad_rows = sorted(rows.bad_rows + bad_rows, key=lambda error: error.line_no)
    for error in bad_rows:
        print(f"skipped {error}", file=sys.stderr)
    if not done:  # before the first row, so a resume of this output can check its settings
        record_settings(output, settings)
    todo = [s for s in samples if s.key not in done]
    started = time.perf_counter()
    progress = tqdm(
        total=len(samples),
        initial=len(samples) - len(todo),
        unit="sample",
        file=sys.stderr,
        disable=args.no_progress,
        desc="score" if args.score else "rollout",
    )
    run = _score_batch if args.score else _rollout_batch
    for first in range(0, len(todo), args.batch_size):
        batch = todo[first : first + args.batch_size]
        append_rows(output, run(llm, batch, progress))
    progress.close()
    llm.shutdown()
    elapsed = time.perf_counter() - started
    print(
        f"rollout: wrote {len(todo)} rows ({len(samples) - len(todo)} already done, "
        f"{len(bad_rows)} bad input rows skipped) in {elapsed:.2f}s to {output}",
        file=sys.stderr,
    )
    return 0


def _run_settings(llm: LLM, args: argparse.Namespace, defaults: dict, input_sha256: str) -> dict:
    """What an output row's bits depend on, flat ("model.hidden_size": 64, ...), in the order a
    refused resume names them. `model.path`'s weights by their files' stamp (not hashed)."""
    config = llm.config
    contract = config.kernels.is_invariant and not config.parallel.allow_multiple_reduction
    unrecorded = UNRECORDED_KEYS | (INVARIANT_FREE_KEYS if contract else frozenset())
    settings = {"score": args.score, "input_sha256": input_sha256}
    if not args.score:  # scoring reads no sampling setting
        settings |= {"base_seed": args.base_seed, **defaults}
    for section, values in dataclasses.asdict(config).items():
        for key, value in values.items():
            if section not in unrecorded and f"{section}.{key}" not in unrecorded:
                settings[f"{section}.{key}"] = value
    if config.model.path:
        # The weights there as the engine stamped them before reading them (a trainer saving
        # its next step over them would mix two policies in one output), and the directory
        # however it is named.
        settings["model.path"] = str(Path(config.model.path).resolve())
        stamp = llm.engine.startup_weights.stamp
        settings["model.weights"] = {name: list(values) for name, values in stamp}
    return settings


def _output_path(output: Path) -> Path:
    """The absolute path rows go to; a relative one is refused under `ray job submit`."""
    if RAY_JOB_ENV in os.environ and not output.is_absolute():
        # Ray does not expose the submitter's directory, and a relative path would land in the
        # job's temporary working-dir copy, which Ray deletes.
        raise ValueError(
            f"--output {output} is relative: under `ray job submit` it would be written inside "
            "Ray's temporary copy of the working dir and lost; pass an absolute path "
            f"(e.g. --output $PWD/{output})"
        )
    return output.absolute()


def _checked(
    llm: LLM, samples: list[Sample], args: argparse.Namespace
) -> tuple[list[Sample], list[RowError]]:
    """The samples the engine accepts, their prompts as token ids, and an error per row it
    refuses (its samples left out), from the engine's own checks, so that no request fails
    once the job runs. --on-bad-row stop raises the first error instead."""
    good, bad_rows = [], {}
    for sample in samples:
        try:
            if sample.token_ids is None:
                prompt_ids = llm.engine.check_request(sample.prompt, sample.params)
            else:  # score mode: prompt and scored tokens as one sequence
                sequence = [*sample.prompt, *sample.token_ids]
                prompt_ids, _ = llm.engine.check_score_request(sequence, len(sample.prompt))
        except ValueError as exc:
            error = RowError(args.input, sample.line_no, exc)
            if args.on_bad_row == "stop":
                raise error from None
            bad_rows.setdefault(sample.line_no, error)
            continue
        good.append(dataclasses.replace(sample, prompt=prompt_ids))
    # A row runs all its samples or none.
    return [s for s in good if s.line_no not in bad_rows], list(bad_rows.values())


def _rollout_batch(llm: LLM, batch: list[Sample], progress: tqdm) -> list[dict]:
    """Generate the batch together (one request per sample); rows in batch order."""
    engine = llm.engine
    requests = engine.add_requests([s.prompt for s in batch], [s.params for s in batch])
    while engine.has_unfinished():
        progress.update(sum(delta.is_finished for delta in engine.step()))
    return [_rollout_row(s, engine.output(r)) for s, r in zip(batch, requests, strict=True)]


def _rollout_row(sample: Sample, output: RequestOutput) -> dict:
    (out,) = output.outputs
    routed = out.routed_experts
    return {
        "id": sample.row_id,
        "sample_idx": sample.sample_idx,
        "prompt_token_ids": output.prompt_token_ids,
        "token_ids": out.token_ids,
        "logprobs": out.logprobs,
        "top_logprobs": [{str(t): lp for t, lp in top.items()} for top in out.top_logprobs],
        "routed_experts": None if routed is None else np.asarray(routed).tolist(),
        "finish_reason": out.finish_reason,
        "seed": out.seed,
    }


def _score_batch(llm: LLM, batch: list[Sample], progress: tqdm) -> list[dict]:
    sequences = [list(s.prompt) + list(s.token_ids) for s in batch]
    logprobs = llm.score(sequences, [len(s.prompt) for s in batch])
    progress.update(len(batch))
    return [
        {
            "id": s.row_id,
            "sample_idx": s.sample_idx,
            "prompt_token_ids": list(s.prompt),
            "token_ids": list(s.token_ids),
            "logprobs": lps,
        }
        for s, lps in zip(batch, logprobs, strict=True)
    ]


if __name__ == "__main__":
    sys.exit(main())
