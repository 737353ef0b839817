"""Several streams of rows on one in-process engine at once (the Batch API's batches), with a fair
share of the engine's room for each caller.

Each stream is a lane. The lanes add their rows to the one engine and take turns at stepping it;
a step finishes rows of any lane, and each finished row goes to the lane that owns it, so the
engine batches the rows of every lane together. The room a lane may fill (rows in the engine) is
the engine's room split evenly between the share keys of the lanes running (a Batch API key, set
with :func:`sharing_as`), then between the lanes of one key: a small batch that arrives while a
large one runs gets its rows in at once instead of waiting behind it.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

_share_key: ContextVar[str] = ContextVar("anex_engine_share_key", default="")


@contextmanager
def sharing_as(key: str) -> Iterator[None]:
    """Streams started by this thread (or task) within the block share the engine as ``key``."""
    token = _share_key.set(key)
    try:
        yield
    finally:
        _share_key.reset(token)


@dataclass(eq=False)
class Lane:
    key: str
    flights: dict[str, Any] = field(default_factory=dict)  # engine request id -> the row's state
    finished: list[Any] = field(default_factory=list)  # its rows' outputs, collected by any lane's step


class Lanes:
    """The lanes on one engine. ``lock`` guards the engine itself (adding, stepping, aborting)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._left = threading.Condition(self.lock)  # notified as lanes leave
        self._lanes: list[Lane] = []
        self._owner: dict[str, Lane] = {}

    def join(self) -> Lane:
        lane = Lane(_share_key.get())
        with self.lock:
            self._lanes.append(lane)
        return lane

    def leave(self, lane: Lane) -> None:
        with self.lock:
            self._lanes.remove(lane)
            for request_id in lane.flights:
                self._owner.pop(request_id, None)
            self._left.notify_all()

    def wait_idle(self) -> None:
        """Returns once no lane runs on the engine (nor a batch holding its lock)."""
        with self._left:
            self._left.wait_for(lambda: not self._lanes)

    def room(self, lane: Lane, total: int) -> int:
        """Rows the lane may have in the engine: its key's even share of ``total``, split evenly
        between that key's lanes; at least one."""
        with self.lock:
            lanes_per_key = Counter(other.key for other in self._lanes)
        return max(1, total // len(lanes_per_key) // lanes_per_key[lane.key])

    def own(self, lane: Lane, request_id: str, state: Any) -> None:
        with self.lock:
            lane.flights[request_id] = state
            self._owner[request_id] = lane

    def deliver(self, outputs: Iterable[Any]) -> None:
        """Hands each finished output of an engine step to its lane (call with ``lock`` held)."""
        for out in outputs:
            if out.finished and (lane := self._owner.pop(out.request_id, None)) is not None:
                lane.finished.append(out)

    def take(self, lane: Lane) -> list[Any]:
        """The lane's finished outputs, removed from it."""
        with self.lock:
            taken, lane.finished = lane.finished, []
        return taken
