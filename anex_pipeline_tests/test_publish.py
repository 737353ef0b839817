"""Publishing a job's result: a job whose input had rows but whose result has none does not put
an empty file at the output location as if it were the result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.jobs import chat_row, read_jsonl, write_jsonl


@pytest.mark.slow
def test_a_result_without_rows_is_not_published(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(4)])
    out = tmp_path / "out.jsonl"
    job = fake_runner.submit(str(src), str(out), {"shards": 2})

    report = fake_runner.run(job, shards=[])  # nothing generated: every row is missing

    assert report.status == "failed"
    assert report.failure_reason is not None and "no result file is published" in report.failure_reason
    assert not out.exists()
    published = json.loads((tmp_path / "out.report.json").read_text())  # the report beside it says why
    assert published["status"] == "failed" and published["failure_reason"] == report.failure_reason

    earlier = [{"custom_id": "kept"}]
    write_jsonl(out, earlier)  # a result published before stays as it was
    assert fake_runner.run(job, shards=[]).status == "failed"
    assert read_jsonl(out) == earlier

    assert fake_runner.run(job).status == "completed"
    assert [r["custom_id"] for r in read_jsonl(out)] == [f"r{i}" for i in range(4)]
