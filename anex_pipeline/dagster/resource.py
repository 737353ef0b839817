"""The engine an LLM step generates on, as a Dagster resource under one documented key."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from anex_pipeline.orchestration.resources import EngineResource
from anex_pipeline.paths import default_work_root

# The resource key every LLM step asks for. A project provides it once, e.g. in defs/resources.py:
#   @dg.definitions
#   def resources(): return dg.Definitions(resources={"anex_llm": LlmEngineResource()})
ENGINE_RESOURCE_KEY = "anex_llm"


class LlmEngineResource(EngineResource):
    """The engine settings of ``anex-pipeline run`` (model server, replicas by ``base_url``,
    engine arguments, adapters) plus where the steps keep their jobs' work folders. With no field
    set it is the embedded default, as ``run`` uses it."""

    work_root: str = Field(
        default="",
        description="Where each step keeps its job's work folder (shards, checkpoints, report); "
        "empty: the pipeline's work root (ANEX_WORK_DIR, else the cache folder's 'work').",
    )

    def step_work_root(self) -> Path:
        return Path(self.work_root or default_work_root()).expanduser()
