"""A code location like ``anex_pipeline.orchestration.definitions`` with the fake engine behind it, for tests that
drive Dagster's own processes (``dagster job backfill``, the webserver): those processes load the
code themselves, so the engine cannot be swapped from the test. Work files go to ANEX_WORK_DIR."""

from __future__ import annotations

from anex_pipeline.orchestration.definitions import build_definitions
from anex_pipeline.testing import fake_engine

defs = build_definitions(engine=fake_engine())
