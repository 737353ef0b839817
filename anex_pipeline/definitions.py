"""The Dagster definitions that `dagster dev` loads through workspace.yaml."""

from __future__ import annotations

import dagster as dg

from anex_pipeline.defs.assets import all_assets
from anex_pipeline.defs.jobs import all_jobs
from anex_pipeline.defs.resources import EngineResource, StorageResource


def build_definitions(storage: StorageResource | None = None, engine: EngineResource | None = None) -> dg.Definitions:
    return dg.Definitions(
        assets=all_assets,
        jobs=all_jobs,
        resources={"storage": storage or StorageResource(), "engine": engine or EngineResource()},
    )


defs = build_definitions()
