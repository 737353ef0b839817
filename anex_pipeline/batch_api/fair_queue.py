"""Batches waiting for one of the service's threads, handed out fairly between API keys.

The next batch taken is the oldest one of the key with the fewest batches being worked on, so a
key's tenth batch waits behind another key's first. ``threads`` batches are worked on at once,
whoever sends them; one thread more is kept for a key that has nothing in progress, so a key's
first batch never waits behind another key's long checks or runs.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, deque


class FairQueue:
    """Batch ids by owner (the hash of the API key), for ``threads`` + 1 threads to take."""

    def __init__(self, threads: int):
        self.threads = threads  # batches worked on at once; one more for a key with none in progress
        self._changed = threading.Condition()
        self._waiting: dict[str, deque[tuple[int, str]]] = {}  # owner -> (arrival, batch id), oldest first
        self._busy: Counter[str] = Counter()  # owner -> batches being worked on
        self._arrivals = itertools.count()
        self._closed = False

    def put(self, owner: str, batch_id: str) -> None:
        with self._changed:
            self._waiting.setdefault(owner, deque()).append((next(self._arrivals), batch_id))
            self._changed.notify_all()

    def _may_take(self, owner: str) -> bool:
        busy = self._busy.total()
        return busy < self.threads or (busy == self.threads and self._busy[owner] == 0)

    def get(self) -> tuple[str, str] | None:
        """Waits for a batch the caller may take and marks its owner busy with it (call
        :meth:`done` once the work ends); None once the queue is closed."""
        with self._changed:
            while True:
                if self._closed:
                    return None
                ready = [owner for owner in self._waiting if self._may_take(owner)]
                if ready:
                    owner = min(ready, key=lambda o: (self._busy[o], self._waiting[o][0][0]))
                    _, batch_id = self._waiting[owner].popleft()
                    if not self._waiting[owner]:
                        del self._waiting[owner]
                    self._busy[owner] += 1
                    return owner, batch_id
                self._changed.wait()

    def done(self, owner: str) -> None:
        """The work on one of ``owner``'s batches ended: its thread is free for the next."""
        with self._changed:
            self._busy[owner] -= 1
            self._busy += Counter()  # drops owners with nothing in progress
            self._changed.notify_all()

    def close(self) -> None:
        """Wakes every waiting thread with None; batches still waiting stay unanswered."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
