"""Generation of one shard, resumable: finished rows go to the shard's checkpoint as they finish,
and a rerun (or a resume after a crash) only runs rows that are missing or failed.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing
from dataclasses import asdict, dataclass

from anex_pipeline import media
from anex_pipeline.answer_book import AnswerBook, copy_for, fingerprint
from anex_pipeline.engine.base import Engine, EngineRequest, resolve_request, stream_checked
from anex_pipeline.estimate import read_estimate, reusable_samples
from anex_pipeline.formats import InputRow, StoredOutcome
from anex_pipeline.jobs import JobDir, JobManifest
from anex_pipeline.spec import EstimateReport, RowOutcome

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
    reused_identical: int = 0  # rows answered with the answer of an identical deterministic row
    generated: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0  # the whole step, the engine's loading included
    engine_wait_s: float = 0.0  # waiting for the engine to load (it may have started loading earlier)

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
    summary = ShardSummary(shard=shard, rows=rng.size)

    finished = job.finished_rows(shard)
    summary.kept_from_earlier_runs = len(finished)
    samples = {i: o for i, o in reusable_samples(job, estimate, rng.start, rng.stop).items() if i not in finished}
    if samples:
        job.record_outcomes(shard, samples.values())
        finished.update(samples)
        summary.reused_from_sample = len(samples)

    todo = (row for row in job.read_requests(shard) if row.index not in finished)
    group_rows = chunk_rows or options.checkpoint_rows
    done = len(finished)
    if progress:
        progress(done, rng.size)
    _stop_if_asked(job)
    feed = _Feed(job, shard, manifest, estimate, todo, group_rows, summary)

    def engine() -> Engine:
        asked = time.monotonic()
        loaded = engine_for()
        summary.engine_wait_s = round(time.monotonic() - asked, 3)
        return loaded

    try:
        with closing(stream_checked(engine, feed.requests, group_rows)) as groups:
            for group in itertools.chain(groups, [[]]):  # the empty group delivers what is left
                outcomes = feed.delivered(group)
                if outcomes:
                    job.record_outcomes(shard, outcomes)
                    done += len(outcomes)
                    if progress:
                        progress(done, rng.size)
                _stop_if_asked(job)
    finally:
        feed.close()

    _count(summary, job.outcomes(shard))
    summary.seconds = round(time.monotonic() - started, 3)
    return summary


class _Feed:
    """The shard's rows on their way to the engine: media attached, requests resolved, and rows
    identical to one already answered or in flight held back for a copy of its answer."""

    def __init__(
        self,
        job: JobDir,
        shard: int,
        manifest: JobManifest,
        estimate: EstimateReport,
        todo: Iterator[InputRow],
        group_rows: int,
        summary: ShardSummary,
    ):
        self.job, self.shard, self.todo, self.group_rows, self.summary = job, shard, todo, group_rows, summary
        self.manifest = manifest
        self.options = manifest.job_options()
        self.max_tokens = self.options.max_tokens or estimate.max_tokens
        given = self.options.reasoning_budget
        self.budget = given if given is not None else estimate.reasoning_budget
        self.book = AnswerBook(job)
        self.waiting: dict[str, list[EngineRequest]] = {}  # fingerprint -> rows waiting for its answer
        self.asked: dict[int, str] = {}  # row index -> fingerprint, for deterministic rows sent
        self.found: list[RowOutcome] = []  # outcomes that needed no engine (copies, media failures)
        self.requests = self._requests()

    def _requests(self) -> Iterator[EngineRequest]:
        media_failures = media.recorded_failures(self.job, self.shard)
        m = self.manifest
        while rows := list(itertools.islice(self.todo, self.group_rows)):
            chunk, failed = media.attach_media(rows, self.options.media, media_failures)
            self.found.extend(failed)
            for row in chunk:
                req = resolve_request(row, m.job_id, m.endpoint, self.options, self.max_tokens, self.budget)
                key = fingerprint(req) if self.options.reuse_answers else None
                if key is None:
                    yield req
                elif (known := self.book.get(key)) is not None:
                    self.found.append(copy_for(known, req))
                    self.summary.reused_identical += 1
                elif key in self.waiting:
                    self.waiting[key].append(req)
                    self.summary.reused_identical += 1
                else:
                    self.waiting[key] = []
                    self.asked[req.index] = key
                    yield req

    def delivered(self, group: list[RowOutcome]) -> list[RowOutcome]:
        """The engine's finished rows plus the copies of their answers and what needed no engine."""
        answered = [(self.asked.pop(o.index), o) for o in group if o.index in self.asked]
        self.book.add(answered)
        copies = [copy_for(o, req) for key, o in answered for req in self.waiting.pop(key)]
        self.summary.generated += len(group)
        extra, self.found = self.found, []
        return group + copies + extra

    def close(self) -> None:
        self.book.close()


def _stop_if_asked(job: JobDir) -> None:
    """Raises JobStopped when the job was cancelled or ran out of its time limit."""
    late = job.out_of_time()
    if late and not job.stop_path.exists():
        job.record_stop(late)
    if job.stop_path.exists():
        raise JobStopped(json.loads(job.stop_path.read_text())["reason"])


def _count(summary: ShardSummary, outcomes: Iterable[StoredOutcome]) -> None:
    for o in outcomes:
        if o.failed:
            summary.failed += 1
        else:
            summary.completed += 1
            summary.format_errors += int(o.format_error)
        summary.prompt_tokens += o.usage.prompt_tokens
        summary.completion_tokens += o.usage.completion_tokens
