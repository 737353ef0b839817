"""The code location of the Ray tests: the usual definitions (the executor follows ANEX_EXECUTOR)
with a slow recording stand-in engine. It answers as the fake engine does, takes about
:data:`ROW_SECONDS` a row, and appends one line per generated row to ``generated.log`` in the
job's work folder: the row's ``custom_id`` with the host, process and ``CUDA_VISIBLE_DEVICES``
of the step that generated it, and the time; the first steps of a job wait for each other (see
:class:`SlowRecordingEngine`). The inbox settles in half a second."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.engine.loader import register_engine
from anex_pipeline.orchestration.definitions import build_definitions
from anex_pipeline.orchestration.inboxes import LocalInboxSettings
from anex_pipeline.spec import RowOutcome
from anex_pipeline.testing import FakeEngine, fake_engine

ROW_SECONDS = 0.2
LOG_NAME = "generated.log"
GATHER = 3  # the worker nodes of the tests' cluster
GATHER_WAIT_S = 180.0


class SlowRecordingEngine(FakeEngine):
    """Before its first row, a step waits (at most GATHER_WAIT_S) until as many of the job's
    steps are generating as the cluster has nodes, or the job has shards: that many then run at
    once, so where Ray puts them shows, however far apart the driver started their runs."""

    def __init__(self, model_name: str, log: Path, together: int):
        super().__init__(model_name)
        self.log, self.together = log, together
        self.gathered = False

    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        if not self.gathered:
            self.gathered = True
            here = self.log.with_name("generating.log")
            with here.open("a") as f:
                f.write(f"{socket.gethostname()} {os.getpid()}\n")
            deadline = time.monotonic() + GATHER_WAIT_S
            while len(here.read_text().splitlines()) < self.together and time.monotonic() < deadline:
                time.sleep(0.1)
        return super().run(requests)

    def _one(self, req: EngineRequest) -> RowOutcome:
        time.sleep(ROW_SECONDS)
        entry = {
            "custom_id": req.key,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "t": time.time(),
        }
        with self.log.open("a") as f:  # one short write per line: lines of several writers never mix
            f.write(json.dumps(entry) + "\n")
        return super()._one(req)


def read_log(job_root: Path) -> list[dict[str, object]]:
    path = job_root / LOG_NAME
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


register_engine(
    "slow-recording",
    lambda config, manifest: SlowRecordingEngine(
        manifest.model_name,
        Path(os.environ["ANEX_WORK_DIR"]) / manifest.job_id / LOG_NAME,
        min(GATHER, len(manifest.shards)),
    ),
)

defs = build_definitions(engine=fake_engine("slow-recording"), local_inbox=LocalInboxSettings(settle_seconds=0.5))
