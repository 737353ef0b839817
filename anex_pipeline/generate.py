"""Generation of one shard, resumable: finished rows go to the shard's checkpoint as they finish,
and a rerun (or a resume after a crash) only runs rows that are missing or failed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from anex_pipeline import media
from anex_pipeline.engine.base import Engine, resolve_request, run_checked
from anex_pipeline.estimate import read_estimate, reusable_samples
from anex_pipeline.jobs import JobDir, append_outcomes
from anex_pipeline.spec import RowOutcome

Progress = Callable[[int, int], None]


class JobStopped(Exception):
    """The job was asked to stop (cancelled or out of time); finished rows are kept."""


@dataclass
class ShardSummary:
    shard: int
    rows: int = 0
    completed: int = 0
    failed: int = 0
    format_errors: int = 0
    kept_from_earlier_runs: int = 0
    reused_from_sample: int = 0
    generated: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def as_metadata(self) -> dict[str, float | int]:
        return {k: v for k, v in asdict(self).items() if k != "shard"}


def run_shard(
    job: JobDir,
    shard: int,
    engine_for: Callable[[], Engine],
    *,
    chunk_rows: int | None = None,
    progress: Progress | None = None,
) -> ShardSummary:
    """Brings every row of the shard to an outcome; returns what was done."""
    started = time.monotonic()
    manifest = job.manifest()
    options = manifest.job_options()
    rng = manifest.shards[shard]
    estimate = read_estimate(job)
    max_tokens = options.max_tokens or estimate.max_tokens
    budget = options.reasoning_budget if options.reasoning_budget is not None else estimate.reasoning_budget
    summary = ShardSummary(shard=shard, rows=rng.size)

    finished = {i: o for i, o in job.read_checkpoint(shard).items() if o.ok}
    summary.kept_from_earlier_runs = len(finished)
    samples = {i: o for i, o in reusable_samples(job, estimate, rng.start, rng.stop).items() if i not in finished}
    if samples:
        append_outcomes(job.checkpoint_path(shard), samples.values())
        finished.update(samples)
        summary.reused_from_sample = len(samples)

    todo = [row for row in job.read_requests(shard) if row.index not in finished]
    media_failures = media.recorded_failures(job, shard)
    done = len(finished)
    if progress:
        progress(done, rng.size)
    chunk_rows = chunk_rows or options.checkpoint_rows
    for start in range(0, len(todo), chunk_rows):
        late = job.out_of_time()
        if late and not job.stop_path.exists():
            job.record_stop(late)
        if job.stop_path.exists():
            raise JobStopped(json.loads(job.stop_path.read_text())["reason"])
        chunk = todo[start : start + chunk_rows]
        chunk, failed = media.attach_media(chunk, options.media, media_failures)
        requests = [resolve_request(r, manifest.job_id, manifest.endpoint, options, max_tokens, budget) for r in chunk]
        outcomes = (run_checked(engine_for(), requests) if requests else []) + failed
        append_outcomes(job.checkpoint_path(shard), outcomes)
        summary.generated += len(outcomes)
        done += len(outcomes)
        if progress:
            progress(done, rng.size)

    _count(summary, job.read_checkpoint(shard).values())
    summary.seconds = round(time.monotonic() - started, 3)
    return summary


def _count(summary: ShardSummary, outcomes: Iterable[RowOutcome]) -> None:
    for o in outcomes:
        if o.ok:
            summary.completed += 1
            summary.format_errors += int(o.format_error)
        else:
            summary.failed += 1
        summary.prompt_tokens += o.usage.get("prompt_tokens", 0)
        summary.completion_tokens += o.usage.get("completion_tokens", 0)
