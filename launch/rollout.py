"""Batch-invariant RL rollouts as a Ray job: JSONL prompts in, one JSONL row per sample out.

    python launch/rollout.py --config X.yaml --input prompts.jsonl --output out.jsonl \
        [--set section.key=value ...] [--batch-size 64] [--base-seed 0]
        [--no-routed-experts | --prompt-routed-experts]
    python launch/rollout.py --config X.yaml --input out.jsonl --output scores.jsonl --score

Rows and seeds: launch.rollout_io. Each sample is its own request with its own seed, so its row
(the engine's CompletionOutput: token ids, logprobs, routed experts, seed) is the same bits in
any batch. Batches are appended and fsynced: a rerun with the same --output resumes without
losing or duplicating rows, and is refused if what a row's bits depend on changed (the settings
record beside the output: launch.rollout_settings). Every row is checked as the engine would
before anything runs; a bad one stops the job (--on-bad-row skip: report it, run the others;
exit 1 if every row is bad), and a bad run-wide flag stops it before any row is read. SIGINT /
SIGTERM end it at the next engine step, after the batches written so far (exit 130 / 143); a
rerun resumes. A rank that dies or stalls has the workers rebuilt and its batch run again
(parallel.max_restarts; then exit 1). `--score`: teacher-forced logprobs (LLM.score) of rows'
"token_ids", and their routed experts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

if __name__ == "__main__":  # the checkout on the path, not launch/ (whose openai/ would shadow)
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from tqdm import tqdm  # noqa: E402

from launch import cli  # noqa: E402
from launch.rollout_batches import rollout_batch, score_batch  # noqa: E402
from launch.rollout_io import (  # noqa: E402
    MAX_N_KEY,
    STOP_SIGNALS,
    Appender,
    InputRows,
    OutputRows,
    RowError,
    Sample,
    Stopped,
    cut_torn_line,
    lock_output,
    read_done,
    read_samples,
)
from launch.rollout_settings import (  # noqa: E402
    check_settings,
    record_settings,
    run_settings,
    score_differences,
)
from moe_runtime import LLM, heap  # noqa: E402
from moe_runtime.config import load_config  # noqa: E402
from moe_runtime.engine.weights_source import WeightsChangedError  # noqa: E402
from moe_runtime.executor import WorkerError  # noqa: E402
from moe_runtime.seeds import MAX_SEED, SEED_BITS  # noqa: E402


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
    parser.add_argument(
        "--no-routed-experts",
        action="store_true",
        help="routed_experts: null (--score: no routed_experts)",
    )
    parser.add_argument(
        "--prompt-routed-experts",
        action="store_true",
        help="prompt_routed_experts: the prompt's routed experts too (for routing replay)",
    )
    parser.add_argument(
        "--on-bad-row",
        choices=("stop", "skip"),
        default="stop",
        help="stop: exit 2 before generating anything; skip: report the row and go on "
        "(exit 1 if every row is bad)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser.parse_args(argv)


# Set by Ray for the entrypoint of `ray job submit`, whose working dir is Ray's temporary copy.
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
# The progress bar's redraws into a log (stderr not a terminal: a Ray job's, a redirect), where
# each is a line (Ray reads a job's log a line at a time, '\r' ending one), at most this often.
LOG_REDRAW_S = 30.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        _check_flags(args)
        output = _output_path(args.output, args.input)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"rollout: writing to {output}", file=sys.stderr)
    try:
        lock = lock_output(output)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    appender = Appender(output)
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        with lock:  # held while this run reads and appends to the output
            _stop_on_signals(appender)
            return _run(args, appender)
    except Stopped as stop:
        print(
            f"rollout: stopped by {stop.signum.name} after writing {appender.num_written} rows "
            f"to {output} this run; rerun the same command to resume",
            file=sys.stderr,
        )
        return 128 + stop.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class WriteError(Exception):
    """Appending a batch to the output failed (its OSError is the cause)."""


class RanksFailed(Exception):
    """A rank died or stalled and no rebuild is left (parallel.max_restarts spent, or the
    weights' source changed): the message says why."""


def _stop_on_signals(appender: Appender) -> None:
    """Turn SIGINT and SIGTERM into Stopped. Set again once the engine has started: ray.init
    replaces the SIGTERM handler with its own, which exits with no word of the output."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, appender.on_signal)


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse a run-wide flag no row could run with, naming it and its value, before anything
    is read: left to the rows, it would be blamed on each of them (and each skipped)."""
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be an int >= 1, got {args.batch_size}")
    if not 0 <= args.base_seed <= MAX_SEED:
        raise ValueError(
            f"--base-seed must be an int in [0, 2**{SEED_BITS} - 1], got {args.base_seed}"
        )
    cli.check_sampling_flags({"n": args.n, **cli.sampling_args(args)})
    if args.prompt_routed_experts and args.no_routed_experts:
        raise ValueError("--prompt-routed-experts asks for routed experts: drop one of the two")


def _check_model_flags(llm: LLM, args: argparse.Namespace) -> None:
    """The flags whose bounds come from the model: as `_check_flags`, once it is loaded
    (with --score, --logprobs alone: scoring reads no other sampling flag)."""
    vocab_size = llm.config.model.vocab_size
    max_model_len = llm.config.scheduler.max_model_len
    if args.logprobs > vocab_size:
        raise ValueError(
            f"--logprobs {args.logprobs} asks for more top logprobs than the vocabulary's "
            f"{vocab_size} tokens"
        )
    max_logprobs = llm.config.server.max_logprobs
    if args.logprobs > max_logprobs:
        raise ValueError(
            f"--logprobs {args.logprobs} is more than server.max_logprobs={max_logprobs}"
        )
    if not args.score and args.max_tokens >= max_model_len:  # a prompt has one token at least
        raise ValueError(
            f"--max-tokens {args.max_tokens} leaves no room for a prompt in "
            f"scheduler.max_model_len={max_model_len}"
        )


def _run(args: argparse.Namespace, appender: Appender) -> int:
    defaults = {"n": args.n, **cli.sampling_args(args)}
    defaults["return_routed_experts"] = not args.no_routed_experts
    try:
        rows, existing, llm = _load(args, appender, defaults)
    except ConnectionError as exc:  # no Ray cluster answers: not the command's fault (an OSError)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:  # RowError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:  # a rank died or stalled while the ranks loaded
        print(f"error: the model failed to load: {exc}", file=sys.stderr)
        return 1
    try:
        return _run_loaded(llm, args, appender, defaults, rows, existing)
    finally:
        llm.shutdown()


def _load(
    args: argparse.Namespace, appender: Appender, defaults: dict
) -> tuple[InputRows, OutputRows, LLM]:
    """The input's rows, what the output already holds, and the loaded model: everything a
    refusal (exit 2) may come from before a row is written."""
    config = load_config(args.config, cli.parse_overrides(args.set))
    max_n = config.server.max_sequences_per_request
    if args.n > max_n:
        raise ValueError(f"--n {args.n} is more samples than {MAX_N_KEY}={max_n} allows a row")
    skip_bad = args.on_bad_row == "skip"
    print(f"rollout: reading {args.input}", file=sys.stderr)  # (a large file takes a while)
    try:
        rows = read_samples(args.input, defaults, args.base_seed, args.score, skip_bad, max_n)
    except OSError as exc:  # named by its flag ("[Errno 2] ..." named neither)
        raise ValueError(f"--input {str(args.input)!r}: {exc.strerror}") from None
    existing = read_done(appender.output)  # reads only: the file may not be this tool's
    if config.parallel.world_size > 1:
        # ray.init sets a SIGTERM handler of its own (sys.exit) as it starts: joined before
        # the load and ours put back, so a SIGTERM during the load ends the run as one after
        # it does (one while Ray itself is joined still ends it with Ray's exit code 15).
        cli.connect_ray(config)
        _stop_on_signals(appender)
    print(f"rollout: loading the model on {config.parallel.world_size} rank(s)", file=sys.stderr)
    return rows, existing, LLM(config)


def _run_loaded(
    llm: LLM,
    args: argparse.Namespace,
    appender: Appender,
    defaults: dict,
    rows: InputRows,
    existing: OutputRows,
) -> int:
    """The run once the model is loaded: checks that need it, the settings record, then the
    rows not yet done, in batches. The exit code."""
    output = appender.output
    _stop_on_signals(appender)
    appender.check()  # a stop signal during the load ends the run here
    heap.freeze()  # no full collection of start-up's objects in the run (moe_runtime/heap.py)
    settings = run_settings(llm, args, defaults, rows.sha256)
    try:
        _check_model_flags(llm, args)
        if existing.num_bytes:
            # Only an output this tool wrote with these settings is appended to or cut.
            check_settings(output, settings)
        samples, bad_rows = _checked(llm, rows.samples, args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.score:
        _warn_of_score_differences(args.input, settings)
    bad_rows = sorted(rows.bad_rows + bad_rows, key=lambda error: error.line_no)
    for error in bad_rows:
        print(f"skipped {error}", file=sys.stderr)
    if bad_rows and not samples:  # a job that can write no row failed, though skip let it run
        print(
            f"error: every row of {args.input} is bad ({len(bad_rows)} skipped): no row to run",
            file=sys.stderr,
        )
        return 1
    try:
        if existing.num_bytes:
            cut_torn_line(output, existing)
        else:  # before the first row, so a resume of this output can check its settings
            record_settings(output, settings)
    except OSError as exc:
        print(f"error: cannot write {output} or its settings record: {exc}", file=sys.stderr)
        return 2
    todo = [s for s in samples if s.key not in existing.done]
    started = time.perf_counter()
    try:
        _write(llm, args, appender, samples, todo)
    except (WriteError, RanksFailed) as exc:  # a full disk; ranks lost: what was written stays
        why = f"cannot append to {output}: {exc.__cause__}" if isinstance(exc, WriteError) else exc
        print(
            f"error: {why}; the {appender.num_written} rows written this run are kept: rerun "
            "the same command to resume",
            file=sys.stderr,
        )
        return 1
    elapsed = time.perf_counter() - started
    for why in appender.left_out:
        print(f"error: {why}", file=sys.stderr)
    print(
        f"rollout: wrote {appender.num_written} rows ({len(samples) - len(todo)} already done, "
        f"{len(bad_rows)} bad input rows skipped, {len(appender.left_out)} not written) in "
        f"{elapsed:.2f}s to {output}",
        file=sys.stderr,
    )
    return 1 if appender.left_out else 0


def _warn_of_score_differences(input_path: Path, settings: dict) -> None:
    """Say so where a --score run's settings differ from those of the rollout that wrote its
    input: its logprobs are then not that rollout's bits (scoring against a reference model
    is a run of its own, so a warning, not a refusal)."""
    differences = score_differences(input_path, settings)
    if differences:
        shown = "; ".join(differences[:5]) + ("; ..." if len(differences) > 5 else "")
        print(
            f"warning: {input_path} was generated with other settings than this --score run "
            f"has ({shown}): its logprobs will not be bitwise the rollout's",
            file=sys.stderr,
        )


def _write(
    llm: LLM,
    args: argparse.Namespace,
    appender: Appender,
    samples: list[Sample],
    todo: list[Sample],
) -> None:
    """Run `todo` in batches of --batch-size, appending each batch's rows as it finishes."""
    # A terminal keeps tqdm's own pace (a redraw at most every 0.1 s).
    log_pace = {"mininterval": LOG_REDRAW_S, "maxinterval": LOG_REDRAW_S}
    redraw_s = {} if sys.stderr.isatty() else log_pace
    progress = tqdm(
        total=len(samples),
        initial=len(samples) - len(todo),
        unit="sample",
        file=sys.stderr,
        disable=args.no_progress,
        desc="score" if args.score else "rollout",
        **redraw_s,
    )
    run = partial(
        score_batch if args.score else rollout_batch,
        stop=appender.check,
        prompt_routed=args.prompt_routed_experts,
    )
    if args.score:
        run = partial(run, num_top=args.logprobs, routed=not args.no_routed_experts)
    try:
        for first in range(0, len(todo), args.batch_size):
            batch = todo[first : first + args.batch_size]
            rows = _run_rebuilding(run, llm, batch, progress)
            try:
                appender.append(rows)
            except OSError as exc:
                raise WriteError from exc
    finally:
        progress.close()  # the bar's line ended before anything else is printed


def _run_rebuilding(run: Callable, llm: LLM, batch: list[Sample], progress: tqdm) -> list[dict]:
    """run(llm, batch, progress), run again on rebuilt workers after a rank died or stalled (a
    WorkerError), as a server rebuilds them: none of the batch's rows was written, and each
    sample's own seed makes the rerun's rows the same bits. RanksFailed once
    parallel.max_restarts rebuilds fell within parallel.restart_window_s, or the batch (or a
    rebuild) failed more than max_restarts times in a row (a rank that fails on the batch's own
    inputs would fail it forever), or the weights' source changed."""
    engine, num_done, num_failed = llm.engine, progress.n, 0
    while True:
        try:
            if engine.error is not None:  # the last try, or the rebuild after it, failed
                engine.restart()
            return run(llm, batch, progress)
        except WeightsChangedError as exc:  # a rebuild would serve other weights
            raise RanksFailed(str(exc)) from exc
        except WorkerError as exc:
            num_failed += 1
            max_restarts = engine.config.parallel.max_restarts
            refusal = engine.restart_refusal()
            if refusal is None and num_failed > max_restarts:
                refusal = f"gave up after {num_failed} failures in a row of one batch: {exc}"
            if refusal is not None:
                raise RanksFailed(str(refusal)) from exc
            print(
                f"rollout: {exc}; rebuilding the workers (restart {engine.num_restarts + 1}) and "
                "running the batch again",
                file=sys.stderr,
            )
        progress.n = num_done  # the failed try's finished samples are run again
        progress.refresh()


def _output_path(output: Path, input_path: Path) -> Path:
    """The real path rows go to (links resolved: the lock and the settings record are named
    after it, so every spelling of one file shares them). Refused: a relative one under `ray
    job submit`, one in no directory, and the input file itself."""
    if RAY_JOB_ENV in os.environ and not output.is_absolute():
        # Ray does not expose the submitter's directory, and a relative path would land in the
        # job's temporary working-dir copy, which Ray deletes.
        raise ValueError(
            f"--output {output} is relative: under `ray job submit` it would be written inside "
            "Ray's temporary copy of the working dir and lost; pass an absolute path "
            f"(e.g. --output $PWD/{output})"
        )
    path = output.resolve()
    if not path.parent.is_dir():
        raise ValueError(f"--output {output}: its directory {path.parent} does not exist")
    if path.is_dir():
        raise ValueError(f"--output {output} is a directory; name a file")
    if path.exists() and not path.is_file():
        # /dev/null cannot be fsynced (after the whole batch ran), /dev/zero or a pipe is read
        # without end by the resume check: rows go to a file, read back on a resume.
        raise ValueError(
            f"--output {output} is not a regular file (a device or a pipe); name a file"
        )
    if path.exists() and input_path.exists() and os.path.samefile(path, input_path):
        raise ValueError(
            f"--output {output} is the same file as --input {input_path}: rows would be "
            "appended to the prompts; write to another --output"
        )
    return path


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


if __name__ == "__main__":
    cli.configure_logging()  # here, not in main(): a caller of main() keeps its logging
    sys.exit(main())
