"""The project's definitions with the real engine sized for tests, rebuilt by name in each step
process of a multi-process run (``dg.build_reconstructable_job``). Work files go to ANEX_WORK_DIR,
the shared model server's state to ANEX_MACHINE_SERVER_DIR."""

from __future__ import annotations

import dagster as dg

from anex_pipeline.orchestration.definitions import build_definitions
from anex_pipeline.orchestration.resources import EngineResource

defs = build_definitions(engine=EngineResource(max_model_len=2048))


def job_named(name: str) -> dg.JobDefinition:
    return defs.resolve_job_def(name)
