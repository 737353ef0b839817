"""Keeping what jobs leave behind in check: list the jobs of a work root, delete one, prune old ones.

A job leaves a work folder (shards, checkpoints, its report) and, in the Dagster instance, a key
of the ``jobs`` dynamic partition and one ``shards`` key per shard, with the runs and
materializations of its steps. Deleting a job removes all three; the result file it delivered is
never touched. Open-source Dagster cannot wipe the materializations of single partitions, so they
go with the job's runs (deleting a run deletes its events). A job is running while a process holds
its lease or a run of it is in flight; it is then never deleted.

Pruning also removes the Batch API's expired files, and the job of a finished batch once every
file the batch delivered is gone.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg

from anex_pipeline.batch_api.objects import FileRecord
from anex_pipeline.batch_api.store import Store
from anex_pipeline.errors import RejectedError
from anex_pipeline.orchestration.partitions import forget_job, shard_keys_on
from anex_pipeline.orchestration.runs import IN_FLIGHT, LAUNCHED_BY_TAG, job_of_run, runs_of_job
from anex_pipeline.spec import JobReport
from anex_pipeline.workdir.lease import driven_by_cli, try_lease
from anex_pipeline.workdir.manifest import JobDir

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*")


def parse_age(text: str) -> float:
    """Seconds in a duration like ``90s``, ``15m``, ``12h`` or ``7d``; ValueError otherwise."""
    found = DURATION.fullmatch(text)
    if found is None:
        raise ValueError(f"{text!r} is not an age: write a number and a unit s, m, h or d, e.g. 7d or 12h")
    return float(found[1]) * UNITS[found[2]]


class JobRunning(RejectedError):
    """The job is running, so it is left alone."""


@dataclass(frozen=True)
class JobEntry:
    """One job of a work root, as ``list`` shows it."""

    job_id: str
    status: str  # the report's status once finished; "running" or "unfinished" before
    rows: int
    last_activity: float  # seconds since the epoch: the newest change in its work folder
    output: str

    def as_json(self, at: float) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "status": self.status,
            "rows": self.rows,
            "age_s": round(at - self.last_activity, 1),
            "last_activity": self.last_activity,
            "output": self.output,
        }


def last_activity(root: Path) -> float:
    """The newest modification time of anything in a job's work folder."""
    newest = root.stat().st_mtime
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                newest = max(newest, os.stat(os.path.join(dirpath, name)).st_mtime)
            except FileNotFoundError:  # written and renamed away while we looked
                continue
    return newest


def in_flight_jobs(instance: dg.DagsterInstance) -> set[str]:
    """Jobs with a run queued or running that no ``anex-pipeline`` process drives (those hold the
    lease instead: a CLI run whose process died stays "started" in the instance for good)."""
    runs = instance.get_runs(filters=dg.RunsFilter(statuses=IN_FLIGHT))
    return {job for run in runs if run.tags.get(LAUNCHED_BY_TAG) != "cli" and (job := job_of_run(run))}


def job_status(job: JobDir, in_flight: set[str]) -> str:
    if job.job_id in in_flight or driven_by_cli(job):
        return "running"
    report = job.report_path
    return JobReport.model_validate_json(report.read_text()).status if report.exists() else "unfinished"


def list_jobs(instance: dg.DagsterInstance, work_root: Path) -> list[JobEntry]:
    """Every job with a work folder under ``work_root``, newest activity first."""
    in_flight = in_flight_jobs(instance)
    entries = []
    for child in work_root.iterdir() if work_root.is_dir() else []:
        try:
            job = JobDir(work_root, child.name)
        except ValueError:  # not a name a job can have
            continue
        if not job.exists():  # e.g. the logs and the Batch API's files
            continue
        manifest = job.manifest()
        status = job_status(job, in_flight)
        entries.append(JobEntry(job.job_id, status, manifest.total_rows, last_activity(job.root), manifest.output))
    return sorted(entries, key=lambda e: e.last_activity, reverse=True)


def delete_job(instance: dg.DagsterInstance, job: JobDir) -> None:
    """Removes a job's runs (and with them its materializations), its partition key and its work
    folder; raises JobRunning, touching nothing, when the job is running."""
    if job.job_id in in_flight_jobs(instance):
        raise JobRunning(f"job {job.job_id} has a Dagster run in flight; wait for it to end or cancel it first")
    lease = try_lease(job) if job.root.exists() else None
    if job.root.exists() and lease is None:
        raise JobRunning(
            f"job {job.job_id} is being run by an anex-pipeline process; stop it (Ctrl-C) or wait for it to end"
        )
    try:
        count = len(job.manifest().shards) if job.exists() else None
        known = count if count is not None else len(shard_keys_on(instance, job.job_id))
        for run in runs_of_job(instance, job.job_id, known):
            instance.delete_run(run.run_id)
        forget_job(instance, job.job_id, count)
        if job.root.exists():
            shutil.rmtree(job.root)
    finally:
        if lease is not None:
            lease.close()


@dataclass(frozen=True)
class Removal:
    """What prune removed (or, on a dry run, would remove), and why."""

    kind: str  # "job" or "file"
    id: str
    reason: str

    def as_json(self) -> dict[str, str]:
        return {"kind": self.kind, "id": self.id, "reason": self.reason}


def forget_file(instance: dg.DagsterInstance, store: Store, work_root: Path, record: FileRecord) -> list[Removal]:
    """Removes a Batch API file; when it was the last delivered file of its finished batch, the
    batch's job and the service's copies of its input and result go too."""
    store.remove_file(record)
    batch = store.batch(record.batch_id) if record.batch_id else None
    if batch is None or batch.job_id is None or not batch.finished:
        return []
    if any(store.file(batch.owner, i) for i in (batch.output_file_id, batch.error_file_id) if i):
        return []
    store.drop_batch_copies(batch.id)
    job = JobDir(work_root, batch.job_id)
    delete_job(instance, job)
    return [Removal("job", batch.job_id, f"every file of batch {batch.id} is gone")]


def prune(
    instance: dg.DagsterInstance,
    work_root: Path,
    older_than_s: float | None,
    *,
    at: float | None = None,
    dry_run: bool = False,
) -> list[Removal]:
    """Removes the jobs whose last activity is older than ``older_than_s`` (None: no age limit)
    and that are not running (nor waiting in the Batch API), and the Batch API files that expired
    by ``at`` (default: now)."""
    at = time.time() if at is None else at
    removed: list[Removal] = []
    store = Store(instance, work_root)
    for record in store.expired_files(at):
        removed.append(Removal("file", record.id, f"expired at {_when(record.expires_at)}"))
        if not dry_run:
            removed.extend(forget_file(instance, store, work_root, record))
    if older_than_s is not None:
        # The jobs of unfinished batches stay: a restarted service resumes them.
        keep = {r.id for r in removed if r.kind == "job"} | {b.job_id for b in store.unfinished() if b.job_id}
        for entry in list_jobs(instance, work_root):
            age = at - entry.last_activity
            if entry.status == "running" or age <= older_than_s or entry.job_id in keep:
                continue
            try:
                if not dry_run:
                    delete_job(instance, JobDir(work_root, entry.job_id))
            except JobRunning:  # started since it was listed
                continue
            removed.append(Removal("job", entry.job_id, f"last active {_age(age)} ago"))
    return removed


def _when(stamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(stamp or 0))


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def table(entries: list[JobEntry], at: float) -> str:
    """The jobs as aligned columns for a terminal."""
    head = ("JOB", "STATUS", "ROWS", "AGE", "OUTPUT")
    lines = [head, *((e.job_id, e.status, str(e.rows), _age(at - e.last_activity), e.output) for e in entries)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join([*(c.ljust(w) for c, w in zip(line[:-1], widths, strict=True)), line[-1]]) for line in lines
    )
