"""A job's manifest with made-up values, for tests of what the engine settings pick for a job."""

from __future__ import annotations

from anex_pipeline.workdir.manifest import JobManifest


def job_manifest(rows: int) -> JobManifest:
    return JobManifest(
        job_id="j", input="in.jsonl", input_sha256="0", output="out.jsonl", report="r.json", format="jsonl",
        endpoint="chat", model="m", model_name="m", options={}, total_rows=rows, shards=[], submitted_at=0,
    )  # fmt: skip
