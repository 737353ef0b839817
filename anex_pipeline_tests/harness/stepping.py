"""A fake engine that works in steps like vLLM's scheduler (several rows in flight, some finishing
at each step), for tests of stopping and progress; and a code location with it behind the
pipeline, slowed down by ANEX_FAKE_STEP_S, for tests that drive Dagster's own processes.

Given a :class:`StepGate`, the engine takes a step only when the test has released one, so a test
can stop or cancel a job after exactly so many rows instead of racing a clock."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Iterator

from anex_pipeline.engine.base import EngineRequest, StopCheck
from anex_pipeline.engine.loader import register_engine
from anex_pipeline.orchestration.definitions import build_definitions
from anex_pipeline.spec import RowOutcome
from anex_pipeline.testing import FakeEngine, fake_engine


class StepGate:
    """Steps that happen only once the test releases them; the engine checks for a stop while it
    waits, as vLLM's engine does between steps."""

    POLL_S = 0.02  # how often a waiting engine looks for a stop

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._released = 0
        self.taken = 0

    def release(self, steps: int = 1) -> None:
        with self._changed:
            self._released += steps
            self._changed.notify_all()

    def open(self) -> None:
        """Lets every further step through."""
        self.release(10**9)

    def take(self, stop: StopCheck | None) -> None:
        with self._changed:
            while self.taken >= self._released:
                if stop is not None:
                    stop()
                self._changed.wait(self.POLL_S)
            self.taken += 1
            self._changed.notify_all()

    def wait_taken(self, steps: int, timeout: float = 60) -> None:
        """Waits until the engine has taken ``steps`` steps (their rows handed on once it asks
        for the next one)."""
        with self._changed:
            assert self._changed.wait_for(lambda: self.taken >= steps, timeout), f"{self.taken} of {steps} steps"


class SteppingEngine(FakeEngine):
    """Holds up to ``room`` rows in flight and finishes the oldest one per step, taking
    ``step_s`` for it, or waiting for the ``gate`` to release it; rows still in flight when the
    stream ends early are recorded as aborted."""

    def __init__(self, step_s: float = 0.0, room: int = 8, gate: StepGate | None = None):
        super().__init__()
        self.step_s, self.room, self.gate = step_s, room, gate
        self.steps = 0
        self.aborted: list[str] = []

    def stream(
        self, requests: Iterable[EngineRequest], group_rows: int, stop: StopCheck | None = None
    ) -> Iterator[list[RowOutcome]]:
        source = iter(requests)
        flight: list[EngineRequest] = []
        try:
            while True:
                if stop is not None:
                    stop()
                while len(flight) < self.room and (req := next(source, None)) is not None:
                    flight.append(req)
                if not flight:
                    return
                if self.gate is not None:
                    self.gate.take(stop)
                time.sleep(self.step_s)
                self.steps += 1
                yield [self._one(flight.pop(0))]
        finally:
            self.aborted = [r.key for r in flight]


stepping = [SteppingEngine(step_s=float(os.environ.get("ANEX_FAKE_STEP_S", "0")))]  # behind the resource

STEPPING = "stepping"  # the engine kind of this fake
register_engine(STEPPING, lambda config, manifest: stepping[0])
defs = build_definitions(engine=fake_engine(STEPPING))
