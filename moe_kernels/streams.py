"""A second CUDA stream for a layer's independent branches at decode-sized launches.

At a few rows a layer is a chain of small kernels, most of them latency-bound, and some parts
of it read nothing of each other: MLA's kv_a projection beside its query projection (both of
the normed input), its latent-cache write beside W_UK's product (disjoint parts of the
query), and the shared experts beside the router, the exchange (with EP) and the routed
experts (all of the post-attention norm). `SideStream.branch` runs the first of each pair
on a second stream, forked from the current one and joined before its result is read, so
their kernels run at once. Nothing is computed differently: every kernel reads and writes
what it did before, in its own stream's order; only which kernels share the GPU changes (the
bits: the GPU test tests/test_gpu_streams.py). Under CUDA graph capture the fork and join
become the graph's edges, so a replayed step runs the branches side by side too.

The one state kernels share across launches is the split-K arrival counts
(moe_kernels/triton_split_k.py, left at zero by each launch); two launches running at once must
not share them, so each stream has its own buffer (`StreamBuffers`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


class Branch:
    """The side of a fork: `run` launches on the side stream (inline when there is none)."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self.stream = stream

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        if self.stream is None:
            return fn(*args, **kwargs)
        with torch.cuda.stream(self.stream):
            return fn(*args, **kwargs)


INLINE = Branch(None)


class SideStream:
    """A CUDA device's second stream for launches of at most max_rows rows (0: never).

    Every use of the stream starts with a fork (the stream waits for the current one), so a
    block the caching allocator hands the side stream was last used by work ordered before
    it; the join makes the current stream wait for the side before anything reads the
    branch's results.
    """

    def __init__(self, device: torch.device, max_rows: int) -> None:
        self.stream = torch.cuda.Stream(device)
        self.device, self.max_rows = device, max_rows
        self.num_forks = 0  # branches run on the stream (engagement checks read it)

    def is_current(self) -> bool:
        return torch.cuda.current_stream(self.device) == self.stream

    @contextmanager
    def branch(self, num_rows: int) -> Iterator[Branch]:
        """A fork for a launch of num_rows rows: the side stream where num_rows <= max_rows,
        else inline; joined on exit."""
        if num_rows > self.max_rows:
            yield INLINE
            return
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        self.num_forks += 1
        try:
            yield Branch(self.stream)
        finally:
            current.wait_stream(self.stream)


@contextmanager
def inline_branch(num_rows: int) -> Iterator[Branch]:
    """The branch of a table without a side stream (CPU, or the stream turned off)."""
    yield INLINE


class StreamBuffers:
    """One buffer for the side stream's launches and one for every other stream's (a worker
    runs its model on one stream at a time: eager, warm-up or graph capture)."""

    def __init__(self, side: SideStream, make: Callable[[], torch.Tensor]) -> None:
        self.side, self.main_buffer, self.side_buffer = side, make(), make()

    def current(self) -> torch.Tensor:
        return self.side_buffer if self.side.is_current() else self.main_buffer
