"""Figures a job adds up over its shards and reruns, kept in its work folder for the report: the
seconds of each stage, the rows each model server answered, and the engine they ran on."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from anex_pipeline.workdir.locks import locked
from anex_pipeline.workdir.manifest import JobDir, atomic_write_text

_sums_lock = threading.Lock()  # the CLI's engine-loading thread records its time too


def _add_to(path: Path, amounts: dict[str, float]) -> None:
    """Adds to the sums in ``path``, under a lock file beside it: a job's shard steps may run in
    other processes at once (Dagster's multiprocess executor, Ray nodes sharing the work folder),
    and a read-modify-write of one of them would otherwise lose another's amounts."""
    with _sums_lock, locked(path.with_name(path.name + ".lock")):
        sums = json.loads(path.read_text()) if path.exists() else {}
        for name, amount in amounts.items():
            sums[name] = round(sums.get(name, 0) + amount, 3)
        atomic_write_text(path, json.dumps(sums, indent=2))


def _read(path: Path) -> dict[str, float]:
    return json.loads(path.read_text()) if path.exists() else {}


def record_timing(job: JobDir, stage: str, seconds: float) -> None:
    """Adds a stage's seconds to the job's timings (summed over shards and reruns)."""
    _add_to(job.timings_path, {stage: seconds})


def read_timings(job: JobDir) -> dict[str, float]:
    return _read(job.timings_path)


def record_served(job: JobDir, rows_by_server: dict[str, int]) -> None:
    """Adds to the rows each model server answered for the job (HTTP engine)."""
    if rows_by_server:
        _add_to(job.served_by_path, rows_by_server)


def read_served(job: JobDir) -> dict[str, int]:
    return {server: int(rows) for server, rows in _read(job.served_by_path).items()}


def record_engine(job: JobDir, section: dict[str, Any]) -> None:
    """Keeps the report's account of the engine the job's rows ran on (the latest one)."""
    atomic_write_text(job.engine_path, json.dumps(section, indent=2, sort_keys=True))


def read_engine(job: JobDir) -> dict[str, Any] | None:
    return json.loads(job.engine_path.read_text()) if job.engine_path.exists() else None
