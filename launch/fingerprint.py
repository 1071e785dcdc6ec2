"""What an output's bits depend on beyond its request, and the fingerprint of it a response
carries.

`bit_settings` lists them flat ("model.hidden_size": 64, ...): the code the bits come from
(`runtime_stamp`), each kind of device the ranks run on, the resolved config less the keys that
change no bit, and the weights' stamp and tokenizer files' digests. The rollout tool records them
beside its output (launch/rollout_settings.py); the server answers with a digest of them as
OpenAI's `system_fingerprint`, so a client that sends a seed can tell when the backend changed
in a way that may change the bits (the weights it serves now are the response's
`weight_version`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

import torch

import moe_runtime
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.tokenizer import TOKENIZER_FILES

# Config keys left out of the settings record: they change no output bit in any mode.
UNRECORDED_KEYS = frozenset(
    {
        "server",
        "parallel.timeout_s",
        "parallel.weight_read_timeout_s",
        "parallel.max_restarts",
        "parallel.restart_window_s",
    }
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
        "scheduler.admission_reserve",
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


def bit_settings(engine: LLMEngine) -> dict[str, Any]:
    """What an output's bits depend on beyond its request, flat, in the order a refused resume
    names them. `model.path`'s weights by their files' stamp (not hashed)."""
    config = engine.config
    contract = config.kernels.is_invariant and not config.parallel.allow_multiple_reduction
    unrecorded = UNRECORDED_KEYS | (INVARIANT_FREE_KEYS if contract else frozenset())
    settings = {**runtime_stamp(), "runtime.devices": engine.device_identities()}
    for section, values in dataclasses.asdict(config).items():
        for key, value in values.items():
            if section not in unrecorded and f"{section}.{key}" not in unrecorded:
                settings[f"{section}.{key}"] = value
    if config.model.path:
        # The weights there as the engine stamped them before reading them (a trainer saving
        # its next step over them would mix two policies in one output), and the directory
        # however it is named.
        settings["model.path"] = str(Path(config.model.path).resolve())
        stamp = engine.startup_weights.stamp
        settings["model.weights"] = {name: list(values) for name, values in stamp}
        # Text prompts' ids, so their rows' bits, come from these (hashed: a tokenizer is
        # small, and unlike the weights no engine stamp of them was taken).
        settings["model.tokenizer_files"] = _file_digests(Path(config.model.path), TOKENIZER_FILES)
    return settings


def system_fingerprint(engine: LLMEngine) -> str:
    """OpenAI's `system_fingerprint`: "fp_" and 16 hex digits of a SHA-256 of `bit_settings`."""
    settings = as_json(bit_settings(engine))
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    return f"fp_{digest[:16]}"


def as_json(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings as a record reads back: tuples as lists, other values as their str."""
    return json.loads(json.dumps(settings, default=str))


def _file_digests(directory: Path, names: tuple[str, ...]) -> dict[str, str]:
    """A SHA-256 of each of `names` present in `directory`."""
    return {
        name: hashlib.sha256((directory / name).read_bytes()).hexdigest()
        for name in names
        if (directory / name).is_file()
    }
