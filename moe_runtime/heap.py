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
import threading
import traceback
from collections.abc import Iterator

# Whether freeze() froze this process (and no thawed block has it thawed now). Why not
# gc.get_freeze_count(): CPython 3.12.1 reports a few hundred frozen objects after any full
# collection, so every process would look frozen and a rebuild would freeze a user's heap.
_is_frozen = False
# The thawed blocks open now (threads may overlap them: a shutdown beside a rebuild), and
# whether the first of them found the process frozen; under _thaw_lock.
_thaw_lock = threading.Lock()
_num_thawed = 0
_refreeze = False


def freeze() -> int:
    """Collect once, then move every object the collector tracks out of its view; -> how many
    objects are frozen now."""
    global _is_frozen
    gc.collect()
    gc.freeze()
    _is_frozen = True
    return gc.get_freeze_count()


def unfreeze() -> None:
    """Every frozen object back in the collector's view, for good (until the next freeze)."""
    global _is_frozen
    gc.unfreeze()
    _is_frozen = False


@contextlib.contextmanager
def thawed() -> Iterator[None]:
    """Frozen objects back in the collector's view for the block (a rebuild or a shutdown
    drops a model); after it, if freeze() had frozen the process, a collection (the dropped
    objects' cycles freed) and a freeze again. (Unfrozen, the block's own code collects what
    it must: LocalExecutor.shutdown, before a rebuild sizes its cache.) Blocks that overlap in
    several threads thaw once and freeze again when the last one ends.

    Why the count: each block restored the freeze it found, so of two overlapping blocks the
    first to end froze again while the other was still dropping its model: the objects that
    one dropped were frozen with their cycles, never collected."""
    global _is_frozen, _num_thawed, _refreeze
    with _thaw_lock:
        if not _num_thawed:
            _refreeze, _is_frozen = _is_frozen, False
            if _refreeze:
                gc.unfreeze()
        _num_thawed += 1
    try:
        yield
    finally:
        with _thaw_lock:
            _num_thawed -= 1
            if not _num_thawed and _refreeze:
                freeze()


def drop_frames(error: BaseException) -> None:
    """Clear the local variables of the finished frames in error's traceback (and its
    causes'): a step that raised inside a rank's model holds the model in them, and the error
    lives on in the requests it ended, so a rebuild would build the new model beside the old
    one. The traceback keeps its lines."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
