"""Resources: where jobs keep their work and results, and the engine that generates. Each wraps
its plain settings (its fields are theirs) so the Dagster layer adds nothing but the resource."""

from __future__ import annotations

import dagster as dg
from pydantic import Field

from anex_pipeline.engine import Engine, EngineConfig, engine_for, release_engines
from anex_pipeline.storage import StorageConfig
from anex_pipeline.workdir.manifest import JobManifest


class StorageResource(dg.ConfigurableResource, StorageConfig):
    """The storage settings (:class:`~anex_pipeline.storage.StorageConfig`) as a Dagster resource."""

    @classmethod
    def wrapping(cls, config: StorageConfig) -> StorageResource:
        return cls(**{name: getattr(config, name) for name in StorageConfig.model_fields})


class EngineResource(dg.ConfigurableResource, EngineConfig):
    """The engine settings (:class:`~anex_pipeline.engine.config.EngineConfig`) as a Dagster
    resource; ``keep_loaded`` keeps the engine loaded after a run (the CLI shares it across runs)."""

    keep_loaded: bool = Field(
        default=False, description="Keep the engine loaded after the run (the CLI shares it across runs)."
    )

    @classmethod
    def wrapping(cls, config: EngineConfig, *, keep_loaded: bool = False) -> EngineResource:
        return cls(**{name: getattr(config, name) for name in EngineConfig.model_fields}, keep_loaded=keep_loaded)

    def engine_for(self, manifest: JobManifest) -> Engine:
        return engine_for(self.plain(), manifest)

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if not self.keep_loaded:
            release_engines()
