"""What a full collection of Python's cyclic collector costs a process running the engine, with
its start-up objects in the collector's view and frozen out of it (moe_runtime/heap.py, as
serve_ep, the rollout tool and each Ray rank run).

An LLMEngine from `--config` (+ `--set` overrides) and one short generation, then `--repeats`
timed `gc.collect()` calls unfrozen, then `heap.freeze()` and `--repeats` more: ms median
[min, max], and the objects the collector tracks in each state. A full collection walks every
tracked object, so its time is what a request in flight waits when one falls in a step.

    python bench/gc_pause.py --config launch/configs/tiny_cpu.yaml
    python bench/gc_pause.py   # v2_lite_gpu.yaml
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_bench import spread  # noqa: E402
from launch.cli import add_override_argument, parse_overrides  # noqa: E402
from moe_runtime import heap  # noqa: E402
from moe_runtime.config import load_config  # noqa: E402
from moe_runtime.engine import LLMEngine  # noqa: E402
from moe_runtime.sampling_params import SamplingParams  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "launch" / "configs" / "v2_lite_gpu.yaml"


def timed_collections(repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(CONFIG))
    add_override_argument(parser)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"command: {' '.join(sys.argv)}")
    engine = LLMEngine(load_config(args.config, parse_overrides(args.set)))
    try:
        engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=4))
        while engine.has_unfinished():
            engine.step()
        tracked = len(gc.get_objects())
        unfrozen = timed_collections(args.repeats)
        num_frozen = heap.freeze()
        frozen = timed_collections(args.repeats)
        still_tracked = len(gc.get_objects())
    finally:
        heap.unfreeze()
        engine.shutdown()
    print("| heap | objects the collector walks | full collection ms [min, max] |")
    print("|---|---|---|")
    print(f"| as started | {tracked:,} | {spread(unfrozen)} |")
    print(f"| frozen ({num_frozen:,} objects) | {still_tracked:,} | {spread(frozen)} |")


if __name__ == "__main__":
    main()
