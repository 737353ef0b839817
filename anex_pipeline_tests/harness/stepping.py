"""A fake engine that works in steps like vLLM's scheduler (several rows in flight, some finishing
at each step), for tests of stopping and progress; and a code location with it behind the
pipeline, slowed down by ANEX_FAKE_STEP_S, for tests that drive Dagster's own processes."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator

from anex_pipeline.engine import register_engine
from anex_pipeline.engine.base import EngineRequest, StopCheck
from anex_pipeline.orchestration.definitions import build_definitions
from anex_pipeline.spec import RowOutcome
from anex_pipeline.testing import FakeEngine, fake_engine


class SteppingEngine(FakeEngine):
    """Holds up to ``room`` rows in flight and finishes the oldest one per step, taking
    ``step_s`` for it; rows still in flight when the stream ends early are recorded as aborted."""

    def __init__(self, step_s: float = 0.0, room: int = 8):
        super().__init__()
        self.step_s, self.room = step_s, room
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
                time.sleep(self.step_s)
                self.steps += 1
                yield [self._one(flight.pop(0))]
        finally:
            self.aborted = [r.key for r in flight]


stepping = [SteppingEngine(step_s=float(os.environ.get("ANEX_FAKE_STEP_S", "0")))]  # behind the resource

STEPPING = "stepping"  # the engine kind of this fake
register_engine(STEPPING, lambda config, manifest: stepping[0])
defs = build_definitions(engine=fake_engine(STEPPING))
