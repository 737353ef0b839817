"""Running one LLM step's batch job in the step's own process: the existing stages in their order
(checks before any engine loads, media, length estimate, answer reuse and the answer store, prefix
order, checkpoints), over a work folder whose id comes from the step's asset key, partition and
input, so that a step materialized again after a crash or a stop resumes from its checkpoints."""

from __future__ import annotations

import hashlib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from anex_pipeline.engine.loader import schedules_by_priority
from anex_pipeline.options import job_options
from anex_pipeline.orchestration.resources import EngineResource
from anex_pipeline.spec import JobReport
from anex_pipeline.stages.estimate import estimate_lengths
from anex_pipeline.stages.fetch_media import fetch_shard
from anex_pipeline.stages.generate import ShardSummary, run_shard
from anex_pipeline.stages.generate_answer_store import open_store
from anex_pipeline.stages.merge import merge_job
from anex_pipeline.stages.submit import prepare_job
from anex_pipeline.stopping import load_interruptibly, stopping_on_signals
from anex_pipeline.workdir.manifest import JobDir
from anex_pipeline.workdir.timing import record_timing

PROMPT_COLUMN = "prompt"  # the column of the job's input file that holds each row's prompt or messages
IMAGE_COLUMN = "image"  # and the one that holds its image, for a step with an image column
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


@dataclass
class StepRun:
    """What one materialization of a step did: the job's report, its result table (one row per
    input row, in order) and each shard's summary of this run."""

    job: JobDir
    report: JobReport
    result: pa.Table
    shards: list[ShardSummary]
    resumed: bool


def step_job_id(asset_path: list[str], partition: str | None, digest: str) -> str:
    """The job id of a step: its asset key and partition (readable), and the digest of its input
    and options (a changed source or prompt is another job; the same one resumes)."""
    name = "__".join(asset_path) + (f"--{partition}" if partition else "")
    return f"{_UNSAFE.sub('_', name)[:160]}-{digest[:16]}"


def run_step_job(
    asset_path: list[str],
    partition: str | None,
    prompts: pa.Table,
    options: dict[str, Any],
    engine: EngineResource,
    work_root: Path,
) -> StepRun:
    """Runs (or resumes) the job of ``prompts`` (a table with a ``prompt`` column) on ``engine``."""
    staging = work_root.parent / f"{work_root.name}-llm-steps"
    staging.mkdir(parents=True, exist_ok=True)
    pending = staging / f".input-{'_'.join(asset_path)}-{partition or ''}.parquet"
    pq.write_table(prompts, pending)
    digest = hashlib.sha256(pending.read_bytes() + repr(sorted(options.items())).encode()).hexdigest()
    job_id = step_job_id(asset_path, partition, digest)
    folder = staging / job_id
    folder.mkdir(exist_ok=True)
    input_path = folder / "input.parquet"
    shutil.move(pending, input_path)
    job = JobDir(work_root, job_id)
    resumed = job.exists()
    if not resumed:
        job = prepare_job(
            input_path,
            str(folder / "result.parquet"),
            job_options({**options, "prompt_column": PROMPT_COLUMN}),  # embeddings' too
            work_root,
            job_id=job_id,
            local_model=not engine.base_url,
            adapters=engine.lora_modules,
            priority=schedules_by_priority(engine),
        )
    manifest = job.manifest()
    with stopping_on_signals(job):
        for shard in range(len(manifest.shards)):
            fetch_shard(job, shard, manifest.job_options().media)
        estimate_lengths(job, lambda: load_interruptibly(lambda: engine.engine_for(manifest, job)))
        store = open_store(job, engine.plain())
        try:
            shards = [
                run_shard(job, shard, lambda: engine.engine_for(manifest, job), store=store)
                for shard in range(len(manifest.shards))
            ]
        finally:
            if store is not None:
                store.close()
    for summary in shards:  # the report's throughput counts from these, as for a job's generations
        record_timing(job, "engine_wait", summary.engine_wait_s)
        record_timing(job, "generate", summary.seconds - summary.engine_wait_s)
    report = merge_job(job)
    return StepRun(job, report, pq.read_table(job.result_path), shards, resumed)
