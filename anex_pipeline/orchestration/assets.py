"""One asset per stage. Each is a thin wrapper: it finds the job's work folder, calls the core
function, and describes what happened as metadata. Rows never travel through an IO manager.
"""

# No "from __future__ import annotations" here: Dagster reads the config and resource
# annotations at run time.

import errno
import json
import logging
import socket
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field

from anex_pipeline.console import PROGRESS_FIELD, PROGRESS_LOGGER, ShardProgress
from anex_pipeline.engine.loader import schedules_by_priority
from anex_pipeline.errors import EngineLoadFailed, JobStopped
from anex_pipeline.options import job_options
from anex_pipeline.orchestration.partitions import (
    across_jobs_and_shards,
    job_of_key,
    job_partitions,
    register_job,
    shard_partitions,
    split_shard_key,
)
from anex_pipeline.orchestration.ray_executor import ENGINE_STEP, OTHER_STEP
from anex_pipeline.orchestration.resources import EngineResource, StorageResource
from anex_pipeline.spec import EstimateReport, JobRejected, JobReport
from anex_pipeline.stages import fetch_media
from anex_pipeline.stages.estimate import estimate_lengths, estimate_without_sample, length_histogram
from anex_pipeline.stages.generate import live_progress, run_shard
from anex_pipeline.stages.generate_answer_store import open_store
from anex_pipeline.stages.merge import merge_job
from anex_pipeline.stages.merge_row_account import account_rows
from anex_pipeline.stages.publish import publish_job
from anex_pipeline.stages.quote import make_quote
from anex_pipeline.stages.submit import prepare_job
from anex_pipeline.stopping import load_interruptibly, request_stop, stopping_on_signals
from anex_pipeline.storage import is_s3, localize_input
from anex_pipeline.workdir import layout
from anex_pipeline.workdir.manifest import JobDir
from anex_pipeline.workdir.quotes import save_quote
from anex_pipeline.workdir.shard_owner import ShardTakenOver
from anex_pipeline.workdir.timing import record_served, record_timing

GROUP = "batch_job"
PROGRESS_EVERY_S = 5.0  # the run log gets a progress line at most this often
QUOTE_ROWS = 100_000  # a submitted job of up to this many rows is quoted (its tokenizer pass takes seconds)
OBSERVE_EVERY_S = 30.0  # and the generations asset an observation of its shard's progress
progress_log = logging.getLogger(PROGRESS_LOGGER)


class JobOptionsConfig(dg.PermissiveConfig):
    """Job options by name, as in an options file (e.g. max_tokens: 256); checked at submit."""


class JobSubmission(dg.Config):
    """What to run. Leave everything empty to rerun a job that was submitted before."""

    input: str = Field(default="", description="Input file: a local path or s3://bucket/key (JSONL or Parquet).")
    output: str = Field(default="", description="Result file: a local path or s3:// URI, same format as the input.")
    report: str = Field(default="", description="Report path; default: beside the result as <name>.report.json.")
    options: JobOptionsConfig = Field(
        default_factory=JobOptionsConfig, description="Job options by name, as in an options file."
    )


def _job(context: dg.AssetExecutionContext, storage: StorageResource) -> JobDir:
    job = storage.job(job_of_key(context.partition_key))
    if not job.exists():
        raise dg.Failure(f"job {job.job_id} has not been submitted: materialize validated_input for it first")
    return job


@contextmanager
def _stoppable(job: JobDir) -> Iterator[None]:
    """Stop signals stop the job; a stopped job fails its step for good (retries are for engine
    faults, not for a job that was told to stop). So does an engine that cannot load, and it
    stops the job with that reason: no other step of the job loads it again in vain."""
    try:
        with stopping_on_signals(job):
            yield
    except JobStopped as exc:
        raise dg.Failure(description=f"stopped: {exc}", allow_retries=False) from None
    except ShardTakenOver as exc:  # another attempt has the shard now: nothing to retry here
        raise dg.Failure(description=str(exc), allow_retries=False) from None
    except EngineLoadFailed as exc:
        request_stop(job, str(exc))
        raise dg.Failure(description=str(exc), allow_retries=False) from None
    except (OSError, sqlite3.OperationalError) as exc:  # a full work folder: a retry would fail the same way
        if not _disk_full(exc):
            raise
        where = getattr(exc, "filename", None) or job.root
        raise dg.Failure(
            description=f"cannot write {where}: no space left on its disk; the rows finished so far are kept: "
            "make room and run the same command again to resume",
            allow_retries=False,
        ) from None


def _disk_full(exc: Exception) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return "disk is full" in str(exc) or "disk I/O error" in str(exc)


def _shard(context: dg.AssetExecutionContext, job: JobDir) -> int:
    """The shard of a per-shard step; one the job does not have (a key left by an earlier
    submission of the job with more shards) fails the step with what to do."""
    shard = split_shard_key(context.partition_key)[1]
    count = len(job.manifest().shards)
    if shard >= count:
        raise dg.Failure(
            f"job {job.job_id} has {count} shard(s), 0 to {count - 1}, and no shard {shard}: "
            "run its shards from the job's own partitions",
            allow_retries=False,
        )
    return shard


@dg.asset(
    op_tags=OTHER_STEP,  # the step's resources under ANEX_EXECUTOR=ray
    partitions_def=job_partitions,
    group_name=GROUP,
    kinds={"python"},
    description="Checks every row of the input file and splits the valid rows into shards.",
)
def validated_input(
    context: dg.AssetExecutionContext, config: JobSubmission, storage: StorageResource, engine: EngineResource
) -> Iterator[dg.MaterializeResult | dg.AssetMaterialization]:
    try:
        job = storage.job(context.partition_key)
    except ValueError as exc:  # a key no job folder can have, e.g. one of the work root's own folders
        raise dg.Failure(f"the jobs partition {context.partition_key[:80]!r}: {exc}; add a key of its own") from None
    started = time.monotonic()
    if config.input:
        if not config.output:
            raise dg.Failure("set 'output' in the run config: where the result file goes")
        s3 = storage.s3_client(quick=True) if config.input.startswith("s3://") else None
        try:
            local = localize_input(config.input, job.root / layout.INPUT_DIR, s3)
            options = job_options(config.options.model_dump())
            job = prepare_job(
                local,
                config.output,
                options,
                job.root.parent,
                report=config.report or None,
                job_id=job.job_id,
                local_model=not engine.base_url,
                adapters=engine.lora_modules,
                priority=schedules_by_priority(engine),
                s3_client=storage.s3_client(quick=True) if is_s3(config.output) or is_s3(config.report) else None,
            )
            job.start_clock(options.time_limit_s)  # launched from Dagster: the limit runs from submission
        except JobRejected as exc:
            raise dg.Failure(description=exc.render(), metadata={"problems": exc.total}) from None
    elif not job.exists():
        raise dg.Failure(f"job {job.job_id} is new: set 'input' and 'output' in the run config")
    record_timing(job, "validate", time.monotonic() - started)
    m = job.manifest()
    register_job(context.instance, job.job_id, len(m.shards))
    estimate = estimate_without_sample(job)
    quoted = _quote(context, job, engine) if config.input else {}
    yield dg.MaterializeResult(
        metadata={
            "rows": m.total_rows,
            "shards": len(m.shards),
            "format": m.format,
            "endpoint": m.endpoint,
            "model": m.model_name,
            "input": m.input,
            "output": m.output,
            **quoted,
        }
    )
    if estimate is not None:  # no sample to generate: the estimate is in, with no run of its own
        yield dg.AssetMaterialization(
            asset_key=length_estimate.key, partition=job.job_id, metadata=_estimate_metadata(estimate, {})
        )


def _quote(context: dg.AssetExecutionContext, job: JobDir, engine: EngineResource) -> dict[str, Any]:
    """The submitted job's quote as metadata (``quote``, with its main figures on their own), kept
    for the job's report; a quote that cannot be made is logged and left out (the job goes on)."""
    m = job.manifest()
    if m.total_rows > QUOTE_ROWS:
        return {
            "quote": f"not made at submit for more than {QUOTE_ROWS:,} rows: anex-pipeline validate --quote makes one"
        }
    try:
        quote = make_quote(
            Path(m.input), m.job_options(), job.root.parent, engine.plain(), local_model=not engine.base_url
        )
        save_quote(job.root.parent, job.job_id, quote)
    except Exception as exc:  # the quote only informs: the job was checked already
        context.log.warning(f"no quote for job {job.job_id}: {exc}")
        return {}
    figures = {
        "quote_prompt_tokens": quote.prompt_tokens,
        "quote_output_tokens_expected": quote.output_tokens_expected,
        "quote_output_tokens_cap": quote.output_tokens_cap,
        "quote_engine_seconds": quote.engine_seconds,
        "quote_cost": quote.cost,
    }
    return {
        "quote": dg.MetadataValue.json(quote.model_dump()),
        **{name: value for name, value in figures.items() if value is not None},
    }


@dg.asset(
    op_tags=OTHER_STEP,  # the step's resources under ANEX_EXECUTOR=ray
    partitions_def=shard_partitions,
    deps=[dg.AssetDep(validated_input, partition_mapping=across_jobs_and_shards)],
    group_name=GROUP,
    kinds={"python"},
    description="Downloads the media that the shard's rows reference by URL into the media cache.",
)
def fetched_media(context: dg.AssetExecutionContext, storage: StorageResource) -> dg.MaterializeResult:
    job = _job(context, storage)
    shard = _shard(context, job)
    stats = fetch_media.fetch_shard(job, shard, job.manifest().job_options().media)
    return dg.MaterializeResult(metadata=stats)


@dg.asset(
    op_tags=ENGINE_STEP,  # the step's resources under ANEX_EXECUTOR=ray
    partitions_def=job_partitions,
    deps=[validated_input],
    group_name=GROUP,
    kinds={"vllm"},
    pool="gpu",
    description="Sets max_tokens from a generated sample when the job does not set it.",
)
def length_estimate(
    context: dg.AssetExecutionContext, storage: StorageResource, engine: EngineResource
) -> dg.MaterializeResult:
    job = _job(context, storage)
    manifest = job.manifest()
    started = time.monotonic()
    with _stoppable(job):
        report, stats = estimate_lengths(job, lambda: load_interruptibly(lambda: engine.engine_for(manifest, job)))
    record_timing(job, "estimate", time.monotonic() - started)
    return dg.MaterializeResult(metadata=_estimate_metadata(report, stats))


def _estimate_metadata(report: EstimateReport, stats: dict[str, float]) -> dict[str, Any]:
    metadata: dict[str, Any] = {**report.model_dump(), **stats}
    if "sample_lengths" in stats:
        lengths = json.loads(str(stats["sample_lengths"]))
        metadata["output_length_histogram"] = dg.MetadataValue.md(length_histogram(lengths, report.max_tokens))
    return metadata


@dg.asset(
    op_tags=ENGINE_STEP,  # the step's resources under ANEX_EXECUTOR=ray
    partitions_def=shard_partitions,
    deps=[fetched_media, dg.AssetDep(length_estimate, partition_mapping=across_jobs_and_shards)],
    group_name=GROUP,
    kinds={"vllm"},
    pool="gpu",
    retry_policy=dg.RetryPolicy(max_retries=2, delay=1, backoff=dg.Backoff.EXPONENTIAL),
    description="Generates every row of the shard, resuming from its checkpoint.",
)
def generations(
    context: dg.AssetExecutionContext, storage: StorageResource, engine: EngineResource
) -> dg.MaterializeResult:
    job = _job(context, storage)
    shard = _shard(context, job)
    manifest = job.manifest()

    last_line = [0.0]
    latest = [0, 0, 0]  # the shard's latest rows done, rows and output tokens generated by this step
    generating: list[float] = []  # when the engine was in hand: rates count from there
    first_done = [0]  # rows done by then (earlier runs' rows)

    def tell(done: int, total: int, tokens: int) -> None:
        latest[:] = [done, total, tokens]
        report = ShardProgress(job.job_id, shard, done, total, tokens, waiting=done < total and not generating)
        progress_log.info("shard %s: %d/%d rows", shard, done, total, extra={PROGRESS_FIELD: report})

    last_observed = [0.0]

    def progress(done: int, total: int, tokens: int) -> None:
        tell(done, total, tokens)  # the command's display, at every row
        now = time.monotonic()
        if generating and (now - last_line[0] >= PROGRESS_EVERY_S or done == total):
            last_line[0] = now
            rows_per_s, tokens_per_s = _rates(done - first_done[0], tokens, now - generating[0])
            live = live_progress(job, shard)
            failed = live.failed if live is not None else 0
            context.log.info(
                f"{done}/{total} rows done ({failed} failed), {tokens} tokens generated "
                f"({rows_per_s:.1f} rows/s, {tokens_per_s:.1f} output tok/s)"
            )
            if now - last_observed[0] >= OBSERVE_EVERY_S or done == total:  # on the asset's page, as it goes
                last_observed[0] = now
                figures = {"rows_done": done, "rows": total, "failed": failed, "output_tokens": tokens}
                rates = {"rows_per_s": round(rows_per_s, 3), "output_tokens_per_s": round(tokens_per_s, 3)}
                context.log_event(
                    dg.AssetObservation(
                        asset_key=context.asset_key, partition=context.partition_key, metadata={**figures, **rates}
                    )
                )

    def engine_in_hand() -> Any:
        loaded = engine.engine_for(manifest, job)
        generating.append(time.monotonic())
        first_done[0] = latest[0]
        tell(*latest)  # generation starts now
        return loaded

    store = open_store(job, engine.plain())
    try:
        with _stoppable(job):
            summary = run_shard(job, shard, engine_in_hand, progress=progress, store=store)
    finally:
        if store is not None:
            store.close()
    generation_s = summary.seconds - summary.engine_wait_s
    record_timing(job, "engine_wait", summary.engine_wait_s)
    record_timing(job, "generate", generation_s)
    host = socket.gethostname()
    # Rows the HTTP engine sent count under their model server; the in-process engine's under this host.
    record_served(job, dict(summary.served_by) or ({host: summary.generated} if summary.generated else {}))
    rows_per_s, tokens_per_s = _rates(latest[0] - first_done[0], latest[2], generation_s)
    figures = {
        **summary.as_metadata(),
        "host": host,
        "generation_s": round(generation_s, 3),
        "rows_per_s": round(rows_per_s, 3),
        "output_tokens_per_s": round(tokens_per_s, 3),
    }
    context.log.info(_figures_line(figures))
    return dg.MaterializeResult(metadata=figures)


def _rates(rows: int, tokens: int, seconds: float) -> tuple[float, float]:
    """Rows/s and output tok/s over ``seconds`` of generation (0 for none)."""
    return (rows / seconds, tokens / seconds) if seconds > 0 else (0.0, 0.0)


def _figures_line(f: dict[str, Any]) -> str:
    """A generation step's figures in one line for the run log, as its materialization has them."""
    errors = ", ".join(f"{n} {kind}" for kind, n in f["error_counts"].items()) or "none"
    return (
        f"{f['completed']} of {f['rows']} rows completed, {f['failed']} failed, {f['format_errors']} format errors "
        f"(errors: {errors}); {f['prompt_tokens']} prompt tokens ({f['cached_prompt_tokens']} cached), "
        f"{f['completion_tokens']} completion tokens; engine wait {f['engine_wait_s']:.1f} s, "
        f"generation {f['generation_s']:.1f} s; {f['rows_per_s']:.1f} rows/s, "
        f"{f['output_tokens_per_s']:.1f} output tok/s"
    )


@dg.asset(
    op_tags=OTHER_STEP,  # the step's resources under ANEX_EXECUTOR=ray
    partitions_def=job_partitions,
    deps=[dg.AssetDep(generations, partition_mapping=across_jobs_and_shards)],
    group_name=GROUP,
    kinds={"python"},
    description="Joins the shard checkpoints in input order and writes the job report.",
    check_specs=[
        dg.AssetCheckSpec(
            "rows_accounted_once",
            asset="merged_result",
            description="Every input row is in the result once, in input order (fewer only if the job stopped early).",
        )
    ],
)
def merged_result(context: dg.AssetExecutionContext, storage: StorageResource) -> dg.MaterializeResult:
    job = _job(context, storage)
    report = merge_job(job)
    account = account_rows(job, job.result_path)
    check = dg.AssetCheckResult(
        check_name="rows_accounted_once",
        passed=account.ok
        and account.missing
        == report.request_counts.total - report.request_counts.completed - report.request_counts.failed,
        metadata=account.as_metadata(),
        description=account.summary(),
    )
    return dg.MaterializeResult(metadata=report_metadata(report, job.result_path), check_results=[check])


@dg.asset(
    op_tags=OTHER_STEP,  # the step's resources under ANEX_EXECUTOR=ray
    partitions_def=job_partitions,
    deps=[merged_result],
    group_name=GROUP,
    kinds={"python"},
    description="Publishes the result file and its report to the job's output location.",
)
def result_file(context: dg.AssetExecutionContext, storage: StorageResource) -> dg.MaterializeResult:
    job = _job(context, storage)
    report, where = publish_job(job, storage.s3_client)
    return dg.MaterializeResult(metadata={**report_metadata(report, where), "report_path": job.manifest().report})


def report_metadata(report: JobReport, where: object) -> dict[str, Any]:
    counts = report.request_counts
    return {
        "status": report.status,
        "failure_reason": report.failure_reason or "",
        "rows": counts.total,
        "completed": counts.completed,
        "failed": counts.failed,
        "format_error_rows": counts.format_error_rows,
        "error_counts": report.error_counts,
        "prompt_tokens": report.usage.prompt_tokens,
        "cached_prompt_tokens": report.usage.cached_prompt_tokens,
        "completion_tokens": report.usage.completion_tokens,
        "rows_per_s": report.throughput.rows_per_s,
        "output_tokens_per_s": report.throughput.output_tokens_per_s,
        **({"cost": report.cost} if report.cost is not None else {}),
        "result": dg.MetadataValue.path(str(where)),
        "report": dg.MetadataValue.json(report.model_dump()),
        "output_lengths": dg.MetadataValue.md(_length_table(report)),
    }


def _length_table(report: JobReport) -> str:
    """Output tokens of the completed rows, as a small Markdown table for the asset's page."""
    lengths = report.output_tokens
    if not lengths:
        return "no completed rows"
    header = "| " + " | ".join(lengths) + " |"
    return "\n".join([header, "|" + "---|" * len(lengths), "| " + " | ".join(str(v) for v in lengths.values()) + " |"])


all_assets = [validated_input, fetched_media, length_estimate, generations, merged_result, result_file]
