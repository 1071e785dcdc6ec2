"""JSONL in and out for the rollout job: input rows to samples, and resuming a partial output.

Input rows: {"id", "prompt" (text or token ids), "n", "seed" | "seeds", "max_tokens",
"temperature", "top_p", "top_k", "logprobs", "stop", "stop_token_ids", "ignore_eos",
"min_tokens", "include_stop_str_in_output"}; missing fields take the CLI defaults (the last
five: SamplingParams' own). A row becomes one `Sample` per sample, each with its own seed
(`sample_seeds` of the row's seed, which is derive_seed(base seed, row index) when the row
gives none), so a sample can run in any batch, in any run, and be resumed alone. Bad rows
raise `RowError` naming the line (or are returned, to be skipped); an (id, sample_idx) given
twice refuses the whole file. The output file is only appended to; `read_done` returns the
(id, sample_idx) pairs already written and where a torn last line starts, which
`cut_torn_line` cuts only once the output is known to be this job's. Beside it,
`<output>.settings.json` records what a row's bits depend on, so a resume with other
settings (or of a file this tool did not write) is refused instead of mixing two runs in one
file, and `lock_output` keeps a second run off an output while one writes it. `Appender`
appends a run's batches, and turns SIGINT / SIGTERM into `Stopped` between them.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any

from launch import strict_json
from launch.cli import SAMPLING_FLAGS
from moe_runtime.config_fields import is_int
from moe_runtime.sampling_params import SamplingParams
from moe_runtime.seeds import MAX_SEED, SEED_BITS, derive_seed, sample_seeds

# A row's sampling fields, each defaulting to its CLI flag: the flags' own list, so the two agree.
PARAM_FIELDS = SAMPLING_FLAGS
# A row's own ends, with no CLI default: what ends its samples besides max_tokens.
STOP_FIELDS = ("stop", "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output")
ROLLOUT_FIELDS = {"id", "prompt", "n", "seed", "seeds", *PARAM_FIELDS, *STOP_FIELDS}
SCORE_FIELDS = {"id", "sample_idx", "prompt_token_ids", "token_ids"}
# Ctrl-C and `ray job stop` (or a scheduler's kill): the run ends saying what it wrote.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How every output row opens (append_rows: id and sample_idx first, no spaces).
ROW_START, ROW_SAMPLE_IDX = '{"id":', ',"sample_idx":'
# The bound on a row's n (and --n): a row is held to what one completion request may ask.
MAX_N_KEY = "server.max_sequences_per_request"
MAX_LOGPROBS_KEY = "server.max_logprobs"


class RowError(ValueError):
    """A bad input row; the message starts with `<file>:<line>:`."""

    def __init__(self, path: Path, line_no: int, problem: object) -> None:
        self.line_no = line_no
        super().__init__(f"{path}:{line_no}: {problem}")


@dataclass(frozen=True)
class Sample:
    """One output row to produce."""

    row_id: Any
    sample_idx: int
    prompt: str | list[int]
    params: SamplingParams | None  # None in score mode
    line_no: int
    token_ids: list[int] | None = None  # score mode: the tokens to score after the prompt

    @property
    def key(self) -> tuple[str, int]:
        return done_key(self.row_id, self.sample_idx)


def done_key(row_id: Any, sample_idx: int) -> tuple[str, int]:
    """Hashable key of an output row; ids keep their JSON type (1 and "1" differ)."""
    return json.dumps(row_id), sample_idx


@dataclass(frozen=True)
class InputRows:
    samples: list[Sample]  # the good rows' samples, in file order
    bad_rows: list[RowError]  # rows left out (skip_bad only), in file order
    sha256: str  # of the non-blank lines, stripped: the rows that define the job's output


def read_samples(
    path: Path,
    defaults: dict[str, Any],
    base_seed: int,
    score: bool,
    skip_bad: bool = False,
    max_n: int | None = None,
) -> InputRows:
    """The input file's samples. A bad row raises RowError, or with `skip_bad` is returned in
    `bad_rows` and its samples left out (the rows after it keep their index, so their derived
    seeds). An (id, sample_idx) of two rows raises RowError either way: output rows are keyed
    by it, so the file does not say which row is meant. `defaults`: the value of each of
    PARAM_FIELDS and "n" for rows without it, and "return_routed_experts" for every row. max_n:
    the most samples a row may ask for (its samples are built at once: an n of 10**9 filled the
    memory before anything was said)."""
    samples: list[Sample] = []
    bad_rows: list[RowError] = []
    first_line: dict[tuple[str, int], int] = {}
    parse = _score_samples if score else partial(_rollout_samples, max_n=max_n)
    digest = hashlib.sha256()  # of the non-empty lines joined by "\n", fed a line at a time
    lines = ((line_no, line) for line_no, line in _input_lines(path) if line)
    for row_idx, (line_no, line) in enumerate(lines):
        digest.update((b"\n" if row_idx else b"") + line.encode("utf-8", "surrogateescape"))
        row, error = _json_row(line)
        if row is not None:
            # Before the row's own checks: a bad row with a good id takes its id too, so a
            # skipped row and a good one of that id are a repeated id, not a silent choice.
            _claim_key(first_line, row, score, path, line_no)
            try:
                row_samples = parse(row, line_no, defaults, derive_seed(base_seed, row_idx))
            except (ValueError, TypeError) as exc:
                error = exc
        if error is not None:
            if not skip_bad:
                raise RowError(path, line_no, error) from None
            bad_rows.append(RowError(path, line_no, error))
            continue
        samples.extend(row_samples)
    return InputRows(samples, bad_rows, digest.hexdigest())


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads' object_pairs_hook refusing an object with a key twice, naming it: json keeps
    the last value without a word, so a row {"prompt": "a", "prompt": "b"} ran "b" (the config
    loader refuses YAML's repeated keys the same way)."""
    value: dict[str, Any] = {}
    for key, item in pairs:
        if key in value:
            raise ValueError(f"key {key!r} appears twice in one JSON object")
        value[key] = item
    return value


def _json_row(line: str) -> tuple[dict | None, ValueError | None]:
    """The line as a JSON object, or None and why it is not one."""
    try:
        row = json.loads(_checked_utf8(line), object_pairs_hook=_unique_keys)
    except ValueError as exc:
        return None, exc
    except RecursionError:  # json's decoder recurses once per level of [ or {
        return None, ValueError("JSON nested too deeply to read")
    if not isinstance(row, dict):
        return None, ValueError("a row must be a JSON object")
    return row, None


def _claim_key(
    first_line: dict[tuple[str, int], int], row: dict, score: bool, path: Path, line_no: int
) -> None:
    """Record the output key the row claims (a rollout row's first sample is (id, 0), as any
    other's), if its id (and, scoring, its sample_idx) can key one; RowError if an earlier
    line claimed it."""
    row_id, sample_idx = row.get("id"), row.get("sample_idx", 0) if score else 0
    if not isinstance(row_id, str | int) or isinstance(row_id, bool):
        return
    if not is_int(sample_idx) or sample_idx < 0:
        return
    key = done_key(row_id, sample_idx)
    if key in first_line:
        what = f"id {row_id!r}" + (f" sample_idx {sample_idx}" if score else "")
        raise RowError(path, line_no, f"{what} appears twice (first on line {first_line[key]})")
    first_line[key] = line_no


def _input_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, stripped text) of each line, split as text mode splits (\\n, \\r\\n, \\r).
    Each line is decoded alone, a byte that is not UTF-8 kept as a lone surrogate
    (surrogateescape) for `_checked_utf8` to report as that line's error, so one bad line is a
    bad row like any other; a UTF-8 BOM opening the file is dropped."""
    with open(path, "rb") as f:
        pieces = (piece for raw in f for piece in raw.splitlines())
        for line_no, piece in enumerate(pieces, start=1):
            encoding = "utf-8-sig" if line_no == 1 else "utf-8"
            yield line_no, piece.decode(encoding, "surrogateescape").strip()


def _checked_utf8(line: str) -> str:
    """The line, or ValueError naming its first byte that is not UTF-8 (see _input_lines)."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as exc:
        byte = line[exc.start].encode("utf-8", "surrogateescape")
        raise ValueError(f"not UTF-8 text (byte 0x{byte.hex()})") from None
    return line


def _rollout_samples(
    row: dict, line_no: int, defaults: dict, row_seed: int, max_n: int | None = None
) -> list[Sample]:
    _check_fields(row, ROLLOUT_FIELDS, ("id", "prompt"))
    prompt = row["prompt"]
    is_ids = isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not is_ids:
        raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
    seeds = row.get("seeds")
    n = row.get("n", len(seeds) if isinstance(seeds, list) else defaults["n"])
    if not is_int(n) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if max_n is not None and n > max_n:
        raise ValueError(f"n={n} is more samples than {MAX_N_KEY}={max_n} allows a row")
    if seeds is not None and "seed" in row:
        raise ValueError("give seed or seeds, not both")
    if seeds is not None and (not isinstance(seeds, list) or len(seeds) != n):
        raise ValueError(f"seeds must be a list of n={n} ints")
    request_seed = row.get("seed", row_seed)
    for seed in seeds or [request_seed]:
        if not is_int(seed) or not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed must be an int in [0, 2**{SEED_BITS} - 1], got {seed!r}")
    knobs = {k: row.get(k, defaults[k]) for k in PARAM_FIELDS}
    knobs.update((k, row[k]) for k in STOP_FIELDS if k in row)
    knobs["return_routed_experts"] = defaults["return_routed_experts"]
    samples = []
    for i, seed in enumerate(seeds or sample_seeds(request_seed, n)):
        try:
            params = SamplingParams(seed=seed, **knobs)
        except (ValueError, TypeError) as exc:
            raise ValueError(str(exc).removeprefix("SamplingParams.")) from None
        samples.append(Sample(row["id"], i, prompt, params, line_no))
    return samples


def _score_samples(row: dict, line_no: int, defaults: dict, row_seed: int) -> list[Sample]:
    _check_fields(row, SCORE_FIELDS, ("id", "prompt_token_ids", "token_ids"), extra_ok=True)
    prompt, tokens = row["prompt_token_ids"], row["token_ids"]
    for name, ids in (("prompt_token_ids", prompt), ("token_ids", tokens)):
        if not isinstance(ids, list) or not ids or not all(is_int(t) for t in ids):
            raise ValueError(f"{name} must be a non-empty list of token ids")
    sample_idx = row.get("sample_idx", 0)
    if not is_int(sample_idx) or sample_idx < 0:
        raise ValueError(f"sample_idx must be an int >= 0, got {sample_idx!r}")
    return [Sample(row["id"], sample_idx, prompt, None, line_no, tokens)]


def _check_fields(row: dict, allowed: set, required: tuple, extra_ok: bool = False) -> None:
    missing = [k for k in required if k not in row]
    if missing:
        raise ValueError(f"missing field {missing[0]!r}")
    unknown = sorted(set(row) - allowed)
    if unknown and not extra_ok:
        raise ValueError(f"unknown field {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")
    if not isinstance(row["id"], str | int) or isinstance(row["id"], bool):
        raise ValueError(f"id must be a string or an int, got {row['id']!r}")


def lock_output(output: Path) -> IO[str]:
    """Hold `<output>.lock` exclusively for as long as the returned file stays open (the OS
    lets go when the process ends, killed or not), or raise ValueError naming the run that holds
    it: two runs on one output would each cut the other's torn line and write the same rows."""
    path = output.with_name(output.name + ".lock")
    lock = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise ValueError(
            f"another rollout (pid {holder}) is writing {output}: wait for it to end, or "
            "write to another --output"
        ) from None
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


@dataclass(frozen=True)
class OutputRows:
    """What an output file holds, read without changing it."""

    done: set[tuple[str, int]]  # the (id, sample_idx) keys of its complete rows
    num_bytes: int  # its size; 0 when there is no file
    num_whole_bytes: int  # up to the end of its last complete line: past it, a torn line


def read_done(path: Path) -> OutputRows:
    """The rows already in the output file and where its torn last line (a run killed
    mid-write) starts. Streams the file a line at a time (a row's routed experts make it large).
    A bad complete line is an error: the file was not this job's output."""
    if not path.exists():
        return OutputRows(set(), 0, 0)
    done: set[tuple[str, int]] = set()
    num_whole_bytes = 0
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                break  # the last line, unfinished
            try:
                done.add(_row_key(line))
            except (ValueError, KeyError, TypeError) as exc:
                raise RowError(path, line_no, f"not a row of this job's output ({exc})") from None
            num_whole_bytes += len(line)
    return OutputRows(done, path.stat().st_size, num_whole_bytes)


def _row_key(line: bytes) -> tuple[str, int]:
    """done_key of an output line. append_rows writes `{"id":..,"sample_idx":..,` first, so
    those two values are decoded alone and the rest (a row's bulk: tokens, logprobs, routed
    experts) is not built; a line laid out otherwise is decoded whole."""
    text = line.decode("utf-8")
    decoder = json.JSONDecoder()
    if text.startswith(ROW_START) and text.endswith("}\n"):
        try:
            row_id, end = decoder.raw_decode(text, len(ROW_START))
            if text.startswith(ROW_SAMPLE_IDX, end):
                sample_idx, end = decoder.raw_decode(text, end + len(ROW_SAMPLE_IDX))
                if is_int(sample_idx) and text[end] in ",}":
                    return done_key(row_id, sample_idx)
        except ValueError:
            pass  # not laid out as append_rows writes it: decoded whole below
    row = json.loads(text)
    return done_key(row["id"], row["sample_idx"])


def cut_torn_line(path: Path, rows: OutputRows) -> None:
    """Cut the torn last line `read_done` found (call it only on this job's own output, under
    its lock, so the file is as read)."""
    if rows.num_whole_bytes < rows.num_bytes:
        with open(path, "r+b") as f:
            f.truncate(rows.num_whole_bytes)
            os.fsync(f.fileno())


def append_rows(path: Path, rows: list[dict]) -> list[str]:
    """Append rows as strict JSON lines (launch.strict_json: a -inf logprob as -9999.0) in one
    write, then flush and fsync: a batch is on disk. Rows open with their id and sample_idx
    (_row_key reads them alone on a resume). -> why each row left out was: one whose sample
    ended with finish_reason "error" (its logits were not finite: the row's `error` says where)
    or one holding a NaN logprob (no JSON form); the others are written."""
    lines, left_out = [], []
    for row in rows:
        named = f"row {row['id']!r} sample {row['sample_idx']} not written"
        if row.get("finish_reason") == "error":
            left_out.append(f"{named}: {row['error']}")
            continue
        try:
            lines.append(strict_json.dumps(row, separators=(",", ":")) + "\n")
        except strict_json.NonFiniteError as exc:
            left_out.append(f"{named}: {exc}")
    text = "".join(lines)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return left_out


class Stopped(BaseException):
    """Raised by SIGINT or SIGTERM. A BaseException, as KeyboardInterrupt is, so that no
    `except Exception` on the way (the engine's) takes it for an error of its own."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signal.Signals(signum)


class Appender:
    """Appends batches of rows to the output and counts them. SIGINT and SIGTERM (its
    `on_signal`) are recorded and raise Stopped at the next `check` (between two engine steps,
    after an append): never from inside a step, where Ray's waits would turn it into a
    SystemError, nor mid-append, so a batch is on disk whole and counted or not written at
    all. A second signal raises at once (the run is stuck, or the user insists)."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.num_written = 0  # rows this run appended, all fsynced
        self.left_out: list[str] = []  # why each row this run could not write was (append_rows)
        self.is_appending = False
        self.pending_signum: int | None = None

    def append(self, rows: list[dict]) -> None:
        self.is_appending = True
        try:
            left_out = append_rows(self.output, rows)
            self.num_written += len(rows) - len(left_out)
            self.left_out += left_out
        finally:
            self.is_appending = False
        self.check()

    def check(self) -> None:
        """Raise Stopped if a stop signal came."""
        if self.pending_signum is not None:
            raise Stopped(self.pending_signum)

    def on_signal(self, signum: int, frame: object) -> None:
        # A flag, not a blocked signal: the signal may reach any of the process's threads.
        if self.pending_signum is not None and not self.is_appending:
            raise Stopped(signum)
        self.pending_signum = signum
