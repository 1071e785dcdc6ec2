"""What AsyncEngine queues and answers: a submission (its requests' admission, their callback
and the Future its caller waits on), the error of work the engine did not run, and resolving
a Future that its caller may have cancelled meanwhile. Moves no work between threads and calls
no engine itself: that is AsyncEngine's (engine/async_engine.py).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from moe_runtime.engine.engine import LLMEngine
from moe_runtime.engine.outputs import RequestOutput
from moe_runtime.engine.request import Request

OutputCallback = Callable[[int, RequestOutput], None]  # (prompt index, delta)


class EngineUnavailableError(RuntimeError):
    """The engine is loading, draining, stopped or dead; the request was not run.
    retry_after_s: when a retry may find it serving again (rebuilding or stalled), else None."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class Submission:
    admit: Callable[[LLMEngine], list[Request]]  # queues its requests on the loop thread
    num_sequences: int  # sequences it will run (a request's n samples each)
    on_output: OutputCallback | None
    is_scoring: bool = False  # no deltas: settled whole once its requests are done
    future: Future = field(default_factory=Future)
    requests: list[Request] = field(default_factory=list)
    num_finished: int = 0  # requests[:num_finished] have finished

    def has_run(self) -> bool:
        """Whether a step (the failed one included) ran any of its sequences: queued or
        admitted but never scheduled, it never reached a rank."""
        return any(
            seq.first_weight_version is not None
            for request in self.requests
            for seq in request.samples
        )

    def is_finished(self) -> bool:
        """Whether every request has finished. Requests finish mostly in the order they were
        queued, so a pointer past the finished ones makes this O(1) a step amortized: asked on
        every delta, a scan of all requests made a submission of N prompts cost O(N^2)."""
        requests = self.requests
        while self.num_finished < len(requests) and requests[self.num_finished].is_finished:
            self.num_finished += 1
        return self.num_finished == len(requests)


def resolve(future: Future, error: BaseException | None, result: Any) -> None:
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass  # cancelled by its caller meanwhile
