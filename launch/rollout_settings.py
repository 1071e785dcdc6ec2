"""The settings record beside a rollout output: what its rows' bits depend on.

`run_settings` lists them flat ("model.hidden_size": 64, ...): the input's digest, the code the
bits come from (`runtime_stamp`), each kind of device the ranks ran on, the sampling defaults
when generating, the resolved config less the keys that change no bit, and the weights' stamp
and tokenizer files' digests. `record_settings` writes them before
an output's first row; `check_settings` refuses a resume whose settings differ (or an output
with rows and no record), naming the first difference, instead of mixing two runs in one file.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

import torch

import moe_runtime
from moe_runtime import LLM
from moe_runtime.tokenizer import TOKENIZER_FILES

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


# The packages whose code a row's bits come from (launch/ only reads and writes rows).
RUNTIME_PACKAGES = ("moe_kernels", "comm", "eplb", "moe_runtime")


def runtime_stamp() -> dict[str, str | None]:
    """The code a row's bits come from: a SHA-256 of the runtime packages' sources and the
    versions of torch and triton. A resume under other code (an upgrade, an edited kernel) is
    refused: a change there may change the bits, and the rows do not say which code made
    them."""
    root = Path(moe_runtime.__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for package in RUNTIME_PACKAGES:
        for source in sorted((root / package).rglob("*.py")):
            digest.update(str(source.relative_to(root)).encode() + b"\0")
            digest.update(source.read_bytes())
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    return {
        "runtime.source_sha256": digest.hexdigest(),
        "runtime.torch": torch.__version__,
        "runtime.triton": triton,
    }


def run_settings(llm: LLM, args: argparse.Namespace, defaults: dict, input_sha256: str) -> dict:
    """What an output row's bits depend on, flat ("model.hidden_size": 64, ...), in the order a
    refused resume names them. `model.path`'s weights by their files' stamp (not hashed)."""
    config = llm.config
    contract = config.kernels.is_invariant and not config.parallel.allow_multiple_reduction
    unrecorded = UNRECORDED_KEYS | (INVARIANT_FREE_KEYS if contract else frozenset())
    settings = {"score": args.score, "input_sha256": input_sha256, **runtime_stamp()}
    settings["runtime.devices"] = llm.engine.device_identities()
    if not args.score:  # scoring reads no sampling setting but --logprobs
        settings |= {"base_seed": args.base_seed, **defaults}
    elif args.logprobs:  # (0, the rows without top logprobs, records nothing, as before it)
        settings["logprobs"] = args.logprobs
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
        # Text prompts' ids, so their rows' bits, come from these (hashed: a tokenizer is
        # small, and unlike the weights no engine stamp of them was taken).
        settings["model.tokenizer_files"] = _file_digests(Path(config.model.path), TOKENIZER_FILES)
    return settings


def _file_digests(directory: Path, names: tuple[str, ...]) -> dict[str, str]:
    """A SHA-256 of each of `names` present in `directory`."""
    return {
        name: hashlib.sha256((directory / name).read_bytes()).hexdigest()
        for name in names
        if (directory / name).is_file()
    }


def settings_path(output: Path) -> Path:
    return output.with_name(output.name + ".settings.json")


def check_settings(output: Path, settings: dict[str, Any]) -> None:
    """Refuse (ValueError) to append to an output whose rows were made with other settings,
    naming the first that differs with its recorded and its new value."""
    path = settings_path(output)
    if not path.exists():
        # Refused rather than accepted: rows do not record their settings, so a mix made now
        # could never be found later, while a refusal costs a rerun at most.
        raise ValueError(
            f"{output} is not empty but has no settings record {path} (not a rollout output, "
            "or written by a rollout.py that kept none, or the record was removed): it is left "
            "as it is, since whether this run's settings match its rows cannot be checked. "
            "Write to a new --output, or remove the old one to start over"
        )
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(recorded, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise ValueError(f"{path}: not a settings record ({exc})") from None
    new = _as_json(settings)
    for key in [*recorded, *(k for k in new if k not in recorded)]:
        if key not in recorded or key not in new or recorded[key] != new[key]:
            old_value, new_value = (_shown(values, key) for values in (recorded, new))
            raise ValueError(
                f"{output} was written with {key}={old_value}, this run has {key}={new_value}: "
                f"resuming would mix two runs' rows in one file. Rerun with the settings in "
                f"{path}, or write to a new --output"
            )


def score_differences(rollout_output: Path, settings: dict[str, Any]) -> list[str]:
    """The bit-relevant settings ("key=recorded -> new") in which a --score run differs from
    the rollout that wrote its input, as that rollout's record holds them; [] where it matches
    or the input has no record. The config and runtime keys only (the sampling defaults,
    seeds and the input's digest are the rollout's own), and not scheduler.max_model_len (it
    decides which rows run, not their bits)."""
    path = settings_path(rollout_output)
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(recorded, dict) or recorded.get("score") is not False:
        return []
    new = _as_json(settings)
    keys = [k for k in recorded if "." in k and k != "scheduler.max_model_len"]
    keys += [k for k in new if "." in k and k not in recorded and k != "scheduler.max_model_len"]
    return [
        f"{key}={_shown(recorded, key)} -> {_shown(new, key)}"
        for key in keys
        if recorded.get(key, ...) != new.get(key, ...)
    ]


def record_settings(output: Path, settings: dict[str, Any]) -> None:
    """Write the settings record of an output that has no rows yet (replacing any older one:
    with no rows there is nothing to mix), atomically and fsynced, before its first row."""
    path = settings_path(output)
    staging = path.with_name(path.name + ".tmp")
    with open(staging, "w", encoding="utf-8") as f:
        json.dump(_as_json(settings), f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, path)


def _as_json(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings as a record reads back: tuples as lists, other values as their str."""
    return json.loads(json.dumps(settings, default=str))


def _shown(values: dict[str, Any], key: str) -> str:
    return json.dumps(values[key]) if key in values else "(none)"
