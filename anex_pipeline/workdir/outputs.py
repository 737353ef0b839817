"""What the stages leave in a job's folder for the stages after them, and for the report: the
length estimate and the sample answers it generated, the rows the media stage failed, and the rows
answered from the work folder's answer store. Each stage writes these; this module is where every
later stage reads them, so no stage needs to import another."""

from __future__ import annotations

from collections.abc import Iterable

from anex_pipeline.errors import RowErrorType
from anex_pipeline.formats.jsonl_checkpoint import read_outcomes
from anex_pipeline.spec import EstimateReport, RowOutcome
from anex_pipeline.workdir import layout
from anex_pipeline.workdir.manifest import JobDir


def read_estimate(job: JobDir) -> EstimateReport:
    if not job.estimate_path.exists():
        return EstimateReport(method="no estimate was made")
    return EstimateReport.model_validate_json(job.estimate_path.read_text())


def reusable_samples(job: JobDir, estimate: EstimateReport, start: int, stop: int) -> dict[int, RowOutcome]:
    """Sample answers in rows [start, stop) that stand as the real run's answers: within the cap now
    in force and under the thinking budget. An answer cut at the sample's cap is one too when that
    cap is the one in force (the estimate falls back to the sample's cap whenever an answer was
    cut): the real run would stop at the same token, so generating it again buys nothing."""
    if not job.sample_path.exists():
        return {}
    cap = estimate.max_tokens if estimate.max_tokens is not None else job.manifest().job_options().max_tokens
    return {
        i: o
        for i, o in read_outcomes(job.sample_path).items()
        if start <= i < stop
        and o.ok
        and (o.completion_flag != RowErrorType.LENGTH or cap is not None)
        and (cap is None or o.usage.get("completion_tokens", 0) <= cap)
        and (estimate.reasoning_budget is None or o.usage.get("reasoning_tokens", 0) < estimate.reasoning_budget)
    }


def recorded_failures(job: JobDir, shard: int) -> dict[int, RowOutcome]:
    """The rows the media stage failed for this shard, by row index."""
    return read_outcomes(job.media_failures_path(shard))


def note_served(job: JobDir, shard: int, rows: Iterable[int]) -> None:
    """Notes the rows of a shard that were answered from the store, for the report."""
    with (job.shard_dir(shard) / layout.FROM_EARLIER_JOBS).open("a", encoding="utf-8") as f:
        f.write("".join(f"{i}\n" for i in rows))


def served_rows(job: JobDir, shards: int) -> int:
    """The job's rows whose answer in the result came from the store: noted as served from it and
    still holding a copied answer (a row generated again later, after a failed write, does not count)."""
    count = 0
    for shard in range(shards):
        path = job.shard_dir(shard) / layout.FROM_EARLIER_JOBS
        if path.exists():
            noted = {int(line) for line in path.read_text(encoding="utf-8").split()}
            count += sum(1 for o in job.outcomes(shard) if o.i in noted and o.reused)
    return count


def note_dropped(job: JobDir, shard: int, count: int) -> None:
    """Notes how many unreadable stored answers a shard's look-ups found (and removed), for the report."""
    if count:
        with (job.shard_dir(shard) / layout.STORE_DROPPED).open("a", encoding="utf-8") as f:
            f.write(f"{count}\n")


def dropped_entries(job: JobDir, shards: int) -> int:
    """Unreadable stored answers the job's shards found and removed."""
    paths = (job.shard_dir(shard) / layout.STORE_DROPPED for shard in range(shards))
    return sum(int(n) for path in paths if path.exists() for n in path.read_text(encoding="utf-8").split())
