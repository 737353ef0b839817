"""Embedding jobs on the real engine with the embedded all-MiniLM-L6-v2."""

from __future__ import annotations

import base64
import math
import struct
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types import CreateEmbeddingResponse

from anex_pipeline.engine.models import embedding_model_dir
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobRejected
from anex_pipeline_tests.harness.batch_api import client, content, serving, wait
from anex_pipeline_tests.harness.jobs import read_jsonl, run_job, write_jsonl

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


def unit_length(vec: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vec))


def bodies_of(line: dict) -> CreateEmbeddingResponse:
    return CreateEmbeddingResponse.model_validate(line["response"]["body"])


def from_base64(text: str) -> list[float]:
    raw = base64.b64decode(text)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def test_every_input_shape_gives_one_indexed_vector_per_input(tmp_path: Path, real_runner: JobRunner) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedding_model_dir())
    texts = list(TEXTS.values())[:3]
    ids = [tokenizer.encode(t) for t in texts]
    bodies = {
        "one": {"input": texts[0]},
        "list": {"input": texts},
        "token-ids": {"input": ids[1]},
        "token-id-lists": {"input": ids},
        "base64": {"input": texts, "encoding_format": "base64"},
    }
    rows = [{"custom_id": k, "url": "/v1/embeddings", "body": b} for k, b in bodies.items()]
    report = run_job(real_runner, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl")
    lines = read_jsonl(tmp_path / "out.jsonl")
    # The SDK's type holds floats: it decodes a base64 answer itself before building one.
    got = {line["custom_id"]: bodies_of(line) for line in lines if line["custom_id"] != "base64"}

    listed = got["list"]
    assert [d.index for d in listed.data] == [0, 1, 2]
    assert all(abs(unit_length(d.embedding) - 1.0) < 1e-5 for d in listed.data)
    assert listed.usage.prompt_tokens == sum(map(len, ids))  # every input's tokens, summed
    assert cosine(listed.data[0].embedding, got["one"].data[0].embedding) > 0.9999
    assert cosine(listed.data[1].embedding, got["token-ids"].data[0].embedding) > 0.9999  # the same tokens
    assert got["token-ids"].usage.prompt_tokens == len(ids[1])
    for mine, theirs in zip(got["token-id-lists"].data, listed.data, strict=True):
        assert cosine(mine.embedding, theirs.embedding) > 0.9999
    raw = lines[4]["response"]["body"]["data"]
    assert all(isinstance(d["embedding"], str) for d in raw)  # base64 text, not floats
    for encoded, floats in zip(raw, listed.data, strict=True):
        assert from_base64(encoded["embedding"]) == pytest.approx(floats.embedding, abs=1e-6)
    assert report.request_counts.completed == 5
    assert report.usage.prompt_tokens == sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in lines)


def test_the_batch_api_gives_the_sdk_one_vector_per_listed_input(tmp_path: Path, real_runner: JobRunner) -> None:
    """The same lists through the Batch API, read back with the ``openai`` SDK."""
    texts = list(TEXTS.values())[:3]
    bodies = {"list": {"input": texts}, "b64": {"input": texts[:2], "encoding_format": "base64"}}
    rows = [{"custom_id": k, "method": "POST", "url": "/v1/embeddings", "body": b} for k, b in bodies.items()]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    with serving(real_runner) as url:
        sdk = client(url)
        with src.open("rb") as f:
            uploaded = sdk.files.create(file=f, purpose="batch")
        created = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
        batch = wait(sdk, created.id, timeout=300)
        output = {line["custom_id"]: line["response"]["body"] for line in content(sdk, batch.output_file_id)}
    assert batch.status == "completed" and batch.error_file_id is None
    listed = CreateEmbeddingResponse.model_validate(output["list"])
    assert [d.index for d in listed.data] == [0, 1, 2]
    assert all(abs(unit_length(d.embedding) - 1.0) < 1e-5 for d in listed.data)
    guitar, other_guitar, stocks = (d.embedding for d in listed.data)
    assert cosine(guitar, other_guitar) > cosine(guitar, stocks)  # each vector is its own input's
    encoded = [d["embedding"] for d in output["b64"]["data"]]
    assert [from_base64(e) for e in encoded] == [pytest.approx(d.embedding, abs=1e-6) for d in listed.data[:2]]


@pytest.fixture(scope="session")
def matryoshka_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from anex_pipeline_tests.harness.tiny_models import build_matryoshka_embedding_model

    return build_matryoshka_embedding_model(tmp_path_factory.mktemp("models") / "minilm-matryoshka")


def talk_ids(model: Path, text: str) -> list[int]:
    """The token ids of one user message rendered with the model's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


def test_dimensions_shorten_the_vector_on_a_matryoshka_model(
    tmp_path: Path, real_runner: JobRunner, matryoshka_model: Path
) -> None:
    text = TEXTS["guitar-1"]
    rows = [
        {"custom_id": "full", "url": "/v1/embeddings", "body": {"input": text}},
        {"custom_id": "short", "url": "/v1/embeddings", "body": {"input": [text, TEXTS["stocks"]], "dimensions": 128}},
        # one conversation, as vLLM's /v1/embeddings takes it, and the same text as token ids
        {"custom_id": "talk", "url": "/v1/embeddings", "body": {"messages": [{"role": "user", "content": text}]}},
        {"custom_id": "talk-ids", "url": "/v1/embeddings", "body": {"input": talk_ids(matryoshka_model, text)}},
    ]
    options = {"model": str(matryoshka_model)}
    run_job(real_runner, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl", options)
    full, short, talk, talk_ids_answer = (
        CreateEmbeddingResponse.model_validate(line["response"]["body"]) for line in read_jsonl(tmp_path / "out.jsonl")
    )
    # the messages were rendered with the model's template, no special tokens added: as its token ids
    assert talk.usage.prompt_tokens == talk_ids_answer.usage.prompt_tokens
    assert talk.data[0].embedding == pytest.approx(talk_ids_answer.data[0].embedding, abs=1e-5)
    assert cosine(talk.data[0].embedding, full.data[0].embedding) < 0.999  # the template changed the text

    head = full.data[0].embedding[:128]
    for item in short.data:
        assert len(item.embedding) == 128, "a full-length vector came back for dimensions: 128"
        assert abs(unit_length(item.embedding) - 1.0) < 1e-5
    # Matryoshka shortening: the first 128 values of the full vector, made unit length again.
    assert short.data[0].embedding == pytest.approx([x / unit_length(head) for x in head], abs=1e-5)

    rows[1]["body"]["dimensions"] = 100  # not one of the model's lengths: refused before it runs
    with pytest.raises(JobRejected) as refused:
        real_runner.submit(str(write_jsonl(tmp_path / "in2.jsonl", rows)), str(tmp_path / "out2.jsonl"), options)
    [problem] = refused.value.problems
    assert (problem.line, problem.field) == (2, "body.dimensions") and "128, 256, 384" in problem.message
