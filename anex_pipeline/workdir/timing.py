"""A job's stage timings: seconds per stage, summed over shards and reruns, kept in its work folder
for the report."""

from __future__ import annotations

import json
import threading

from anex_pipeline.workdir.manifest import JobDir, atomic_write_text

_timings_lock = threading.Lock()  # the CLI's engine-loading thread records its time too


def record_timing(job: JobDir, stage: str, seconds: float) -> None:
    """Adds a stage's seconds to the job's timings (summed over shards and reruns)."""
    path = job.timings_path
    with _timings_lock:
        timings = json.loads(path.read_text()) if path.exists() else {}
        timings[stage] = round(timings.get(stage, 0.0) + seconds, 3)
        atomic_write_text(path, json.dumps(timings, indent=2))


def read_timings(job: JobDir) -> dict[str, float]:
    path = job.timings_path
    return json.loads(path.read_text()) if path.exists() else {}
