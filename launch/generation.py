"""The bridge from an async route to the AsyncEngine: submit, then stream or collect.

`Generation` submits prompts with an `on_output` callback that hands each step's
`RequestOutput` deltas from the engine thread to an asyncio queue (thread-safe), then one end
marker when the submission's Future settles. Streaming routes iterate the deltas as they come
(`sse_stream`); other routes await the whole outputs. Text, stop strings and samples are the
engine's: nothing here decodes or cuts text.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from launch.metrics import RequestTracker, ServerMetrics
from launch.openai.errors import error_body
from launch.openai.render import sse, usage
from moe_runtime.engine.async_engine import AsyncEngine, EngineUnavailableError
from moe_runtime.engine.outputs import RequestOutput
from moe_runtime.sampling_params import SamplingParams

_END = object()


@dataclass(frozen=True)
class Backend:
    """What the routes serve from: the engine's thread and the engine's own tokenizer."""

    engine: AsyncEngine
    tokenizer: Any


def ready(backend: Backend | None) -> Backend:
    if backend is None:
        raise EngineUnavailableError("the engine is still loading")
    return backend


class Generation:
    """One submission: its deltas as they come, then its whole outputs."""

    def __init__(
        self,
        engine: AsyncEngine,
        prompts: list[str | list[int]],
        params: list[SamplingParams],
        metrics: ServerMetrics,
    ) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._first: list = []
        aio_loop = asyncio.get_running_loop()
        tracker = RequestTracker(metrics)

        def on_output(prompt_idx: int, delta: RequestOutput) -> None:  # on the engine thread
            tracker.observe(prompt_idx, delta)
            aio_loop.call_soon_threadsafe(self._queue.put_nowait, (prompt_idx, delta))

        def on_done(_future: Future) -> None:  # on whichever thread settled it
            try:
                aio_loop.call_soon_threadsafe(self._queue.put_nowait, _END)
            except RuntimeError:
                pass  # the event loop has closed: nobody is listening

        self.future = engine.submit(prompts, params, on_output)
        self.future.add_done_callback(on_done)

    async def started(self) -> None:
        """Wait for the first delta; raises the submission's error (e.g. ValueError) if it
        failed before producing anything, so a route can still answer with a status code."""
        self._first.append(await self._queue.get())
        if self._first[0] is _END:
            self.future.result()

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) in the engine's order; raises the submission's error at the
        end if it failed."""
        while True:
            item = self._first.pop() if self._first else await self._queue.get()
            if item is _END:
                break
            yield item
        self.future.result()

    async def result(self) -> list[RequestOutput]:
        """The whole outputs, one per prompt. Cancelling the awaiting task aborts them."""
        return await asyncio.wrap_future(self.future)

    def cancel(self) -> None:
        """The client went away: the engine aborts the submission between steps."""
        self.future.cancel()


async def sse_stream(
    generation: Generation,
    head: dict,
    choices: Callable[[int, RequestOutput], list[dict]],
    include_usage: bool,
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per choice of each delta, an optional usage chunk, then
    [DONE]; a failure mid-stream is sent as one error chunk. A client that leaves aborts."""
    num_in: dict[int, int] = {}
    num_out = 0
    try:
        async for prompt_idx, delta in generation.deltas():
            num_in[prompt_idx] = len(delta.prompt_token_ids)
            num_out += sum(len(out.token_ids) for out in delta.outputs)
            for choice in choices(prompt_idx, delta):
                yield sse({**head, "choices": [choice], "weight_version": delta.weight_version})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(sum(num_in.values()), num_out)})
    except Exception as exc:
        yield sse(error_body(exc))
    finally:
        generation.cancel()  # no-op once finished
    yield "data: [DONE]\n\n"
