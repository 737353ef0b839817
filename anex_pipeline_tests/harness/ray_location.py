"""The code location of the Ray tests: the usual definitions (the executor follows ANEX_EXECUTOR)
with a slow recording stand-in engine. It answers as the fake engine does, takes about
:data:`ROW_SECONDS` a row, and appends one line per generated row to ``generated.log`` in the
job's work folder: the row's ``custom_id`` with the host, process and ``CUDA_VISIBLE_DEVICES``
of the step that generated it, and the time. The inbox settles in half a second."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.engine.loader import register_engine
from anex_pipeline.orchestration.definitions import build_definitions
from anex_pipeline.orchestration.inboxes import LocalInboxSettings
from anex_pipeline.spec import RowOutcome
from anex_pipeline.testing import FakeEngine, fake_engine

ROW_SECONDS = 0.2
LOG_NAME = "generated.log"


class SlowRecordingEngine(FakeEngine):
    def __init__(self, model_name: str, log: Path):
        super().__init__(model_name)
        self.log = log

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
        manifest.model_name, Path(os.environ["ANEX_WORK_DIR"]) / manifest.job_id / LOG_NAME
    ),
)

defs = build_definitions(engine=fake_engine("slow-recording"), local_inbox=LocalInboxSettings(settle_seconds=0.5))
