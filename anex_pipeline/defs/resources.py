"""Resources: where jobs keep their work and results, and the engine that generates."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field

from anex_pipeline.engine import Engine, EngineSettings, load_engine, release_engines
from anex_pipeline.jobs import JobDir, JobManifest
from anex_pipeline.models import cache_root, local_model_path


def default_work_root() -> str:
    return os.environ.get("ANEX_WORK_DIR", str(cache_root() / "work"))


class StorageResource(dg.ConfigurableResource):
    """The work folder for every job's shards and checkpoints, and S3 access for s3:// paths."""

    work_root: str = Field(default_factory=default_work_root, description="Folder for job work files.")
    s3_endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint; unset = AWS.")
    s3_region: str | None = None

    def job(self, job_id: str) -> JobDir:
        return JobDir(Path(self.work_root).expanduser(), job_id)

    def s3_client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.s3_endpoint_url, region_name=self.s3_region)


class EngineResource(dg.ConfigurableResource):
    """The in-process vLLM engine; the model comes from each job, loaded once per process."""

    dtype: str = Field(default="auto", description="Weights dtype; on a CPU 'auto' means float32.")
    max_model_len: int = Field(default=4096, description="Context length the engine reserves for.")
    memory_share: float | None = Field(
        default=None, description="gpu_memory_utilization (on a CPU: share of RAM); unset = 0.9 GPU, 0.3 CPU."
    )
    kv_cache_gib: int = Field(default=1, description="CPU build only: KV cache size in GiB.")
    max_num_seqs: int | None = Field(default=None, description="Rows the engine schedules at once.")
    keep_loaded: bool = Field(
        default=False, description="Keep the engine loaded after the run (the CLI shares it across runs)."
    )

    def settings_for(self, manifest: JobManifest) -> EngineSettings:
        return EngineSettings(
            model=str(local_model_path(manifest.model)),
            model_name=manifest.model_name,
            runner="pooling" if manifest.endpoint == "embeddings" else "generate",
            dtype=self.dtype,
            # Embedding models have short fixed contexts (256 for MiniLM): use the model's own.
            max_model_len=None if manifest.endpoint == "embeddings" else self.max_model_len,
            memory_share=self.memory_share,
            kv_cache_gib=self.kv_cache_gib,
            max_num_seqs=self.max_num_seqs,
        )

    def engine_for(self, manifest: JobManifest) -> Engine:
        return load_engine(self.settings_for(manifest))

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if not self.keep_loaded:
            release_engines()
