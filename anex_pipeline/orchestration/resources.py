"""Resources: where jobs keep their work and results, and the engine that generates. Each wraps
its plain settings (its fields are theirs) so the Dagster layer adds nothing but the resource."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import dagster as dg
from pydantic import Field

from anex_pipeline import settings
from anex_pipeline.engine import collector
from anex_pipeline.engine.base import Engine
from anex_pipeline.engine.config import EngineConfig
from anex_pipeline.engine.loader import job_engine, loads_here, release_engines
from anex_pipeline.engine.vllm.engine import configure_vllm_logging
from anex_pipeline.storage import StorageConfig
from anex_pipeline.workdir.manifest import JobDir, JobManifest
from anex_pipeline.workdir.timing import record_engine

log = logging.getLogger(__name__)


class StorageResource(dg.ConfigurableResource, StorageConfig):
    """The storage settings (:class:`~anex_pipeline.storage.StorageConfig`) as a Dagster resource."""

    @classmethod
    def wrapping(cls, config: StorageConfig) -> StorageResource:
        return cls(**{name: getattr(config, name) for name in StorageConfig.model_fields})

    @classmethod
    def from_environment(cls) -> StorageResource:
        """The storage the environment gives (ANEX_WORK_DIR), as ``dg.EnvVar``."""
        return cls(**from_environment(cls, {"work_root": settings.WORK_DIR}))


def from_environment(resource: type[dg.ConfigurableResource], fields: Mapping[str, settings.Setting]) -> dict[str, Any]:
    """The fields of ``resource`` that the environment sets, as ``dg.EnvVar``: Dagster shows the
    variable (not its value) in the UI and reads it where each run or tick starts. An unset
    variable is left out, so its field keeps its default."""
    return {
        field: dg.EnvVar.int(s.name) if resource.model_fields[field].annotation is int else dg.EnvVar(s.name)
        for field, s in fields.items()
        if s.is_set()
    }


class EngineResource(dg.ConfigurableResource, EngineConfig):
    """The engine settings (:class:`~anex_pipeline.engine.config.EngineConfig`) as a Dagster
    resource; ``keep_loaded`` keeps the engine loaded after a run (the CLI shares it across runs).

    Dagster runs each step in a process of its own, so by default the vLLM engine is not loaded
    in the step: the steps of every job on the machine share one model server
    (:mod:`anex_pipeline.engine.server.machine_server`), which ends after ``machine_server_idle_s``
    without requests. One process running every step (the CLI, the Batch API) turns it off
    (:meth:`wrapping`). Which engine a job gets: :mod:`anex_pipeline.engine.modes`."""

    keep_loaded: bool = Field(
        default=False, description="Keep the engine loaded after the run (the CLI shares it across runs)."
    )

    @classmethod
    def wrapping(cls, config: EngineConfig, *, keep_loaded: bool = False) -> EngineResource:
        """The resource for one process that runs every step itself: the engine in that process
        (or, with the config's ``warm_server``, the machine's shared server when one is warm)."""
        fields = {name: getattr(config, name) for name in EngineConfig.model_fields}
        return cls(**{**fields, "machine_server": False}, keep_loaded=keep_loaded)

    def engine_for(self, manifest: JobManifest, job: JobDir | None = None) -> Engine:
        """The job's engine; with ``job``, what it is goes into the job's report."""
        engine = job_engine(self.plain(), manifest)
        if job is not None:
            record_engine(job, engine.report_section())
        return engine

    def load_ahead(self, manifest: JobManifest, loaded: Callable[[float], None], thread_name: str) -> None:
        """Loads the job's engine on a thread of its own while this one goes on; ``loaded`` gets
        the seconds it took (a failed load is logged: the step that needs the engine loads it again
        and reports why).

        vLLM sets up Python's logging the first time a process builds an engine in it. On a thread
        of its own, while this thread logs (Dagster's handlers do), the two threads once deadlocked
        on logging's locks, so when the engine is to be built in this process the set-up is done
        here first, on this thread."""
        if loads_here(self.plain(), manifest):
            configure_vllm_logging()

        def load() -> None:
            started = time.monotonic()
            try:
                self.engine_for(manifest)
            except Exception as exc:
                log.info("loading the engine ahead of time failed: %s", exc)
                return
            finally:
                collector.end_start_up()  # the engine is in hand: the command has started
            loaded(time.monotonic() - started)

        threading.Thread(target=load, name=thread_name, daemon=True).start()

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if not self.keep_loaded:
            release_engines()
