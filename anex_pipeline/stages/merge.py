"""Merging a job's shard checkpoints into one result file, and writing its report (built by
:mod:`anex_pipeline.stages.report`)."""

from __future__ import annotations

import time
from pathlib import Path

from anex_pipeline.formats import write_error
from anex_pipeline.formats.base import MergeInput, ShardCheckpoint
from anex_pipeline.formats.registry import FORMATS
from anex_pipeline.spec import JobReport
from anex_pipeline.stages.report import build_report
from anex_pipeline.workdir.manifest import JobDir, JobManifest, atomic_write_text
from anex_pipeline.workdir.tally import RowTally
from anex_pipeline.workdir.timing import record_timing


def merge_input(job: JobDir, manifest: JobManifest, checkpoints: list[Path] | None = None) -> MergeInput:
    """What the job's format merges: its input, endpoint, options and shard checkpoints
    (``checkpoints``: copies of them to read instead, in shard order)."""
    paths = checkpoints or [job.checkpoint_path(n, manifest) for n in range(len(manifest.shards))]
    shards = [ShardCheckpoint(path, rng.start, rng.stop) for path, rng in zip(paths, manifest.shards, strict=True)]
    return MergeInput(Path(manifest.input), manifest.endpoint, manifest.job_options(), shards)


def merge_job(job: JobDir) -> JobReport:
    """Writes the merged result into the work folder (atomically) and returns the report."""
    started = time.monotonic()
    manifest = job.manifest()
    final = job.result_path
    partial = final.with_name(f".{final.name}.partial")
    tally = RowTally()
    try:
        FORMATS[manifest.format].merge(merge_input(job, manifest), partial, tally)
        partial.replace(final)
    except OSError as exc:  # e.g. a full disk: leave no half-written result behind
        partial.unlink(missing_ok=True)
        raise write_error(exc, final) from exc
    record_timing(job, "merge", time.monotonic() - started)
    report = build_report(job, manifest, tally)
    atomic_write_text(job.report_path, report.model_dump_json(indent=2))
    return report
