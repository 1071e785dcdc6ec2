"""The bridge from an async route to the AsyncEngine: submit, then stream or collect.

`Generation` submits prompts with an `on_output` callback that hands each step's
`RequestOutput` deltas from the engine thread to an asyncio queue (thread-safe), then one end
marker when the submission's Future settles; it answers with the route's choices, as server-sent
events of the deltas as they come or as one body of the whole outputs. Text, stop strings and
samples are the engine's: nothing here decodes or cuts text.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi.responses import Response, StreamingResponse

from launch.metrics import RequestTracker, ServerMetrics
from launch.openai.errors import error_body
from launch.openai.render import dumps_by_item, sse, usage
from moe_runtime.engine.async_engine import AsyncEngine, EngineUnavailableError
from moe_runtime.engine.outputs import RequestOutput
from moe_runtime.engine.submission import OutputCallback
from moe_runtime.sampling_params import SamplingParams

_END = object()


class SampleFailedError(Exception):
    """A sample the engine ended with finish_reason "error" (its logits were not finite): the
    response fails, a 500 or a stream's error event, naming it (CompletionOutput.error).
    Not a ValueError: the request was good; the model failed on it."""


Choices = Callable[[int, RequestOutput], list[dict]]  # (prompt index, output) -> its choices


class Submitter(Protocol):
    """What a Generation submits to: the AsyncEngine, or outputs known before anything runs."""

    def submit(
        self, prompts: list, params: list[SamplingParams], on_output: OutputCallback
    ) -> Future: ...


@dataclass(frozen=True)
class Backend:
    """What the routes serve from: the engine's thread, the engine's own tokenizer, and the
    digest of what the bits depend on (launch/fingerprint.py) that responses carry as OpenAI's
    `system_fingerprint` (null where none was taken)."""

    engine: AsyncEngine
    tokenizer: Any
    system_fingerprint: str | None = None


def ready(backend: Backend | None) -> Backend:
    if backend is None:
        raise EngineUnavailableError("the engine is still loading")
    return backend


class Generation:
    """One submission: started, then answered with its deltas as they come (server-sent
    events) or with its whole outputs (one JSON body)."""

    def __init__(
        self,
        engine: Submitter,
        prompts: list[str | list[int]],
        params: list[SamplingParams],
        metrics: ServerMetrics,
        received: float,
        stream: bool,
    ) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._stream = stream
        self._first: Any = None  # the first delta (or the end), which `start` waited for
        self._outputs: list[RequestOutput] | None = None  # None: streamed
        # Set before this Generation cancels its submission for a failed sample (a stream's):
        # its other samples then end as "error", as a whole body's do, not "abort", which
        # README keeps for a client that left.
        self._is_failed = False
        aio_loop = asyncio.get_running_loop()
        tracker = RequestTracker(metrics, received)
        self._metrics = metrics
        num_samples = sum(p.n for p in params)

        def on_output(prompt_idx: int, delta: RequestOutput) -> None:  # on the engine thread
            tracker.observe(prompt_idx, delta)
            # A whole response is built from the Future's outputs: its deltas, queued, were held
            # unread until it ended (its output twice over).
            if not stream:
                # Raised here, the engine aborts the rest of the submission and fails its
                # Future with it (a 500), not running its other samples on for nothing.
                check_samples(prompt_idx, delta)
                return
            aio_loop.call_soon_threadsafe(self._queue.put_nowait, (prompt_idx, delta))

        def on_done(future: Future) -> None:  # on whichever thread settled it
            if future.cancelled():  # the client left, or a sample failed a stream
                tracker.end(num_samples, "error" if self._is_failed else "abort")
            elif not isinstance(future.exception(), (ValueError, type(None))):
                tracker.end(num_samples, "error")  # a refused prompt (ValueError) never ran
            try:
                aio_loop.call_soon_threadsafe(self._queue.put_nowait, _END)
            except RuntimeError:
                pass  # the event loop has closed: nobody is listening

        self.future = engine.submit(prompts, params, on_output)
        self.future.add_done_callback(on_done)

    async def start(self) -> None:
        """Wait for the whole outputs (cancelling the awaiting task aborts them) or, to stream,
        for the first delta. Raises the submission's error (e.g. ValueError) if it failed before
        producing anything, or SampleFailedError if the first delta holds a failed sample, so
        a route can still answer with a status code (a 500, not a 200 stream of one error
        event). Cancelled (its client left before the first token), it cancels the
        submission: nothing runs for nobody."""
        try:
            if not self._stream:
                self._outputs = await asyncio.wrap_future(self.future)
                return
            self._first = await self._queue.get()
        except BaseException:
            self.future.cancel()
            raise
        if self._first is _END:
            self.future.result()
            return
        try:
            check_samples(*self._first)
        except SampleFailedError:
            self.fail()
            raise

    def fail(self) -> None:
        """Cancel the submission for a failed sample (its own, or for an echo its prompt's
        scoring): its other samples end as "error"."""
        self._is_failed = True
        self.future.cancel()

    async def response(
        self, head: dict, choices: Choices, include_usage: bool, also: list[RequestOutput] = ()
    ) -> Response:
        """After `start`: `head` and the choices of the whole outputs, usage and weight version
        as one body; or, streamed, as server-sent events. `also`: other requests run for the
        same response (its prompts' scorings), whose weight versions count too."""
        if self._outputs is None:
            chunks = self._events(head, choices, include_usage, also)
            return StreamingResponse(chunks, media_type="text/event-stream")
        # Built and encoded on a thread: a body of many samples with logprobs takes seconds,
        # and on the event loop no stream got a chunk and /health no answer meanwhile.
        body = await asyncio.to_thread(self._whole_body, head, choices, also)
        return Response(body, media_type="application/json")

    def _whole_body(self, head: dict, choices: Choices, also: list[RequestOutput]) -> bytes:
        outputs = self._outputs
        num_in = sum(len(whole.prompt_token_ids) for whole in outputs)
        num_out = sum(len(out.token_ids) for whole in outputs for out in whole.outputs)
        ran = [*outputs, *also]
        body = {
            **head,
            "choices": [c for i, whole in enumerate(outputs) for c in choices(i, whole)],
            "usage": usage(num_in, num_out),
            "weight_version": max(whole.weight_version for whole in ran),
            "first_weight_version": min(whole.first_weight_version for whole in ran),
        }
        return dumps_by_item(body, "choices").encode("utf-8")

    async def _events(
        self, head: dict, choices: Choices, include_usage: bool, also: list[RequestOutput] = ()
    ) -> AsyncIterator[str]:
        """A chunk per choice of each delta, an optional usage chunk, then [DONE]; a failure
        mid-stream is sent as one error chunk. A client that leaves aborts the submission."""
        num_in: dict[int, int] = {}
        num_out = 0
        weight_version = max((whole.weight_version for whole in also), default=0)
        also_first = min((whole.first_weight_version for whole in also), default=None)
        first_weight_version = also_first
        try:
            item = self._first
            while item is not _END:
                prompt_idx, delta = item
                check_samples(prompt_idx, delta)  # (the submission is cancelled below)
                num_in[prompt_idx] = len(delta.prompt_token_ids)
                num_out += sum(len(out.token_ids) for out in delta.outputs)
                weight_version = max(weight_version, delta.weight_version)
                first = delta.first_weight_version
                if also_first is not None:
                    first = min(first, also_first)
                if first_weight_version is None or first < first_weight_version:
                    first_weight_version = first
                versions = {"weight_version": delta.weight_version, "first_weight_version": first}
                for choice in choices(prompt_idx, delta):
                    yield sse({**head, "choices": [choice], **versions})
                item = await self._queue.get()
            self.future.result()  # raises the submission's error if it failed
            if include_usage:  # the weight versions as the whole body's: newest, oldest first
                totals = usage(sum(num_in.values()), num_out)
                versions = {
                    "weight_version": weight_version,
                    "first_weight_version": weight_version
                    if first_weight_version is None
                    else first_weight_version,
                }
                yield sse({**head, "choices": [], "usage": totals, **versions})
        except Exception as exc:
            if isinstance(exc, SampleFailedError):
                self.fail()
            self._metrics.stream_errors.inc()
            yield sse(error_body(exc))
        finally:
            self.future.cancel()  # no-op once finished
        yield "data: [DONE]\n\n"


def check_samples(prompt_idx: int, output: RequestOutput) -> None:
    """SampleFailedError naming the first sample of a delta that ended with finish_reason
    "error" (its logits were not finite). Why the whole response fails: a client reading a 200
    would take the tokens before it for a whole sample."""
    for out in output.outputs:
        if out.finish_reason == "error":
            raise SampleFailedError(f"prompt {prompt_idx}: {out.error}")
