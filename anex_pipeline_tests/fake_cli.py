"""``anex-pipeline`` with the fake engine behind it, for tests that must run the command in its own
process (and kill it). The fake answers slowly when ANEX_FAKE_ROW_DELAY_S is set, so that a test
can kill the process in the middle of a shard."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

from anex_pipeline import cli
from anex_pipeline.engine.base import Engine, EngineRequest
from anex_pipeline.orchestration import resources
from anex_pipeline.spec import RowOutcome
from anex_pipeline.workdir.manifest import JobManifest
from anex_pipeline_tests.fakes import FakeEngine, FakeEngineResource


class SlowFakeEngine(FakeEngine):
    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        time.sleep(float(os.environ.get("ANEX_FAKE_ROW_DELAY_S", "0")) * len(requests))
        return super().run(requests)


class SlowFakeEngineResource(FakeEngineResource):
    def engine_for(self, manifest: JobManifest) -> Engine:
        return SlowFakeEngine(manifest.model_name)


if __name__ == "__main__":
    resources.EngineResource = SlowFakeEngineResource  # type: ignore[misc]
    sys.exit(cli.main())
