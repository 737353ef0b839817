"""Merging a job's shard checkpoints into one result file, and the job report."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.compute as pc

from anex_pipeline.formats import StoredOutcome, jsonl, write_error
from anex_pipeline.formats.registry import FORMATS
from anex_pipeline.spec import JobReport, JobStatus, RequestCounts, Throughput, Usage
from anex_pipeline.stages.estimate import read_estimate, reusable_samples
from anex_pipeline.workdir import layout
from anex_pipeline.workdir.manifest import JobDir, JobManifest, atomic_write_text
from anex_pipeline.workdir.timing import read_engine, read_served, read_timings, record_timing

PARALLEL_MERGE_ROWS = 100_000  # a JSONL job this big is merged by one process per core


class RowTally:
    """Counts rows and tokens as the merge streams past them (plain attributes: this is a hot loop)."""

    def __init__(self) -> None:
        self.completed = self.failed = self.format_error_rows = self.reused = 0
        self.prompt_tokens = self.completion_tokens = self.reasoning_tokens = self.cached_prompt_tokens = 0
        self.errors: Counter[str] = Counter()
        self.lengths: Counter[int] = Counter()  # completion tokens -> rows: bounded by the cap

    def add(self, o: StoredOutcome) -> StoredOutcome:
        usage = o.usage
        if o.error is not None:
            self.failed += 1
            self.errors[o.error_type] += 1
        else:
            self.completed += 1
            self.lengths[usage.completion_tokens] += 1
            self.format_error_rows += o.format_error
        if o.flag:
            self.errors[o.flag] += 1
        self.reused += o.reused
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.reasoning_tokens += usage.reasoning_tokens
        self.cached_prompt_tokens += usage.cached_prompt_tokens
        return o

    def add_answers(self, table: pa.Table) -> pa.Table:
        """Counts a Parquet job's checkpoint table (:meth:`JobDir.answers`) column-wise."""
        failed = pc.is_valid(table.column("error"))
        succeeded = pc.invert(failed)
        failures = _int(pc.sum(failed))
        self.failed += failures
        self.completed += table.num_rows - failures
        self.format_error_rows += _int(pc.sum(pc.and_(table.column("format_error"), succeeded)))
        self.reused += _int(pc.sum(table.column("reused")))
        for kinds in (pc.filter(table.column("error_type"), failed), table.column("flag")):
            self.errors.update(_value_counts(kinds))
        self.lengths.update(_value_counts(pc.filter(table.column("completion_tokens"), succeeded)))
        self.prompt_tokens += _int(pc.sum(table.column("prompt_tokens")))
        self.completion_tokens += _int(pc.sum(table.column("completion_tokens")))
        self.reasoning_tokens += _int(pc.sum(table.column("reasoning_tokens")))
        self.cached_prompt_tokens += _int(pc.sum(table.column("cached_prompt_tokens")))
        return table

    def absorb(self, other: RowTally) -> None:
        """Adds the counts of another part of the same job."""
        for name, value in vars(other).items():
            if isinstance(value, Counter):
                getattr(self, name).update(value)
            else:
                setattr(self, name, getattr(self, name) + value)

    @property
    def counts(self) -> RequestCounts:
        return RequestCounts(completed=self.completed, failed=self.failed, format_error_rows=self.format_error_rows)

    @property
    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            reasoning_tokens=self.reasoning_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
        )

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


def _int(scalar: pa.Scalar) -> int:
    return scalar.as_py() or 0  # the sum of nothing is null


def _value_counts(values: pa.ChunkedArray) -> dict[Any, int]:
    counted = pc.value_counts(values.drop_null())
    return dict(zip(counted.field("values").to_pylist(), counted.field("counts").to_pylist(), strict=True))


def _write_jsonl(job: JobDir, manifest: JobManifest, path: Path, tally: RowTally) -> None:
    """Writes a JSONL job's result: a big job's shards by one process per core, each into a part
    file that is then appended to the result in shard order; a small one's in this process."""
    shards = range(len(manifest.shards))
    workers = min(os.cpu_count() or 1, len(shards))
    if manifest.total_rows < PARALLEL_MERGE_ROWS or workers < 2:
        for shard in shards:
            tally.absorb(_write_part(job, shard, path, append=shard > 0))
        return
    parts = [path.with_name(f"{path.name}.{shard}") for shard in shards]
    try:
        # fork: the workers need no imports, and they only read checkpoints and write their part
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            for counted in pool.map(_write_part, [job] * len(parts), shards, parts):
                tally.absorb(counted)
        with path.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    _copy(f, out)
    finally:
        for part in parts:
            part.unlink(missing_ok=True)


def _copy(source: BinaryIO, target: BinaryIO) -> None:
    """Appends one file to another, inside the kernel where the filesystem allows it."""
    left = os.fstat(source.fileno()).st_size
    try:
        while left:
            left -= os.copy_file_range(source.fileno(), target.fileno(), left)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        shutil.copyfileobj(source, target, 1 << 20)


def _write_part(job: JobDir, shard: int, path: Path, append: bool = False) -> RowTally:
    """Writes the result lines of one shard's finished rows, in input order; returns their tally."""
    tally = RowTally()
    add = tally.add
    jsonl.write_results(path, (add(outcome) for outcome in job.outcomes(shard)), append=append)
    return tally


def _answer_tables(job: JobDir, manifest: JobManifest, tally: RowTally) -> Iterator[pa.Table]:
    """A Parquet job's checkpoint tables in input order, counted on the way."""
    for shard in range(len(manifest.shards)):
        for table in job.answers(shard):
            yield tally.add_answers(table)


def result_path(job: JobDir) -> Path:
    manifest = job.manifest()
    return job.root / f"{layout.RESULT_STEM}.{manifest.format}"


def merge_job(job: JobDir) -> JobReport:
    """Writes the merged result into the work folder (atomically) and returns the report."""
    started = time.monotonic()
    manifest = job.manifest()
    final = result_path(job)
    partial = final.with_name(f".{final.name}.partial")
    tally = RowTally()
    try:
        module = FORMATS[manifest.format]
        if module.MERGES_COLUMNS:
            answers = _answer_tables(job, manifest, tally)
            module.write_results(Path(manifest.input), partial, answers, manifest.endpoint, manifest.job_options())
        else:
            _write_jsonl(job, manifest, partial, tally)
        partial.replace(final)
    except OSError as exc:  # e.g. a full disk: leave no half-written result behind
        partial.unlink(missing_ok=True)
        raise write_error(exc, final) from exc
    record_timing(job, "merge", time.monotonic() - started)
    report = build_report(job, manifest, tally)
    atomic_write_text(job.report_path, report.model_dump_json(indent=2))
    return report


def nothing_delivered(counts: RequestCounts) -> bool:
    """True for a job with input rows none of which has a result (not even an error): its result
    file is empty and is not published in place of the result."""
    return counts.total > 0 and counts.completed + counts.failed == 0


def build_report(job: JobDir, manifest: JobManifest, tally: RowTally) -> JobReport:
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
        status = "stopped_early"
        if nothing_delivered(counts):
            status, reason = "failed", f"{reason}; no row has a result, so no result file is published"
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
        reused_answer_rows=tally.reused,
        reused_sample_rows=_reused_sample_rows(job, manifest),
        rows_by_model=manifest.rows_by_model,
        served_by=read_served(job),
        engine=read_engine(job),
        cost=_cost(manifest, usage),
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
    cached = usage.cached_prompt_tokens if prices.cached_input_per_1k is not None else 0
    total = (usage.prompt_tokens - cached) / 1000 * prices.input_per_1k
    total += cached / 1000 * (prices.cached_input_per_1k or 0.0)
    total += usage.completion_tokens / 1000 * prices.output_per_1k
    return round(total, 6)
