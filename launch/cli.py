"""The command-line pieces the launch scripts share: `--set SECTION.KEY=VALUE` overrides, the
sampling flags of generate.py and rollout.py, how their JSON lines write top logprobs, and the
Ray cluster a run of several ranks joins."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from moe_runtime.config import RuntimeConfig
from moe_runtime.sampling_params import SamplingParams

SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "logprobs")
RAY_ADDRESS_VARIABLE = "RAY_ADDRESS"  # Ray's own; `ray job submit` sets it for its job's driver
RUNTIME_LOGGER = "moe_runtime"  # the parent of every logger the runtime's packages log to
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging() -> None:
    """The runtime's records (weight loading progress, each rebalance, a rebuild) from INFO up
    on stderr, prefixed with time, level and logger name; each Ray rank's too (RayExecutor
    passes the threshold on). Every other logger keeps Python's default WARNING threshold:
    uvicorn's and Ray's configure their own, httpx's would log every request. Set here: only
    launch/ sets process-wide state.

    Why in every script: without it Python drops records below WARNING, and generate.py and
    rollout.py loaded a large checkpoint with no word between "loading" and their first row."""
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT, stream=sys.stderr)
    logging.getLogger(RUNTIME_LOGGER).setLevel(logging.INFO)


def add_override_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        type=_override_item,
        metavar="SECTION.KEY=VALUE",
        help="config override (repeatable), e.g. kernels.mode=fast",
    )


def _override_item(item: str) -> str:
    """argparse's check of one --set: a malformed item is a usage error (exit 2) naming it."""
    if "=" not in item:
        raise argparse.ArgumentTypeError(f"expected SECTION.KEY=VALUE, got {item!r}")
    return item


def parse_overrides(items: list[str]) -> dict[str, str]:
    """["kernels.mode=fast", ...] -> {"kernels.mode": "fast"} (items checked by argparse)."""
    overrides = {}
    for item in items:
        key, _, value = item.partition("=")
        overrides[key.strip()] = value
    return overrides


def add_sampling_arguments(
    parser: argparse.ArgumentParser, max_tokens: int, temperature: float, logprobs: int
) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=temperature)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--logprobs", type=int, default=logprobs, help="top logprobs per token")


def sampling_args(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags' values, keyed as SamplingParams' fields."""
    return {name: getattr(args, name) for name in SAMPLING_FLAGS}


def check_sampling_flags(values: dict[str, Any]) -> None:
    """SamplingParams' own checks, one flag at a time, so that an error names the flag a user
    typed (`--max-tokens must be ...`) rather than the field. values: {field name: value}."""
    for name, value in values.items():
        try:
            SamplingParams(**{name: value})
        except ValueError as exc:
            problem = str(exc).removeprefix(f"SamplingParams.{name} ")
            problem = problem.replace("must be None or ", "must be ")  # no flag gives None
            raise ValueError(f"--{name.replace('_', '-')} {problem}") from None


def json_top_logprobs(top_logprobs: list[dict[int, float]]) -> list[dict[str, float]]:
    """Each position's top logprobs keyed by the token id as text (JSON's keys are strings)."""
    return [{str(token_id): lp for token_id, lp in top.items()} for top in top_logprobs]


def connect_ray(config: RuntimeConfig) -> None:
    """Ray for a run of parallel.world_size > 1 ranks, before its engine loads: the cluster
    RAY_ADDRESS names (a `ray job submit` job's own, or one the user names), else a new local
    instance with the CPUs the ranks' bundles ask for; never a cluster that merely runs on this
    machine."""
    world_size = config.parallel.world_size
    if world_size > 1:
        # ray only if used
        from moe_runtime.executor.ray_connect import connect_ray as connect
        from moe_runtime.executor.ray_placement import rank_cpus

        address = os.environ.get(RAY_ADDRESS_VARIABLE) or "local"
        connect(world_size * rank_cpus(config), address)
