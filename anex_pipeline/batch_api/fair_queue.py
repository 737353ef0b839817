"""Batches waiting for one of the service's threads, handed out fairly between API keys.

The next batch taken is the oldest one of the key with the fewest batches being worked on, so a
key's tenth batch waits behind another key's first. No key may hold every thread: with more than
one thread, a key's batches take at most all but one of them, and the last stays free for the
other keys' batches (the one thread a key can never take is what keeps a small batch from waiting
behind another tenant's long checks or runs).
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, deque


class FairQueue:
    """Batch ids by owner (the hash of the API key), for ``threads`` threads to take."""

    def __init__(self, threads: int):
        self.per_owner = max(1, threads - 1)  # threads one key's batches may hold at once
        self._changed = threading.Condition()
        self._waiting: dict[str, deque[tuple[int, str]]] = {}  # owner -> (arrival, batch id), oldest first
        self._busy: Counter[str] = Counter()  # owner -> batches being worked on
        self._arrivals = itertools.count()
        self._closed = False

    def put(self, owner: str, batch_id: str) -> None:
        with self._changed:
            self._waiting.setdefault(owner, deque()).append((next(self._arrivals), batch_id))
            self._changed.notify()

    def get(self) -> tuple[str, str] | None:
        """Waits for a batch the caller may take and marks its owner busy with it (call
        :meth:`done` once the work ends); None once the queue is closed."""
        with self._changed:
            while True:
                if self._closed:
                    return None
                ready = [owner for owner, queue in self._waiting.items() if self._busy[owner] < self.per_owner]
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
