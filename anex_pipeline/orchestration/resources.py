"""Resources: where jobs keep their work and results, and the engine that generates."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field

from anex_pipeline.engine import Engine, EngineSettings, HttpSettings, load_engine, release_engines
from anex_pipeline.engine.models import cache_root, local_model_path
from anex_pipeline.engine.replicas import server_urls
from anex_pipeline.storage import is_s3, localize_input
from anex_pipeline.workdir.manifest import JobDir, JobManifest


def default_work_root() -> str:
    return os.environ.get("ANEX_WORK_DIR", str(cache_root() / "work"))


class StorageResource(dg.ConfigurableResource):
    """The work folder for every job's shards and checkpoints, and S3 access for s3:// paths."""

    work_root: str = Field(default_factory=default_work_root, description="Folder for job work files.")
    s3_endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint; unset = AWS.")
    s3_region: str | None = None

    def job(self, job_id: str) -> JobDir:
        return JobDir(Path(self.work_root).expanduser(), job_id)

    def local_input(self, uri: str, downloads: Path) -> Path:
        """The input as a local file: a path as it is, an s3:// object downloaded into a folder of
        ``downloads`` named after the URI."""
        if not is_s3(uri):
            return Path(uri).expanduser()
        folder = downloads / hashlib.sha256(uri.encode()).hexdigest()[:16]
        return localize_input(uri, folder, self.s3_client())

    def s3_client(self, quick: bool = False) -> Any:
        """A boto3 S3 client; ``quick`` bounds its timeouts and makes one attempt per call, for
        checks at submit that must answer in seconds."""
        import boto3
        from botocore.config import Config

        config = Config(connect_timeout=5, read_timeout=10, retries={"total_max_attempts": 1}) if quick else None
        return boto3.client("s3", endpoint_url=self.s3_endpoint_url, region_name=self.s3_region, config=config)


class EngineResource(dg.ConfigurableResource):
    """The in-process vLLM engine (the model comes from each job, loaded once per process), or,
    with ``base_url`` set, an OpenAI-compatible server such as ``vllm serve``."""

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
    base_url: str | None = Field(
        default_factory=lambda: os.environ.get("ANEX_ENGINE_BASE_URL") or None,
        description="OpenAI-compatible server(s) to send rows to, e.g. http://gpu-1:8000, or a comma-separated "
        "list of replicas of one model; unset = vLLM in this process.",
    )
    api_key: str | None = Field(
        default=None, description="Bearer token for base_url (give it as an EnvVar to keep it out of run config)."
    )
    max_concurrency: int = Field(default=32, ge=1, description="HTTP mode: requests in flight at once per server.")
    timeout_s: float = Field(default=600.0, gt=0, description="HTTP mode: seconds one request may take.")

    def settings_for(self, manifest: JobManifest) -> EngineSettings:
        from anex_pipeline.engine.parsing import ParserNames, choose_parsers

        model = str(local_model_path(manifest.model))
        embeddings = manifest.endpoint == "embeddings"
        # The model family's reasoning and tool parsers, or the ones the job names.
        parsers = ParserNames() if embeddings else choose_parsers(model, manifest.model_name, manifest.job_options())
        return EngineSettings(
            model=model,
            model_name=manifest.model_name,
            runner="pooling" if embeddings else "generate",
            dtype=self.dtype,
            # Embedding models have short fixed contexts (256 for MiniLM): use the model's own.
            max_model_len=None if embeddings else self.max_model_len,
            memory_share=self.memory_share,
            kv_cache_gib=self.kv_cache_gib,
            max_num_seqs=self.max_num_seqs,
            reasoning_parser=parsers.reasoning,
            tool_parser=parsers.tool,
        )

    def engine_for(self, manifest: JobManifest) -> Engine:
        if self.base_url:
            try:
                servers = server_urls(self.base_url)
            except ValueError as exc:
                raise ValueError(f"the engine's base_url: {exc}") from None
            return load_engine(
                HttpSettings(
                    base_url=servers,
                    model_name=manifest.model_name,
                    model_named="model" in manifest.options,
                    api_key=self.api_key,
                    max_concurrency=self.max_concurrency,
                    timeout_s=self.timeout_s,
                )
            )
        return load_engine(self.settings_for(manifest))

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if not self.keep_loaded:
            release_engines()
