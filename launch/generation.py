"""The bridge from an async route to the EngineLoop: submit, then stream or collect.

`Generation` submits a request with an `on_token` callback that forwards the loop thread's
TokenEvents into an asyncio queue (thread-safe hand-off), followed by one end marker when the
request's Future settles. Streaming routes iterate the events as they come; non-streaming routes
await the finished sequences. Either way the bits are the sequences' own (the events are copies).
`TextDeltas` turns one sample's growing token list into text deltas that never show a stop
string or half a UTF-8 character.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import Future

from launch.metrics import ServerMetrics
from moe_runtime.engine_loop import EngineLoop
from moe_runtime.loop_events import TokenEvent
from moe_runtime.sampling_params import SamplingParams
from moe_runtime.sequence import Sequence

_END = object()


class Generation:
    """One submitted request: its events as they come and its finished sequences."""

    def __init__(
        self,
        loop: EngineLoop,
        prompts: list[str | list[int]],
        params: list[SamplingParams],
        stop: list[str],
        metrics: ServerMetrics,
    ) -> None:
        self._events: asyncio.Queue = asyncio.Queue()
        self._pending: list = []
        self.weight_version = 0
        aio_loop = asyncio.get_running_loop()
        tracker = metrics.tracker()

        def on_token(event: TokenEvent) -> None:  # on the engine loop thread
            tracker.observe(event)
            aio_loop.call_soon_threadsafe(self._events.put_nowait, event)

        def on_done(_future: Future) -> None:  # on whichever thread settled it
            try:
                aio_loop.call_soon_threadsafe(self._events.put_nowait, _END)
            except RuntimeError:
                pass  # the event loop has closed: nobody is listening

        self.future = loop.submit_batch(prompts, params, stop=stop, on_token=on_token)
        self.future.add_done_callback(on_done)

    async def started(self) -> None:
        """Wait for the first event; raises the request's error (e.g. ValueError) if it failed
        before producing anything, so a route can still answer with a status code."""
        item = await self._events.get()
        self._pending.append(item)
        if item is _END:
            self.future.result()

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Events in the order the loop thread sent them; raises the request's error at the
        end if it failed."""
        while True:
            item = self._pending.pop(0) if self._pending else await self._events.get()
            if item is _END:
                break
            self.weight_version = max(self.weight_version, item.weight_version)
            yield item
        self.future.result()

    async def result(self) -> list[list[Sequence]]:
        """The finished sequences, one list per prompt (n each)."""
        async for _ in self.events():
            pass
        return self.future.result()

    def cancel(self) -> None:
        """The client went away: the loop aborts the request between steps."""
        self.future.cancel()


class TextDeltas:
    """Text of one sample as it grows, cut before the first stop string."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self.token_ids: list[int] = []
        self.text = ""  # what has been sent
        self.is_stopped = False

    def push(self, token_ids: tuple[int, ...] | list[int], is_final: bool) -> str:
        """Add tokens; returns the text that may be sent now."""
        self.token_ids.extend(token_ids)
        text, self.is_stopped = cut_at_stop(self._tokenizer.decode(self.token_ids), self._stop)
        if not (is_final or self.is_stopped):
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 character may still complete
            text = text[: len(text) - _partial_stop_len(text, self._stop)]
        if len(text) <= len(self.text):
            return ""
        delta, self.text = text[len(self.text) :], text
        return delta


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """(text before the first stop string, whether one occurs)."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def _partial_stop_len(text: str, stop: list[str]) -> int:
    """Length of the longest tail of text that begins some stop string (held back)."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
