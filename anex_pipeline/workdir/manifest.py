"""A job's work folder: its manifest, its shards of requests and their checkpoints.

The submit step (:mod:`anex_pipeline.stages.submit`) writes the folder; everything later reads
the job through :class:`JobDir`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from anex_pipeline.formats import (
    FileFormat,
    StoredOutcome,
    write_error,
)
from anex_pipeline.formats.registry import FORMATS
from anex_pipeline.spec import Endpoint, InputRow, JobOptions, JobReport, RowOutcome
from anex_pipeline.workdir import layout

JOB_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")


class ShardRange(BaseModel):
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


class JobManifest(BaseModel):
    """What a job is: where it reads and writes, its options, and how its rows are sharded."""

    job_id: str
    input: str
    input_sha256: str
    output: str
    report: str
    format: FileFormat
    endpoint: Endpoint
    model: str  # path or id the engine loads
    model_name: str  # the name written into responses
    options: dict[str, Any]
    total_rows: int
    shards: list[ShardRange]
    submitted_at: float
    rows_by_model: dict[str, int] = {}  # rows per model asked for (base and adapters); jobs with adapters only
    # Whose answers the job may share through the work folder's answer store: "" for everyone who
    # uses the folder; a shared service's tenant (the hash of its API key) otherwise.
    answer_scope: str = ""

    def job_options(self) -> JobOptions:
        return JobOptions.model_validate(self.options)


def shard_key(n: int) -> str:
    return f"{n:02d}"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def make_job_id(input_path: Path, *identity: Any) -> str:
    """A stable id from the input's name and what identifies the job (for the CLI: the input's
    content and the options), so that running the same job again resumes it."""
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", input_path.name.split(".")[0]).strip("-")[:40] or "job"
    fingerprint = json.dumps(identity, sort_keys=True)
    return f"{stem}-{hashlib.sha256(fingerprint.encode()).hexdigest()[:10]}"


def read_report(path: Path) -> JobReport | None:
    """The job report at ``path`` (a work folder's, or one published beside a result), or None
    when there is none; a file cut short or not a report raises ValueError."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return JobReport.model_validate_json(text)


def atomic_write_text(path: Path, text: str) -> None:
    """Writes a file so that readers see the old content or the new, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # e.g. the disk is full: leave no temp file behind, name the real file
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise write_error(exc, path) from None


class JobDir:
    """Paths and readers of one job's work folder."""

    def __init__(self, work_root: Path | str, job_id: str):
        if not JOB_ID.fullmatch(job_id):  # the id names a folder: it must stay one folder under work_root
            raise ValueError(
                f"job id {job_id[:80]!r} cannot name a job folder: use at most 200 letters, digits, '-', '_' "
                "and '.', not starting with '.'"
            )
        if job_id in layout.WORK_ROOT_FOLDERS:  # the work root keeps these folders for itself
            raise ValueError(f"{job_id} is {layout.WORK_ROOT_FOLDERS[job_id]} of the work root, not a job")
        self.job_id = job_id
        self.root = Path(work_root) / job_id
        self._manifest: tuple[tuple[int, int, int], JobManifest] | None = None  # (file stamp, parsed)

    @property
    def step_files(self) -> Path:
        """Where an LLM step of a user's Dagster project keeps this job's input and result (a
        folder of the work root's own, since a job's result may not lie in its job folder)."""
        return self.root.parent / layout.STEP_FILES_DIR / self.job_id

    @property
    def manifest_path(self) -> Path:
        return self.root / layout.MANIFEST

    def exists(self) -> bool:
        return self.manifest_path.exists()

    def manifest(self) -> JobManifest:
        """The job's manifest, parsed again only when its file has changed: a job's steps read
        it once per shard, and a job with thousands of shards has a manifest as long."""
        st = self.manifest_path.stat()
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if self._manifest is None or self._manifest[0] != stamp:
            self._manifest = (stamp, JobManifest.model_validate_json(self.manifest_path.read_text()))
        return self._manifest[1]

    def shard_dir(self, shard: int) -> Path:
        return self.root / layout.SHARDS_DIR / shard_key(shard)

    def requests_path(self, shard: int, kind: FileFormat) -> Path:
        return self.shard_dir(shard) / FORMATS[kind].shard_file

    def checkpoint_path(self, shard: int, manifest: JobManifest | None = None) -> Path:
        """The shard's finished rows: JSON lines for a JSONL job, Arrow columns for a Parquet one
        (``manifest``: the job's, when the caller has read it already)."""
        return self.shard_dir(shard) / FORMATS[(manifest or self.manifest()).format].checkpoint_file

    @property
    def estimate_path(self) -> Path:
        return self.root / layout.ESTIMATE

    @property
    def sample_path(self) -> Path:
        return self.root / layout.ESTIMATE_SAMPLE

    @property
    def result_path(self) -> Path:
        """The merged result, before it is published."""
        return self.root / f"{layout.RESULT_STEM}.{self.manifest().format}"

    @property
    def report_path(self) -> Path:
        """The report the merge writes, before it is published."""
        return self.root / layout.REPORT

    def report(self) -> JobReport | None:
        """The report the merge wrote, or None before the job has been merged (see
        :func:`read_report`)."""
        return read_report(self.report_path)

    @property
    def timings_path(self) -> Path:
        return self.root / layout.TIMINGS

    @property
    def served_by_path(self) -> Path:
        return self.root / layout.SERVED_BY

    @property
    def engine_path(self) -> Path:
        return self.root / layout.ENGINE

    @property
    def lease_path(self) -> Path:
        return self.root / layout.LEASE

    def media_failures_path(self, shard: int) -> Path:
        return self.shard_dir(shard) / layout.MEDIA_FAILURES

    @property
    def stop_path(self) -> Path:
        return self.root / layout.STOP

    def read_requests(self, shard: int) -> Iterator[InputRow]:
        manifest = self.manifest()
        path = self.requests_path(shard, manifest.format)
        yield from FORMATS[manifest.format].read_shard(path, manifest.endpoint, manifest.job_options())

    def record_outcomes(self, shard: int, outcomes: Iterable[RowOutcome]) -> None:
        """Appends finished rows to the shard's checkpoint, durably."""
        manifest = self.manifest()
        path = self.checkpoint_path(shard, manifest)
        FORMATS[manifest.format].append_checkpoint(path, outcomes, manifest.endpoint)

    def outcomes(self, shard: int) -> Iterator[StoredOutcome]:
        """The latest outcome of each row of the shard that has one, by row order. A JSONL job's
        bodies stay the stored JSON and its checkpoint is streamed, never read whole (see
        :func:`latest_records`); a Parquet job's answers stay in the checkpoint's columns."""
        manifest = self.manifest()
        path = self.checkpoint_path(shard, manifest)
        rng = manifest.shards[shard]
        return FORMATS[manifest.format].checkpoint_outcomes(path, rng.start, rng.stop, manifest.endpoint)

    def finished_rows(self, shard: int) -> set[int]:
        """The indices of the shard's rows whose latest outcome succeeded."""
        return {o.i for o in self.outcomes(shard) if not o.failed}

    @property
    def deadline_path(self) -> Path:
        return self.root / layout.DEADLINE

    def start_clock(self, time_limit_s: float | None, until: tuple[float, str] | None = None) -> None:
        """Starts the job's time limit (if it has one) from now: each run of the job gets it whole.
        ``until``: a fixed end (a Unix time) that no run passes, and why it is one (a batch's
        completion window); the earlier of the two holds."""
        self.deadline_path.unlink(missing_ok=True)
        ends = [] if until is None else [until]
        if time_limit_s is not None:
            ends.append((time.time() + time_limit_s, f"the job's time limit of {time_limit_s:g} s was reached"))
        if ends:
            at, reason = min(ends)
            atomic_write_text(self.deadline_path, json.dumps({"at": at, "reason": reason}))

    def out_of_time(self) -> str | None:
        """Why the job must stop now because of its time limit, or None."""
        deadline = self._deadline()
        if deadline is None or time.time() < deadline["at"]:
            return None
        return deadline["reason"]

    def time_left(self) -> float | None:
        """Seconds until the job's time limit runs out (0 or less once it has); None without a limit."""
        deadline = self._deadline()
        return None if deadline is None else deadline["at"] - time.time()

    def _deadline(self) -> dict[str, Any] | None:
        if not self.deadline_path.exists():
            return None
        return json.loads(self.deadline_path.read_text())

    def record_stop(self, reason: str) -> None:
        atomic_write_text(self.stop_path, json.dumps({"reason": reason, "at": time.time()}))

    def stop_reason(self) -> str | None:
        """Why the job was asked to stop, from its stop file; None when it has none. A stop file
        that is torn or not written by :meth:`record_stop` still means the job was asked to stop."""
        try:
            return str(json.loads(self.stop_path.read_text())["reason"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            return "the job was asked to stop"


def unfinished_shards(job: JobDir) -> list[int]:
    """Shards with rows that are missing from their checkpoint or failed."""
    return [shard for shard, rng in enumerate(job.manifest().shards) if len(job.finished_rows(shard)) < rng.size]
