"""Embedding jobs on the real engine with the embedded all-MiniLM-L6-v2."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types import CreateEmbeddingResponse

from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.conftest import read_jsonl, run_job, write_jsonl

pytestmark = pytest.mark.engine

TEXTS = {
    "guitar-1": "A man is playing a guitar.",
    "guitar-2": "Someone is strumming a guitar.",
    "stocks": "The stock market fell sharply today.",
    "guitar-1-again": "A man is playing a guitar.",
}


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_jsonl_embeddings_are_unit_vectors_that_mean_something(tmp_path: Path, real_runner: JobRunner) -> None:
    rows = [{"custom_id": k, "url": "/v1/embeddings", "body": {"input": t}} for k, t in TEXTS.items()]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report = run_job(real_runner, src, tmp_path / "out.jsonl")

    vectors = {}
    for line in read_jsonl(tmp_path / "out.jsonl"):
        body = CreateEmbeddingResponse.model_validate(line["response"]["body"])
        vec = body.data[0].embedding
        assert len(vec) == 384
        assert abs(math.sqrt(sum(x * x for x in vec)) - 1.0) < 1e-5
        assert body.usage.prompt_tokens > 0
        vectors[line["custom_id"]] = vec
    assert list(vectors) == list(TEXTS)
    assert cosine(vectors["guitar-1"], vectors["guitar-1-again"]) > 0.999
    assert cosine(vectors["guitar-1"], vectors["guitar-2"]) > cosine(vectors["guitar-1"], vectors["stocks"]) + 0.3
    assert report.status == "completed" and report.usage.prompt_tokens > 0
    assert report.model == "sentence-transformers/all-MiniLM-L6-v2"


def test_parquet_embeddings_get_a_float32_column_and_no_output(tmp_path: Path, real_runner: JobRunner) -> None:
    pq.write_table(pa.table({"text": list(TEXTS.values()), "tag": list(TEXTS)}), tmp_path / "in.parquet")
    report = run_job(real_runner, tmp_path / "in.parquet", tmp_path / "out.parquet")
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column_names == ["text", "tag", "row_index", "embedding", "error_type", "prompt_tokens"]
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    assert table.column("error_type").to_pylist() == [None] * 4
    assert report.request_counts.completed == 4
