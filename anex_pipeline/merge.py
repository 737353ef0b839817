"""Merging a job's shard checkpoints into one result file, and the job report (SPEC sections 3, 4)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from anex_pipeline.estimate import read_estimate
from anex_pipeline.formats import jsonl, parquet
from anex_pipeline.jobs import JobDir, JobManifest, atomic_write_text
from anex_pipeline.spec import JobReport, JobStatus, RequestCounts, RowOutcome, Throughput, Usage


def record_timing(job: JobDir, stage: str, seconds: float) -> None:
    """Adds a stage's seconds to the job's timings (summed over shards and reruns)."""
    path = job.root / "timings.json"
    timings = json.loads(path.read_text()) if path.exists() else {}
    timings[stage] = round(timings.get(stage, 0.0) + seconds, 3)
    atomic_write_text(path, json.dumps(timings, indent=2))


def read_timings(job: JobDir) -> dict[str, float]:
    path = job.root / "timings.json"
    return json.loads(path.read_text()) if path.exists() else {}


class _Tally:
    """Counts rows and tokens as the merge streams past them (plain counters: this is a hot loop)."""

    USAGE_KEYS = ("prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_prompt_tokens")

    def __init__(self) -> None:
        self.rows: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.lengths: Counter[int] = Counter()  # completion tokens -> rows: bounded by the cap

    def add(self, o: RowOutcome) -> RowOutcome:
        if o.error is None:
            self.rows["completed"] += 1
            self.lengths[o.usage.get("completion_tokens", 0)] += 1
            self.rows["format_error_rows"] += o.format_error
        else:
            self.rows["failed"] += 1
            self.errors[o.error.type] += 1
        if o.completion_flag:
            self.errors[o.completion_flag] += 1
        for key in self.USAGE_KEYS:
            self.tokens[key] += o.usage.get(key, 0)
        return o

    @property
    def counts(self) -> RequestCounts:
        return RequestCounts(**self.rows)

    @property
    def usage(self) -> Usage:
        return Usage(**self.tokens)

    def length_percentiles(self) -> dict[str, int]:
        total = sum(self.lengths.values())
        if not total:
            return {}
        wanted = {"p50": 0.5, "p90": 0.9, "p95": 0.95, "p99": 0.99}
        found: dict[str, int] = {}
        seen = 0
        for length in sorted(self.lengths):
            seen += self.lengths[length]
            for name, q in wanted.items():
                if name not in found and seen >= q * total:
                    found[name] = length
        found["max"] = max(self.lengths)
        return found


def _ordered(job: JobDir, manifest: JobManifest, tally: _Tally) -> Iterator[RowOutcome]:
    for shard, rng in enumerate(manifest.shards):
        outcomes = job.read_checkpoint(shard)
        for i in range(rng.start, rng.stop):
            if i in outcomes:
                yield tally.add(outcomes[i])


def result_path(job: JobDir) -> Path:
    manifest = job.manifest()
    return job.root / f"result.{manifest.format}"


def merge_job(job: JobDir) -> JobReport:
    """Writes the merged result into the work folder (atomically) and returns the report."""
    started = time.monotonic()
    manifest = job.manifest()
    final = result_path(job)
    partial = final.with_name(f".{final.name}.partial")
    tally = _Tally()
    rows = _ordered(job, manifest, tally)
    if manifest.format == "jsonl":
        jsonl.write_results(partial, rows)
    else:
        parquet.write_results(Path(manifest.input), partial, rows, manifest.endpoint)
    partial.replace(final)
    record_timing(job, "merge", time.monotonic() - started)
    report = build_report(job, manifest, tally)
    atomic_write_text(job.root / "report.json", report.model_dump_json(indent=2))
    return report


def build_report(job: JobDir, manifest: JobManifest, tally: _Tally) -> JobReport:
    counts = tally.counts
    counts.total = manifest.total_rows
    usage = tally.usage
    delivered = counts.completed + counts.failed
    status: JobStatus = "completed"
    reason = None
    if delivered < counts.total:
        stop = json.loads(job.stop_path.read_text())["reason"] if job.stop_path.exists() else None
        missing = counts.total - delivered
        reason = stop or f"{missing} of {counts.total} rows have no result: their shards did not finish"
        status = "stopped_early" if delivered else "failed"
    timings = read_timings(job)
    busy = timings.get("generate", 0.0) + timings.get("estimate", 0.0)
    throughput = Throughput(
        rows_per_s=round(delivered / busy, 3) if busy else 0.0,
        output_tokens_per_s=round(usage.completion_tokens / busy, 3) if busy else 0.0,
    )
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
        cost=_cost(manifest, usage),
    )


def _cost(manifest: JobManifest, usage: Usage) -> float | None:
    prices = manifest.job_options().prices
    if prices is None:
        return None
    cached = usage.cached_prompt_tokens if prices.cached_input_per_1k is not None else 0
    total = (usage.prompt_tokens - cached) / 1000 * prices.input_per_1k
    total += cached / 1000 * (prices.cached_input_per_1k or 0.0)
    total += usage.completion_tokens / 1000 * prices.output_per_1k
    return round(total, 6)
