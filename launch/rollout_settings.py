"""The settings record beside a rollout output: what its rows' bits depend on.

`run_settings` lists them flat ("model.hidden_size": 64, ...): the input's digest, the sampling
defaults when generating, and `bit_settings` (launch/fingerprint.py: the code, the devices, the
config keys that can change bits, the weights' stamp, the tokenizer). `record_settings` writes
them before an output's first row; `check_settings` refuses a resume whose settings differ (or
an output with rows and no record), naming the first difference, instead of mixing two runs in
one file.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from launch.fingerprint import as_json, bit_settings
from launch.rollout_io import MAX_LOGPROBS_KEY, MAX_N_KEY
from moe_runtime import LLM


def run_settings(llm: LLM, args: argparse.Namespace, defaults: dict, input_sha256: str) -> dict:
    """What an output row's bits depend on, flat ("model.hidden_size": 64, ...), in the order a
    refused resume names them: the run's own (the input, and the sampling defaults when
    generating), then `bit_settings`."""
    settings = {"score": args.score, "input_sha256": input_sha256}
    if not args.score:  # scoring reads no sampling setting but --logprobs
        settings |= {"base_seed": args.base_seed, **defaults}
        # They decide which rows run (a row's n or logprobs past one is a bad row), though no
        # row's bits.
        settings[MAX_N_KEY] = llm.config.server.max_sequences_per_request
        settings[MAX_LOGPROBS_KEY] = llm.config.server.max_logprobs
    else:
        if args.logprobs:  # (0, the rows without top logprobs, records nothing, as before it)
            settings["logprobs"] = args.logprobs
        if not args.no_routed_experts:  # (off: the rows without them, as before they came)
            settings["return_routed_experts"] = True
    if args.prompt_routed_experts:  # (off: the rows without them, as before they came)
        settings["prompt_routed_experts"] = True
    settings |= bit_settings(llm.engine)
    if args.score:  # scoring reads token ids only: a tokenizer changes none of its bits
        settings.pop("model.tokenizer_files", None)
    return settings


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
    new = as_json(settings)
    differing = _differing_keys(recorded, new)
    if differing:
        key = differing[0]
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
    seeds and the input's digest are the rollout's own)."""
    path = settings_path(rollout_output.resolve())  # named after the output's real path
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(recorded, dict) or recorded.get("score") is not False:
        return []
    new = as_json(settings)
    # Not the tokenizer (the rollout's text prompts are ids in its rows already) nor the
    # context and the bounds on n and on top logprobs (they decide which rows run).
    unread = ("scheduler.max_model_len", "model.tokenizer_files", MAX_N_KEY, MAX_LOGPROBS_KEY)
    return [
        f"{key}={_shown(recorded, key)} -> {_shown(new, key)}"
        for key in _differing_keys(recorded, new)
        if "." in key and key not in unread
    ]


def _differing_keys(recorded: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The keys whose values differ or that one side lacks: the record's in its order, then
    the new ones."""
    keys = [*recorded, *(k for k in new if k not in recorded)]
    return [k for k in keys if k not in recorded or k not in new or recorded[k] != new[k]]


def record_settings(output: Path, settings: dict[str, Any]) -> None:
    """Write the settings record of an output that has no rows yet (replacing any older one:
    with no rows there is nothing to mix), atomically and fsynced, before its first row."""
    path = settings_path(output)
    staging = path.with_name(path.name + ".tmp")
    with open(staging, "w", encoding="utf-8") as f:
        json.dump(as_json(settings), f, indent=1, allow_nan=False)  # strict, as the rows
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, path)


def _shown(values: dict[str, Any], key: str) -> str:
    return json.dumps(values[key]) if key in values else "(none)"
