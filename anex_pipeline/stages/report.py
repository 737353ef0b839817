"""The job report: what the merge counted, the job's stop reason, estimate, timings and cost,
as one :class:`~anex_pipeline.spec.JobReport`. The merge writes it into the work folder, where
:meth:`~anex_pipeline.workdir.manifest.JobDir.report` reads it back."""

from __future__ import annotations

from anex_pipeline.spec import JobReport, JobStatus, QuoteCheck, Throughput, Usage
from anex_pipeline.workdir.manifest import JobDir, JobManifest
from anex_pipeline.workdir.outputs import dropped_entries, read_estimate, reusable_samples, served_rows
from anex_pipeline.workdir.quotes import read_quote
from anex_pipeline.workdir.tally import RowTally
from anex_pipeline.workdir.timing import read_engine, read_served, read_timings


def build_report(job: JobDir, manifest: JobManifest, tally: RowTally) -> JobReport:
    """The report of the job whose checkpoints the merge counted into ``tally``: completed when
    every row has a result, else stopped early (failed when none has), with the stop's reason."""
    counts = tally.counts
    counts.total = manifest.total_rows
    usage = tally.usage
    delivered = counts.completed + counts.failed
    status: JobStatus = "completed"
    reason = None
    if delivered < counts.total:
        stop = job.stop_reason()
        missing = counts.total - delivered
        reason = stop or f"{missing} of {counts.total} rows have no result: their shards did not finish"
        status = "stopped_early"
        if counts.nothing_delivered():
            status, reason = "failed", f"{reason}; no row has a result, so no result file is published"
    timings = read_timings(job)
    busy = timings.get("generate", 0.0) + timings.get("estimate", 0.0)
    throughput = Throughput(
        rows_per_s=round(delivered / busy, 3) if busy else 0.0,
        output_tokens_per_s=round(usage.completion_tokens / busy, 3) if busy else 0.0,
    )
    from_earlier_jobs = served_rows(job, len(manifest.shards))
    cost = _cost(manifest, usage)
    quoted = read_quote(job)
    return JobReport(
        job_id=manifest.job_id,
        status=status,
        failure_reason=reason,
        input=manifest.input,
        output=manifest.output,
        model=manifest.model_name,
        endpoint=manifest.endpoint,
        request_counts=counts,
        error_counts=dict(tally.errors),
        usage=usage,
        estimate=read_estimate(job),
        timings=timings,
        throughput=throughput,
        output_tokens=tally.length_percentiles(),
        reused_answer_rows=tally.reused - from_earlier_jobs,  # the copies made within the job
        reused_from_earlier_jobs=from_earlier_jobs,
        unreadable_stored_answers=dropped_entries(job, len(manifest.shards)),
        reused_sample_rows=_reused_sample_rows(job, manifest),
        rows_by_model=manifest.rows_by_model,
        served_by=read_served(job),
        engine=read_engine(job),
        cost=cost,
        quote=None
        if quoted is None
        else QuoteCheck(
            quoted=quoted,
            prompt_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens,
            engine_seconds=round(busy, 3),
            cost=cost,
        ),
    )


def _reused_sample_rows(job: JobDir, manifest: JobManifest) -> int:
    """Sample answers that stand as their rows' answers, in the shards that have run."""
    reused = reusable_samples(job, read_estimate(job), 0, manifest.total_rows)
    ran = [rng for shard, rng in enumerate(manifest.shards) if job.checkpoint_path(shard, manifest).exists()]
    return sum(1 for i in reused if any(rng.start <= i < rng.stop for rng in ran))


def _cost(manifest: JobManifest, usage: Usage) -> float | None:
    prices = manifest.job_options().prices
    if prices is None:
        return None
    return prices.cost(usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens)
