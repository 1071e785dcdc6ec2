"""What every executor shares: the error it raises when a worker fails."""

from __future__ import annotations


class WorkerError(RuntimeError):
    """A worker died, timed out or failed a step; the message names the rank and the step."""
