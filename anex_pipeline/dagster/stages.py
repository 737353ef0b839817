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

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from anex_pipeline.engine.loader import schedules_by_priority
from anex_pipeline.options import job_options
from anex_pipeline.orchestration.resources import EngineResource
from anex_pipeline.spec import URL_BY_ENDPOINT, JobReport
from anex_pipeline.stages.estimate import estimate_lengths
from anex_pipeline.stages.fetch_media import fetch_shard
from anex_pipeline.stages.generate import ShardSummary, run_shard
from anex_pipeline.stages.generate_answer_store import open_store
from anex_pipeline.stages.merge import merge_job
from anex_pipeline.stages.submit import prepare_job
from anex_pipeline.stopping import load_interruptibly, stopping_on_signals
from anex_pipeline.workdir import layout
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
    job_input: pa.Table | list[dict[str, Any]],
    options: dict[str, Any],
    engine: EngineResource,
    work_root: Path,
) -> StepRun:
    """Runs (or resumes) the job of ``job_input`` on ``engine``: a table with a ``prompt`` column
    (a Parquet job), or the request bodies of score or rerank rows (a JSONL job, since a Parquet
    row holds one prompt)."""
    staging = work_root / layout.STEP_FILES_DIR
    staging.mkdir(parents=True, exist_ok=True)
    suffix = "parquet" if isinstance(job_input, pa.Table) else "jsonl"
    pending = staging / f".input-{'_'.join(asset_path)}-{partition or ''}.{suffix}"
    if isinstance(job_input, pa.Table):
        pq.write_table(job_input, pending)
        options = {**options, "prompt_column": PROMPT_COLUMN}
    else:
        url = URL_BY_ENDPOINT[options["endpoint"]]
        with pending.open("wb") as out:
            for n, body in enumerate(job_input):
                out.write(msgspec.json.encode({"custom_id": str(n), "method": "POST", "url": url, "body": body}))
                out.write(b"\n")
    digest = hashlib.sha256(pending.read_bytes() + repr(sorted(options.items())).encode()).hexdigest()
    job_id = step_job_id(asset_path, partition, digest)
    job = JobDir(work_root, job_id)
    folder = job.step_files
    folder.mkdir(exist_ok=True)
    input_path = folder / f"input.{suffix}"
    shutil.move(pending, input_path)
    resumed = job.exists()
    if not resumed:
        job = prepare_job(
            input_path,
            str(folder / f"result.{suffix}"),
            job_options(options),
            work_root,
            job_id=job_id,
            results_in=staging,
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
    result = pq.read_table(job.result_path) if suffix == "parquet" else scoring_table(job.result_path)
    return StepRun(job, report, result, shards, resumed)


def scoring_table(path: Path) -> pa.Table:
    """A score or rerank job's JSONL result as the columns of a Parquet result: ``output`` (a
    row's score, or a rerank row's relevance scores in its documents' order), ``error_type`` and
    ``prompt_tokens``; lines are in the input's order."""
    outputs: list[Any] = []
    errors: list[str | None] = []
    tokens: list[int | None] = []
    with path.open("rb") as lines:
        for line in lines:
            row = msgspec.json.decode(line)
            body = (row.get("response") or {}).get("body")
            if body is None:
                outputs.append(None)
                errors.append((row.get("error") or {}).get("code") or "error")
                tokens.append(None)
                continue
            if "results" in body:  # rerank: sorted by score, each with its document's index
                by_index = {r["index"]: r["relevance_score"] for r in body["results"]}
                outputs.append([by_index.get(n) for n in range(len(by_index))])
            else:
                outputs.append(body["data"][0]["score"])
            errors.append(None)
            tokens.append((body.get("usage") or {}).get("prompt_tokens"))
    return pa.table({"output": outputs, "error_type": pa.array(errors, pa.string()), "prompt_tokens": tokens})
