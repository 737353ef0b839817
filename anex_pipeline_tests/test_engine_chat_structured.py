"""Structured outputs on the real engine: constrained generation, then the JSON check."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.jobs import chat_row, read_jsonl, run_job, write_jsonl

pytestmark = pytest.mark.engine

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
NAMES = ["Maria", "Tom", "Aiko", "John", "Lena", "Omar", "Priya", "Ivan", "Sofia", "Ken"]


def test_100_row_extraction_job_validates_or_is_counted(tmp_path: Path, real_runner: JobRunner) -> None:
    rows = [
        chat_row(f"x{i}", f"Return JSON with the name and age: {NAMES[i % 10]} is {20 + i} years old.", max_tokens=40)
        for i in range(100)
    ]
    # A row's own response_format replaces the job's whole: this one asks for any JSON object.
    rows[5]["body"]["response_format"] = {"type": "json_object"}
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report = run_job(real_runner, src, tmp_path / "out.jsonl", {"response_format": FORMAT, "temperature": 0})

    lines = read_jsonl(tmp_path / "out.jsonl")
    assert len(lines) == 100
    counts = report.request_counts
    assert counts.completed + counts.failed == 100
    format_errors = 0
    for line in lines:
        body = line["response"]["body"]
        choice = body["choices"][0]
        try:
            value = json.loads(choice["message"]["content"])
            assert isinstance(value, dict)
            if line["custom_id"] != "x5":
                jsonschema.validate(value, SCHEMA)
            assert choice["finish_reason"] == "stop"
        except (ValueError, AssertionError, jsonschema.ValidationError):
            format_errors += 1
    assert counts.format_error_rows == format_errors
    assert format_errors < 100  # constrained generation produces valid answers on this model
    assert report.status == "completed"


def test_parquet_marks_format_errors_and_length(tmp_path: Path, real_runner: JobRunner) -> None:
    prompts = [f"Give {n}'s details as JSON." for n in NAMES[:6]]
    pq.write_table(pa.table({"prompt": prompts}), tmp_path / "in.parquet")
    report = run_job(
        real_runner,
        tmp_path / "in.parquet",
        tmp_path / "out.parquet",
        {"response_format": FORMAT, "max_tokens": 3, "temperature": 0},
    )
    table = pq.read_table(tmp_path / "out.parquet")
    # Three tokens cannot hold a whole object: every answer is cut, so a format error marked "length".
    assert table.column("error_type").to_pylist() == ["length"] * 6
    assert report.request_counts.format_error_rows == 6


def test_estimated_cap_comes_from_a_sample_under_the_same_format(tmp_path: Path, real_runner: JobRunner) -> None:
    rows = [chat_row(f"s{i}", f"Return JSON: {NAMES[i % 10]} is {30 + i} years old.") for i in range(12)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report = run_job(
        real_runner,
        src,
        tmp_path / "out.jsonl",
        {"response_format": FORMAT, "estimate_sample_size": 8, "temperature": 0},
    )
    estimate = report.estimate
    assert estimate.sample_size == 8 and estimate.max_tokens is not None
    assert "lognormal" in estimate.method
    assert report.request_counts.completed == 12
