"""Shards are cut where neighbouring rows share the least prompt, near even sizes."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from anex_pipeline.spec import JobOptions
from anex_pipeline.stages.submit import prepare_job
from anex_pipeline.stages.submit_shard_plan import LEVEL_CHARS, plan_bounds, sharing_level
from anex_pipeline_tests.harness.jobs import chat_row, write_jsonl


def test_sharing_level_counts_the_equal_starts() -> None:
    doc = "x" * 5000
    assert sharing_level(doc + "a", doc + "b") == len(LEVEL_CHARS)
    assert sharing_level("y" * 600 + "a" * 1000, "y" * 600 + "b" * 1000) == 1
    assert sharing_level("short", "short") == 0  # shorter than a cache block: nothing to keep together
    assert sharing_level(b"z" * 1024, b"z" * 1024) == 2


def _heads(rows: list[str]):
    return lambda windows: [rows[start:stop] for start, stop in windows]


def test_cuts_move_to_the_nearest_group_boundary_within_reach() -> None:
    groups = [12, 12, 16]  # rows per document; the even cuts fall inside documents
    rows = [f"document {d} " * 200 + f"question {q}" for d, n in enumerate(groups) for q in range(n)]
    assert plan_bounds(len(rows), 2, _heads(rows)) == [0, 24, 40]  # 20 -> 24, within a quarter of 20
    assert plan_bounds(len(rows), 3, _heads(rows)) == [0, 12, 24, 40]


def test_without_a_boundary_in_reach_the_cut_stays_even() -> None:
    rows = ["same long instruction " * 100 + f"item {i}" for i in range(40)]
    assert plan_bounds(len(rows), 4, _heads(rows)) == [0, 10, 20, 30, 40]
    tiny = ["a", "b", "c"]
    assert plan_bounds(3, 3, _heads(tiny)) == [0, 1, 2, 3]


def _document_rows(counts: list[int]) -> list[dict]:
    return [
        chat_row(f"d{d}-q{q}", f"Document {d}: " + f"sentence {d} of the text. " * 60 + f"Question {q}?")
        for d, n in enumerate(counts)
        for q in range(n)
    ]


def test_a_jsonl_job_is_sharded_between_documents(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", _document_rows([9, 9, 2]))
    job = prepare_job(src, str(tmp_path / "out.jsonl"), JobOptions(shards=2), tmp_path / "work")
    assert [(r.start, r.stop) for r in job.manifest().shards] == [(0, 9), (9, 20)]
    assert [row.key for row in job.read_requests(1)][:1] == ["d1-q0"]


def test_a_parquet_job_is_sharded_between_documents(tmp_path: Path) -> None:
    prompts = [row["body"]["messages"][0]["content"] for row in _document_rows([9, 9, 2])]
    pq.write_table(pa.table({"prompt": prompts}), tmp_path / "in.parquet")
    job = prepare_job(tmp_path / "in.parquet", str(tmp_path / "out.parquet"), JobOptions(shards=2), tmp_path / "w")
    assert [(r.start, r.stop) for r in job.manifest().shards] == [(0, 9), (9, 20)]
