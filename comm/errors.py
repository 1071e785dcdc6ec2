"""CollectiveError: the one exception a failed collective surfaces as, naming rank and op.

gloo and NCCL report a dead or late peer as a bare RuntimeError (a timeout, a closed
connection); `collective_guard` re-raises it with the rank and the collective that failed, so a
driver that gathers errors from many workers can tell which one gave up and where.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class CollectiveError(RuntimeError):
    """A collective failed on this rank (peer timeout, lost connection, backend error)."""


class PeerRefusedError(ValueError):
    """This rank's arguments were fine, a peer's were refused (named): raised in step with that
    peer's own ValueError, so a driver gathering the ranks' errors can report the peer's, which
    says why, rather than whichever it reads first."""


@contextmanager
def collective_guard(rank: int, op: str) -> Iterator[None]:
    """Run one collective; a backend RuntimeError becomes CollectiveError naming rank and op."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as original:
        raise CollectiveError(f"rank {rank}: {op} failed: {original}") from original
