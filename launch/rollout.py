"""Batch-invariant RL rollouts as a Ray job: JSONL prompts in, one JSONL row per sample out.

    python launch/rollout.py --config X.yaml --input prompts.jsonl --output out.jsonl \
        [--set section.key=value ...] [--batch-size 64] [--base-seed 0] [--no-routed-experts]
    python launch/rollout.py --config X.yaml --input out.jsonl --output scores.jsonl --score

Rows and seeds: launch.rollout_io. Each sample is its own request with its own seed, so its row
(the engine's CompletionOutput: token ids, logprobs, routed experts, seed) is the same bits in
any batch. Batches are appended and fsynced: a rerun with the same --output resumes without
losing or duplicating rows. A bad row stops the job before anything runs (--on-bad-row skip:
report it, go on). `--score`: teacher-forced logprobs (LLM.score) of rows' "token_ids".
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
from launch.rollout_io import RowError, Sample, append_rows, read_done, read_samples  # noqa: E402
from moe_runtime import LLM, RequestOutput  # noqa: E402


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
    defaults = {"n": args.n, **cli.sampling_args(args)}
    defaults["return_routed_experts"] = not args.no_routed_experts
    try:
        samples = read_samples(args.input, defaults, args.base_seed, args.score)
        done = read_done(output)
        llm = LLM(args.config, **cli.parse_overrides(args.set))
    except (RowError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        samples = _checked(llm, samples, args)
    except RowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        llm.shutdown()
        return 2
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
        f"rollout: wrote {len(todo)} rows ({len(samples) - len(todo)} already done) "
        f"in {elapsed:.2f}s to {output}",
        file=sys.stderr,
    )
    return 0


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


def _checked(llm: LLM, samples: list[Sample], args: argparse.Namespace) -> list[Sample]:
    """Samples whose prompts the engine accepts, as token ids; a bad one raises (or is skipped
    and reported)."""
    good, bad_lines = [], set()
    for sample in samples:
        try:
            prompt_ids = llm.engine.encode(sample.prompt)
            if sample.token_ids is not None:  # score mode: the whole sequence must fit
                llm.engine.validate_prompt(prompt_ids + sample.token_ids)
        except ValueError as exc:
            message = f"{args.input}:{sample.line_no}: {exc}"
            if args.on_bad_row == "stop":
                raise RowError(message) from None
            if sample.line_no not in bad_lines:
                print(f"skipped {message}", file=sys.stderr)
            bad_lines.add(sample.line_no)
            continue
        good.append(dataclasses.replace(sample, prompt=prompt_ids))
    return good


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
