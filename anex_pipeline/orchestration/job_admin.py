"""Keeping what jobs leave behind in check: list the jobs of a work root, delete one, prune old ones.

A job leaves a work folder (shards, checkpoints, its report) and, in the Dagster instance, a key
of the ``jobs`` dynamic partition and one ``shards`` key per shard, with the runs and
materializations of its steps. Deleting a job removes all three; the result file it delivered is
never touched. Open-source Dagster cannot wipe the materializations of single partitions, so they
go with the job's runs (deleting a run deletes its events). A job is running while a process holds
its lease or a run of it is in flight; it is then never deleted, nor is the job of a Batch API
batch that has not finished (a restarted service resumes it).

Only jobs are ever touched: a folder of the work root is a job's when it is a real folder (not a
symbolic link) whose manifest reads and names it. The work root may hold other data, and its own
folders (the logs, the Batch API's files): ``delete`` refuses them and ``list`` and ``prune`` pass
them by. A folder that holds a manifest but cannot be read as that job's (cut short, unreadable,
a link) is skipped and reported, and the others are still listed and pruned.

Pruning also removes the Batch API's expired files, and the job of a finished batch once every
file the batch delivered is gone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg

from anex_pipeline.batches.objects import BatchRecord, FileRecord
from anex_pipeline.batches.store import Store
from anex_pipeline.errors import RejectedError
from anex_pipeline.orchestration.partitions import JOBS, forget_job, shard_keys_on
from anex_pipeline.orchestration.runs import IN_FLIGHT, held_by_lease, job_of_run, runs_of_job
from anex_pipeline.stages.generate_answer_store import drop_answers
from anex_pipeline.workdir import layout
from anex_pipeline.workdir.lease import lease_held, try_lease
from anex_pipeline.workdir.manifest import JobDir

log = logging.getLogger(__name__)

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*")


def parse_age(text: str) -> float:
    """Seconds in a duration like ``90s``, ``15m``, ``12h`` or ``7d``; ValueError otherwise."""
    found = DURATION.fullmatch(text)
    if found is None:
        raise ValueError(f"{text!r} is not an age: write a number and a unit s, m, h or d, e.g. 7d or 12h")
    return float(found[1]) * UNITS[found[2]]


class JobRunning(RejectedError):
    """The job is running (or waits in the Batch API to resume), so it is left alone."""


class NotAJob(RejectedError):
    """The name is not a job of the work root (or its folder cannot be taken as the job's), so
    nothing is touched."""


@dataclass(frozen=True)
class Skipped:
    """A folder that holds a job's manifest but cannot be read as that job, and why."""

    folder: Path
    reason: str

    def __str__(self) -> str:
        return f"skipped {self.folder}: it {self.reason}"


def _warn(skipped: Skipped) -> None:
    log.warning("%s", skipped)


OnSkip = Callable[[Skipped], None]


@dataclass(frozen=True)
class JobEntry:
    """One job of a work root, as ``list`` shows it."""

    job_id: str
    status: str  # the report's status once finished; "running" or "unfinished" before
    rows: int
    last_activity: float  # seconds since the epoch: the newest change in its work folder
    output: str

    def age(self, at: float) -> float:
        """Seconds since its last activity at ``at``; never below 0 (a file may be stamped a moment
        after ``at`` was taken)."""
        return max(0.0, at - self.last_activity)

    def as_json(self, at: float) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "status": self.status,
            "rows": self.rows,
            "age_s": round(self.age(at), 1),
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
    """Jobs with a run queued or running that no process holding the job's lease executes (the
    lease tells about those: such a run whose process died stays "started" in the instance)."""
    runs = instance.get_runs(filters=dg.RunsFilter(statuses=IN_FLIGHT))
    return {job for run in runs if not held_by_lease(run) and (job := job_of_run(run))}


def job_status(job: JobDir, in_flight: set[str]) -> str:
    if job.job_id in in_flight or lease_held(job):
        return "running"
    report = job.report()
    return report.status if report is not None else "unfinished"


def folder_problem(job: JobDir) -> str | None:
    """Why the folder named after ``job`` cannot be taken as that job's, or None when it can: a
    real folder (not a symbolic link) whose manifest reads and names the job."""
    try:
        if job.root.is_symlink():
            return f"is a symbolic link (to {os.readlink(job.root)}); jobs are only read and removed in real folders"
        mode = job.manifest_path.stat().st_mode
        if not stat.S_ISREG(mode):
            return f"has a {layout.MANIFEST} that is not a regular file"
        found = job.manifest().job_id
    except (FileNotFoundError, NotADirectoryError):
        return f"holds no {layout.MANIFEST}"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    except ValueError:  # pydantic's ValidationError among them
        return f"has a {layout.MANIFEST} that is cut short or not a job's manifest"
    if found != job.job_id:
        return f"has the manifest of another job ({found[:80]})"
    return None


def _holds_manifest(job: JobDir) -> bool:
    """Whether anything is found where the job's manifest would be (an error other than "not
    there", e.g. a folder that cannot be read, counts: the folder is then reported)."""
    try:
        job.manifest_path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    return True


def _job_folders(work_root: Path, on_skip: OnSkip) -> Iterator[JobDir]:
    """The jobs of the work root whose folders can be read as theirs; the others go to ``on_skip``."""
    try:
        children = sorted(os.listdir(work_root))
    except (FileNotFoundError, NotADirectoryError):  # no job has run with this work root yet
        return
    except OSError as exc:
        raise RejectedError(
            f"cannot read the work root {work_root}: {exc.strerror or exc}; make it readable, or set "
            "ANEX_WORK_DIR (or --work-dir) to the folder the jobs ran with"
        ) from None
    for name in children:
        try:
            job = JobDir(work_root, name)
        except ValueError:  # not a name a job can have: the work root's own folders, other data
            continue
        if not _holds_manifest(job):  # not a job at all
            continue
        if (why := folder_problem(job)) is not None:
            on_skip(Skipped(job.root, why))
            continue
        yield job


def list_jobs(instance: dg.DagsterInstance, work_root: Path, on_skip: OnSkip = _warn) -> list[JobEntry]:
    """Every job with a work folder under ``work_root``, newest activity first; a folder that
    cannot be read as its job's goes to ``on_skip`` (by default a warning in the log)."""
    in_flight = in_flight_jobs(instance)
    entries = []
    for job in _job_folders(work_root, on_skip):
        try:
            manifest = job.manifest()
            status = job_status(job, in_flight)
            entries.append(JobEntry(job.job_id, status, manifest.total_rows, last_activity(job.root), manifest.output))
        except OSError as exc:
            on_skip(Skipped(job.root, f"cannot be read ({exc.strerror or exc})"))
        except ValueError:  # a report cut short
            on_skip(Skipped(job.root, f"has a {layout.REPORT} that is cut short or not a report"))
    return sorted(entries, key=lambda e: e.last_activity, reverse=True)


def waiting_batches(store: Store) -> dict[str, BatchRecord]:
    """The Batch API's unfinished batches by their job's id: a restarted service resumes them, so
    their jobs stay."""
    return {b.job_id: b for b in store.unfinished() if b.job_id}


def delete_job(instance: dg.DagsterInstance, job: JobDir) -> None:
    """Removes a job's runs (and with them its materializations), its partition key and its work
    folder. Touching nothing, it raises NotAJob when the name is no job of the work root (no
    folder readable as the job's, no partition key) and JobRunning when the job is running or is
    the job of an unfinished Batch API batch."""
    folder = os.path.lexists(job.root)
    known = instance.has_dynamic_partition(JOBS, job.job_id)
    if folder:
        _refuse_unless_the_jobs(job, known)  # before the lease, which writes in the folder
    if not folder and not known:
        raise NotAJob(f"no job {job.job_id} under {job.root.parent}; `anex-pipeline list` shows the jobs")
    if (batch := waiting_batches(Store(instance, job.root.parent)).get(job.job_id)) is not None:
        raise JobRunning(
            f"job {job.job_id} runs Batch API batch {batch.id}, which is {batch.status}: the service resumes it "
            f"when it starts again; cancel the batch (POST /v1/batches/{batch.id}/cancel) to let it go"
        )
    if job.job_id in in_flight_jobs(instance):
        raise JobRunning(f"job {job.job_id} has a Dagster run in flight; wait for it to end or cancel it first")
    lease = try_lease(job) if folder else None
    if folder and lease is None:
        raise JobRunning(
            f"job {job.job_id} is being run by an anex-pipeline process; stop it (Ctrl-C) or wait for it to end"
        )
    try:
        if folder:
            _refuse_unless_the_jobs(job, known)  # it may have changed while the lease was taken
        count = len(job.manifest().shards) if job.exists() else None
        known_shards = count if count is not None else len(shard_keys_on(instance, job.job_id))
        for run in runs_of_job(instance, job.job_id, known_shards):
            instance.delete_run(run.run_id)
        forget_job(instance, job.job_id, count)
        drop_answers(job.root.parent, job.job_id)
        shutil.rmtree(job.step_files, ignore_errors=True)
        if folder:
            shutil.rmtree(job.root)
    finally:
        if lease is not None:
            lease.close()


def _refuse_unless_the_jobs(job: JobDir, known: bool) -> None:
    """Raises NotAJob unless the job's folder is its own (see :func:`folder_problem`), or, for a
    job the instance knows, a folder holding nothing but its lease."""
    if (why := folder_problem(job)) is not None and not (known and _holds_only_lease(job)):
        raise NotAJob(f"{job.root} {why}, so it is not deleted; `anex-pipeline list` shows the jobs")


def _holds_only_lease(job: JobDir) -> bool:
    """A job's folder left empty but for its lease file, as a submit refused at once leaves it."""
    try:
        return job.root.is_dir() and not job.root.is_symlink() and set(os.listdir(job.root)) <= {layout.LEASE}
    except OSError:
        return False


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
    try:
        delete_job(instance, JobDir(work_root, batch.job_id))
    except NotAJob:  # deleted already (or its folder is no longer the job's): nothing more to remove
        return []
    return [Removal("job", batch.job_id, f"every file of batch {batch.id} is gone")]


def prune(
    instance: dg.DagsterInstance,
    work_root: Path,
    older_than_s: float | None,
    *,
    at: float | None = None,
    dry_run: bool = False,
    on_skip: OnSkip = _warn,
) -> list[Removal]:
    """Removes the jobs whose last activity is older than ``older_than_s`` (None: no age limit)
    and that are not running (nor waiting in the Batch API), and the Batch API files that expired
    by ``at`` (default: now). Folders that cannot be read as their jobs' go to ``on_skip``."""
    at = time.time() if at is None else at
    removed: list[Removal] = []
    store = Store(instance, work_root)
    for record in store.expired_files(at):
        removed.append(Removal("file", record.id, f"expired at {_when(record.expires_at)}"))
        if not dry_run:
            removed.extend(forget_file(instance, store, work_root, record))
    if older_than_s is not None:
        # The jobs of unfinished batches stay: a restarted service resumes them.
        keep = {r.id for r in removed if r.kind == "job"} | set(waiting_batches(store))
        for entry in list_jobs(instance, work_root, on_skip):
            age = entry.age(at)
            if entry.status == "running" or age <= older_than_s or entry.job_id in keep:
                continue
            job = JobDir(work_root, entry.job_id)
            try:
                if not dry_run:
                    delete_job(instance, job)
            except JobRunning:  # started since it was listed
                continue
            except NotAJob:  # its folder changed since it was listed
                on_skip(Skipped(job.root, folder_problem(job) or "changed while it was pruned"))
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
    lines = [head, *((e.job_id, e.status, str(e.rows), _age(e.age(at)), e.output) for e in entries)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join([*(c.ljust(w) for c, w in zip(line[:-1], widths, strict=True)), line[-1]]) for line in lines
    )
