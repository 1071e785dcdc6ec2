"""A serving process's long-lived objects kept out of Python's cyclic collector.

Why: a process running an engine holds some 300,000 objects the collector tracks (torch,
Triton, the model's modules and parameters), made once at start-up and alive until exit. A
full collection walks every one of them: 130 ms on the 2-core development machine, 219 ms in
a decode step on the H200's host (BENCHMARKS.md), a stall of every request in flight, at
intervals set by how many objects the requests leave behind. `gc.freeze()` after start-up
moves them where the collector no longer looks; a full collection then walks only what came
after (< 1 ms there).

Frozen objects are still freed when their last reference goes, but an unreachable cycle
among them is never collected: a model dropped at a rebuild would keep its memory. So a
rebuild in the same process runs `thawed()`. Only processes the runtime owns freeze: the
launch tools after their engine starts and the Ray workers after theirs; a program using
`LLM` in its own process may call `freeze()` itself.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze() -> int:
    """Collect once, then move every object the collector tracks out of its view; -> how many
    objects are frozen now."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def thawed() -> Iterator[None]:
    """Frozen objects back in the collector's view for the block (a rebuild drops a model);
    after it, a collection (the dropped objects' cycles freed) and a freeze again if the heap
    was frozen before."""
    was_frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    try:
        yield
    finally:
        if was_frozen:
            freeze()
        else:
            gc.collect()
