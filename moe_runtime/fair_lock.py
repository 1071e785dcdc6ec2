"""FairRLock: a reentrant lock granted in the order threads asked for it (the LLM's calls).

threading.RLock is not fair: a thread that releases it and asks again at once (a rollout loop
calling generate back to back) takes it again before a waiting thread wakes, so a trainer
thread's update_weights waited behind 173 generates (7 s), where a call is documented to wait
for the call running. Here waiters queue: on release the oldest waiter goes next, and a thread
asking again goes behind it. Reentrant as RLock is: the owner takes it again at once (a signal
handler calling shutdown() in the thread of the call it interrupted).
"""

from __future__ import annotations

import collections
import threading


class FairRLock:
    def __init__(self) -> None:
        # Reentrant: a signal handler may ask for the lock while its thread is inside acquire.
        self._cond = threading.Condition(threading.RLock())
        self._owner: int | None = None
        self._count = 0
        self._waiting: collections.deque[int] = collections.deque()  # thread idents, oldest first

    def acquire(self) -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._count += 1
                return True
            try:
                while self._owner is not None or (self._waiting and self._waiting[0] != me):
                    if me not in self._waiting:  # (again, after a handler's turn of this thread)
                        self._waiting.append(me)
                    self._cond.wait()
            except BaseException:  # a KeyboardInterrupt while waiting: leave the queue
                if me in self._waiting:
                    self._waiting.remove(me)
                self._cond.notify_all()
                raise
            if self._waiting and self._waiting[0] == me:
                self._waiting.popleft()
            self._owner, self._count = me, 1
            return True

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("cannot release un-acquired lock")
            self._count -= 1
            if self._count == 0:
                self._owner = None
                self._cond.notify_all()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()
