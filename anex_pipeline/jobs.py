"""A job's work folder: its manifest, its shards of requests and their checkpoints.

``prepare_job`` is the submit step: it checks the whole input (streaming), and only when nothing
is wrong writes the normalised requests as shard files plus a manifest. Everything later reads
the job through :class:`JobDir`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec
from pydantic import BaseModel

from anex_pipeline.formats import FileFormat, InputRow, jsonl, parquet, sniff_format
from anex_pipeline.models import resolve_model
from anex_pipeline.spec import MAX_SHARDS, Endpoint, JobOptions, JobRejected, Problem, RowOutcome

ROWS_PER_SHARD = 4096
MAX_REPORTED_PROBLEMS = 1000


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

    def job_options(self) -> JobOptions:
        return JobOptions.model_validate(self.options)


def shard_key(n: int) -> str:
    return f"{n:02d}"


def default_report_path(output: str) -> str:
    for suffix in (".jsonl", ".parquet", ".json"):
        if output.endswith(suffix):
            return output[: -len(suffix)] + ".report.json"
    return output + ".report.json"


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


def atomic_write_text(path: Path, text: str) -> None:
    """Writes a file so that readers see the old content or the new, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class JobDir:
    """Paths and readers of one job's work folder."""

    def __init__(self, work_root: Path | str, job_id: str):
        self.job_id = job_id
        self.root = Path(work_root) / job_id

    @property
    def manifest_path(self) -> Path:
        return self.root / "job.json"

    def exists(self) -> bool:
        return self.manifest_path.exists()

    def manifest(self) -> JobManifest:
        return JobManifest.model_validate_json(self.manifest_path.read_text())

    def shard_dir(self, shard: int) -> Path:
        return self.root / "shards" / shard_key(shard)

    def requests_path(self, shard: int) -> Path:
        return self.shard_dir(shard) / "requests.jsonl"

    def checkpoint_path(self, shard: int) -> Path:
        return self.shard_dir(shard) / "results.jsonl"

    @property
    def estimate_path(self) -> Path:
        return self.root / "estimate.json"

    @property
    def sample_path(self) -> Path:
        return self.root / "estimate_sample.jsonl"

    @property
    def stop_path(self) -> Path:
        return self.root / "stop.json"

    def read_requests(self, shard: int) -> Iterator[InputRow]:
        with self.requests_path(shard).open(encoding="utf-8") as f:
            for line in f:
                rec = msgspec.json.decode(line)
                yield InputRow(index=rec["i"], key=rec["key"], body=rec["body"])

    def read_checkpoint(self, shard: int) -> dict[int, RowOutcome]:
        """The latest outcome per row index; a torn last line (a killed writer) is ignored."""
        return read_outcomes(self.checkpoint_path(shard))

    @property
    def deadline_path(self) -> Path:
        return self.root / "deadline.json"

    def start_clock(self, time_limit_s: float | None) -> None:
        """Starts the job's time limit (if it has one) from now: each run of the job gets it whole."""
        self.deadline_path.unlink(missing_ok=True)
        if time_limit_s is not None:
            atomic_write_text(self.deadline_path, json.dumps({"at": time.time() + time_limit_s, "limit": time_limit_s}))

    def out_of_time(self) -> str | None:
        """Why the job must stop now because of its time limit, or None."""
        if not self.deadline_path.exists():
            return None
        deadline = json.loads(self.deadline_path.read_text())
        if time.time() < deadline["at"]:
            return None
        return f"the job's time limit of {deadline['limit']:g} s was reached"

    def record_stop(self, reason: str) -> None:
        atomic_write_text(self.stop_path, json.dumps({"reason": reason, "at": time.time()}))


def unfinished_shards(job: JobDir) -> list[int]:
    """Shards with rows that are missing from their checkpoint or failed."""
    return [
        shard
        for shard, rng in enumerate(job.manifest().shards)
        if sum(1 for o in job.read_checkpoint(shard).values() if o.ok) < rng.size
    ]


def read_outcomes(path: Path) -> dict[int, RowOutcome]:
    found: dict[int, RowOutcome] = {}
    if not path.exists():
        return found
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                rec = msgspec.json.decode(line)
            except msgspec.DecodeError:
                break
            found[rec["i"]] = RowOutcome.from_record(rec)
    return found


def append_outcomes(path: Path, outcomes: Iterable[RowOutcome]) -> None:
    """Appends finished rows to a checkpoint file and makes them durable before returning."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = b"".join(msgspec.json.encode(o.to_record()) + b"\n" for o in outcomes)
    with path.open("ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def shard_ranges(total: int, requested: int | None) -> list[ShardRange]:
    count = requested or math.ceil(total / ROWS_PER_SHARD)
    count = max(1, min(count, MAX_SHARDS, total))
    bounds = [total * s // count for s in range(count + 1)]
    return [ShardRange(start=bounds[s], stop=bounds[s + 1]) for s in range(count)]


def detect_format(path: Path) -> FileFormat:
    if not path.exists():
        raise JobRejected([Problem(f"input file {path} does not exist")])
    if not path.is_file():
        raise JobRejected([Problem(f"input {path} is not a file")])
    try:
        kind = sniff_format(path)
    except OSError as exc:
        raise JobRejected([Problem(f"input file {path} cannot be read: {exc.strerror}")]) from None
    if kind is None:
        raise JobRejected([Problem(f"input file {path} is empty: there are no rows")])
    if path.suffix.lower() == ".parquet" and kind != "parquet":
        raise JobRejected(
            [Problem(f"{path.name} is named .parquet but is not a Parquet file (no PAR1 header); is it JSONL?")]
        )
    return kind


def check_input(path: Path, options: JobOptions) -> tuple[FileFormat, Endpoint, Iterator[InputRow | Problem]]:
    """Opens an input for checking: its format, its endpoint, and its rows or problems."""
    kind = detect_format(path)
    module = parquet if kind == "parquet" else jsonl
    try:
        endpoint = module.job_endpoint(path, options)
    except parquet.ParquetInputError as exc:
        raise JobRejected(exc.problems) from None
    _, model_name = resolve_model(options.model, endpoint)
    names = frozenset({model_name, *(n for n in [options.model] if n)})
    return kind, endpoint, module.read_requests(path, endpoint, names, options)


def prepare_job(
    input_path: Path,
    output: str,
    options: JobOptions,
    work_root: Path,
    *,
    report: str | None = None,
    job_id: str | None = None,
) -> JobDir:
    """Checks the input and writes the job's shards and manifest; raises JobRejected on problems.

    Idempotent: a job whose manifest already exists for the same input content is reused as it is,
    so reruns and resumes keep their checkpoints.
    """
    input_path = Path(input_path)
    kind, endpoint, rows = check_input(input_path, options)
    sha = file_sha256(input_path)
    raw_options = options.model_dump(exclude_defaults=True)
    # The output is not part of the id: a job whose result could not be written resumes, with
    # every finished row, when it is run again towards a location that works.
    job_id = job_id or make_job_id(input_path, sha, raw_options)
    job = JobDir(work_root, job_id)
    if job.exists() and job.manifest().input_sha256 == sha:
        manifest = job.manifest()
        report_path = report or default_report_path(output)
        if (manifest.output, manifest.report) != (output, report_path):
            moved = manifest.model_copy(update={"output": output, "report": report_path})
            atomic_write_text(job.manifest_path, moved.model_dump_json(indent=2))
        return job
    job.root.mkdir(parents=True, exist_ok=True)
    staging = job.root / "rows.staging.jsonl"
    problems: list[Problem] = []
    problem_count = 0
    total = 0
    with staging.open("w", encoding="utf-8") as out:
        for item in rows:
            if isinstance(item, Problem):
                problem_count += 1
                if len(problems) < MAX_REPORTED_PROBLEMS:
                    problems.append(item)
                continue
            total += 1
            if problem_count == 0:
                out.write(msgspec.json.encode({"i": item.index, "key": item.key, "body": item.body}).decode("utf-8"))
                out.write("\n")
    if problem_count:
        staging.unlink()
        raise JobRejected(problems, total=problem_count)
    if total == 0:
        staging.unlink()
        raise JobRejected([Problem(f"input file {input_path} has no rows")])
    ranges = shard_ranges(total, options.shards)
    _split(staging, job, ranges)
    staging.unlink()
    model_path, model_name = resolve_model(options.model, endpoint)
    manifest = JobManifest(
        job_id=job_id,
        input=str(input_path.resolve()),
        input_sha256=sha,
        output=output,
        report=report or default_report_path(output),
        format=kind,
        endpoint=endpoint,
        model=str(model_path),
        model_name=model_name,
        options=raw_options,
        total_rows=total,
        shards=ranges,
        submitted_at=time.time(),
    )
    atomic_write_text(job.manifest_path, manifest.model_dump_json(indent=2))
    return job


def _split(staging: Path, job: JobDir, ranges: list[ShardRange]) -> None:
    with staging.open(encoding="utf-8") as src:
        for n, rng in enumerate(ranges):
            path = job.requests_path(n)
            path.parent.mkdir(parents=True, exist_ok=True)
            if job.checkpoint_path(n).exists():
                job.checkpoint_path(n).unlink()  # the input changed: old results no longer apply
            with path.open("w", encoding="utf-8") as dst:
                for _ in range(rng.size):
                    dst.write(src.readline())
