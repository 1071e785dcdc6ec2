"""The command-line pieces every launch script shares: `--set SECTION.KEY=VALUE` overrides."""

from __future__ import annotations

import argparse


def add_override_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="config override (repeatable), e.g. kernels.mode=fast",
    )


def parse_overrides(items: list[str]) -> dict[str, str]:
    """["kernels.mode=fast", ...] -> {"kernels.mode": "fast"}; a malformed item exits naming it."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected SECTION.KEY=VALUE")
        overrides[key.strip()] = value
    return overrides
