"""Score and rerank rows: their checks at submit, their pairs, and their results' shapes through
a whole job on the fake engine (the real engine and ``vllm serve`` are in test_engine_scoring.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anex_pipeline.engine.http.engine import ENDPOINT_PATHS, request_body
from anex_pipeline.engine.scoring import score_pairs
from anex_pipeline.request_fields import MAX_SCORE_TEXT_CHARS, MAX_SCORE_TEXTS
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobRejected
from anex_pipeline.validate import check_body
from anex_pipeline_tests.harness.jobs import answers, read_jsonl, write_jsonl
from anex_pipeline_tests.harness.tiny_models import write_config

NAMES = frozenset({"cross"})


def problems(body: Any, endpoint: str) -> list[tuple[str, str]]:
    return [(p.field, p.message) for p in check_body(body, endpoint, NAMES)]  # type: ignore[arg-type]


def score_row(cid: str, text_1: Any, text_2: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/score", "body": {"text_1": text_1, "text_2": text_2}}


def rerank_row(cid: str, query: str, documents: list[str], **body: Any) -> dict[str, Any]:
    body = {"query": query, "documents": documents, **body}
    return {"custom_id": cid, "method": "POST", "url": "/v1/rerank", "body": body}


@pytest.mark.parametrize(
    "body",
    [
        {"text_1": "a", "text_2": "b"},
        {"text_1": "a", "text_2": ["b", "c"]},
        {"text_1": ["a", "b"], "text_2": ["c", "d"]},
        {"text_1": ["a"], "text_2": ["c", "d"]},
    ],
)
def test_score_rows_of_each_pairing_pass(body: dict[str, Any]) -> None:
    assert problems(body, "score") == []


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"text_2": "b"}, "body.text_1", "must be a string or a non-empty list of strings, got nothing"),
        ({"text_1": "a", "text_2": []}, "body.text_2", "non-empty list"),
        ({"text_1": "a", "text_2": ["b", 3]}, "body.text_2[1]", "must be a string, got a number"),
        ({"text_1": "", "text_2": "b"}, "body.text_1", "empty string"),
        ({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "body.text_1", "holds 2 texts but body.text_2 holds 3"),
        ({"text_1": ["a", "b"], "text_2": "c"}, "body.text_1", "holds 2 texts but body.text_2 holds 1"),
        ({"text_1": "a", "text_2": ["b"] * (MAX_SCORE_TEXTS + 1)}, "body.text_2", f"at most {MAX_SCORE_TEXTS}"),
        ({"text_1": "x" * (MAX_SCORE_TEXT_CHARS + 1), "text_2": "b"}, "body.text_1", "characters; at most"),
        ({"text_1": "a", "text_2": "b", "top_n": 1}, "body.top_n", "only of rerank"),
        ({"text_1": "a", "text_2": "b", "temperature": 0}, "body.temperature", "is not a field of score"),
    ],
)
def test_score_row_problems_name_their_field(body: dict[str, Any], field: str, words: str) -> None:
    found = problems(body, "score")
    assert [f for f, _ in found] == [field], found
    assert words in found[0][1]


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"documents": ["d"]}, "body.query", "got nothing"),
        ({"query": ["q1", "q2"], "documents": ["d"]}, "body.query", "must be one string"),
        ({"query": "q", "documents": []}, "body.documents", "non-empty list"),
        ({"query": "q", "documents": ["d", ""]}, "body.documents[1]", "empty string"),
        ({"query": "q", "documents": ["d"] * (MAX_SCORE_TEXTS + 1)}, "body.documents", "split it"),
        ({"query": "q", "documents": ["d"], "top_n": -1}, "body.top_n", "(0 to 2147483647)"),
        ({"query": "q", "documents": ["d"], "top_n": "2"}, "body.top_n", "integer"),
        ({"query": "q", "documents": ["d"], "text_1": "a"}, "body.text_1", "only of score"),
    ],
)
def test_rerank_row_problems_name_their_field(body: dict[str, Any], field: str, words: str) -> None:
    found = problems(body, "rerank")
    assert [f for f, _ in found] == [field], found
    assert words in found[0][1]


def test_pairs_follow_vllms_pairing() -> None:
    assert score_pairs("score", {"text_1": "q", "text_2": ["a", "b"]}) == [("q", "a"), ("q", "b")]
    assert score_pairs("score", {"text_1": ["x", "y"], "text_2": ["a", "b"]}) == [("x", "a"), ("y", "b")]
    assert score_pairs("score", {"text_1": "x", "text_2": "a"}) == [("x", "a")]
    assert score_pairs("rerank", {"query": "q", "documents": ["a", "b"]}) == [("q", "a"), ("q", "b")]


@pytest.mark.parametrize(("first", "second"), [("queries", "documents"), ("queries", "items"), ("data_1", "data_2")])
def test_vllms_other_spellings_of_a_score_row_pair_as_text_1_and_text_2(first: str, second: str) -> None:
    body = {first: ["x", "y"], second: ["a", "b"]}
    assert problems(body, "score") == []
    assert score_pairs("score", body) == score_pairs("score", {"text_1": ["x", "y"], "text_2": ["a", "b"]})
    assert problems({first: "q", second: []}, "score")[0][0] == f"body.{second}"
    mixed = problems({"text_1": "q", "text_2": ["a"], "queries": "q"}, "score")
    assert [f for f, _ in mixed] == ["body.queries"] and "one spelling" in mixed[0][1]


def test_vllms_own_score_and_rerank_urls_run_in_one_file(tmp_path: Path, fake_runner: JobRunner, model: str) -> None:
    """vLLM's run_batch batches: /score and /v1/score lines in one file, /rerank, /v1/rerank and
    /v2/rerank in another, each line in one of vLLM's spellings."""
    query, docs = (
        "What is the capital of France?",
        ["The capital of Brazil is Brasilia.", "The capital of France is Paris."],
    )
    rows = [
        {"custom_id": "request-1", "method": "POST", "url": "/score", "body": {"queries": query, "documents": docs}},
        {"custom_id": "request-2", "method": "POST", "url": "/v1/score", "body": {"queries": query, "items": docs}},
        {"custom_id": "request-3", "method": "POST", "url": "/score", "body": {"data_1": query, "data_2": docs}},
    ]
    report = fake_runner.run(
        fake_runner.submit(
            str(write_jsonl(tmp_path / "s.jsonl", rows)), str(tmp_path / "s.out.jsonl"), {"model": model}
        )
    )
    assert report.status == "completed" and report.request_counts.completed == 3
    scores = {
        k: [d["score"] for d in v["response"]["body"]["data"]] for k, v in answers(tmp_path / "s.out.jsonl").items()
    }
    assert scores["request-1"] == scores["request-2"] == scores["request-3"] and len(scores["request-1"]) == 2
    rerank = [
        {"custom_id": f"r-{n}", "method": "POST", "url": url, "body": {"query": query, "documents": docs}}
        for n, url in enumerate(("/rerank", "/v1/rerank", "/v2/rerank"))
    ]
    src = write_jsonl(tmp_path / "r.jsonl", rerank)
    report = fake_runner.run(fake_runner.submit(str(src), str(tmp_path / "r.out.jsonl"), {"model": model}))
    assert report.status == "completed" and report.request_counts.completed == 3
    lines = read_jsonl(tmp_path / "r.out.jsonl")
    assert all(line["error"] is None and line["response"]["body"]["results"] for line in lines)


def test_http_engine_posts_the_rows_texts_to_vllms_scoring_paths() -> None:
    from anex_pipeline.engine.base import EngineRequest

    req = EngineRequest(
        index=0, key="k", request_id="r", endpoint="rerank", body={"query": "q", "documents": ["a"], "top_n": 1}
    )
    assert ENDPOINT_PATHS["score"] == "/score" and ENDPOINT_PATHS["rerank"] == "/rerank"
    assert request_body(req, "cross") == {"query": "q", "documents": ["a"], "top_n": 1, "model": "cross"}


@pytest.fixture
def model(tmp_path: Path) -> str:
    """A local model folder the fake engine answers for (the submit check wants one that exists)."""
    return str(write_config(tmp_path / "cross", architectures=["BertForSequenceClassification"], num_labels=1))


def test_score_job_on_the_fake_engine_gives_score_responses(tmp_path: Path, fake_runner: JobRunner, model: str) -> None:
    rows = [
        score_row("s-pair", "the cat sat", "the cat ran"),
        score_row("s-many", "red apple", ["red apple", "green pear", "apple"]),
        score_row("s-zip", ["a b", "c d"], ["a b", "x y"]),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report = fake_runner.run(fake_runner.submit(str(src), str(tmp_path / "out.jsonl"), {"model": model}))
    assert report.status == "completed" and report.request_counts.completed == 3
    assert report.estimate.method.startswith("not needed")
    got = answers(tmp_path / "out.jsonl")
    body = got["s-many"]["response"]["body"]
    assert body["object"] == "list" and body["model"] == model and body["id"].startswith("score-")
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "score"), (1, "score"), (2, "score")]
    assert [d["score"] for d in body["data"]] == [1.0, 0.0, 0.5]
    assert body["usage"] == {"prompt_tokens": 11, "total_tokens": 11}
    assert [d["score"] for d in got["s-zip"]["response"]["body"]["data"]] == [1.0, 0.0]
    assert report.usage.prompt_tokens == 6 + 11 + 8


def test_rerank_job_sorts_by_score_and_keeps_top_n(tmp_path: Path, fake_runner: JobRunner, model: str) -> None:
    docs = ["green pear", "red apple pie", "red apple", "blue sky"]
    rows = [rerank_row("all", "red apple", docs), rerank_row("top", "red apple", docs, top_n=2)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report = fake_runner.run(fake_runner.submit(str(src), str(tmp_path / "out.jsonl"), {"model": model}))
    assert report.request_counts.completed == 2
    every = {line["custom_id"]: line["response"]["body"] for line in read_jsonl(tmp_path / "out.jsonl")}
    assert set(every["all"]) == {"id", "model", "usage", "results"}
    ranked = every["all"]["results"]
    assert [r["index"] for r in ranked] == [2, 1, 0, 3]  # ties (0.0) keep document order
    assert [r["document"] for r in ranked][:2] == [{"text": "red apple"}, {"text": "red apple pie"}]
    assert ranked[0]["relevance_score"] == 1.0
    assert every["top"]["results"] == ranked[:2]


def test_score_job_without_a_model_is_refused_in_one_line(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [score_row("s", "a", "b")])
    with pytest.raises(JobRejected) as caught:
        fake_runner.submit(str(src), str(tmp_path / "out.jsonl"), {})
    [problem] = caught.value.problems
    assert problem.field == "model" and "cross-encoder" in problem.message and "--model" in problem.message
    assert not (tmp_path / "out.jsonl").exists()


def test_bad_score_rows_refuse_the_job_with_their_lines(tmp_path: Path, fake_runner: JobRunner, model: str) -> None:
    rows = [score_row("ok", "a", "b"), score_row("bad", ["a", "b"], ["c"]), rerank_row("other", "q", ["d"])]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(JobRejected) as caught:
        fake_runner.submit(str(src), str(tmp_path / "out.jsonl"), {"model": model})
    found = {(p.line, p.field) for p in caught.value.problems}
    assert (2, "body.text_1") in found and any(line == 3 for line, _ in found)


def test_parquet_score_job_is_refused_in_one_line(tmp_path: Path, fake_runner: JobRunner, model: str) -> None:
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a"]}), src)
    with pytest.raises(JobRejected) as caught:
        fake_runner.submit(str(src), str(tmp_path / "out.parquet"), {"model": model, "endpoint": "rerank"})
    [problem] = caught.value.problems
    assert problem.field == "endpoint" and "JSONL requests to /v1/rerank" in problem.message
