"""Classify rows and the labels option: their checks at submit, their answers' shapes and the
Parquet columns, through whole jobs on the fake engine (the real engine and ``vllm serve`` are in
test_engine_classify.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anex_pipeline.engine.http.engine import ENDPOINT_PATHS, request_body
from anex_pipeline.engine.labels import label_tokens
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobRejected
from anex_pipeline.validate import check_body
from anex_pipeline_tests.harness.jobs import answers, chat_row, write_jsonl
from anex_pipeline_tests.harness.tiny_models import write_config

LABELS = ["positive", "negative", "neutral"]


def classify_row(cid: str, given: Any, url: str = "/v1/classify", **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"input": given, **body}}


@pytest.fixture
def model(tmp_path: Path) -> str:
    """A local model folder the fake engine answers for (the submit check wants one that exists)."""
    return str(write_config(tmp_path / "clf", architectures=["BertForSequenceClassification"], num_labels=2))


def submit(runner: JobRunner, src: Path, out: Path, options: dict[str, Any]) -> Any:
    return runner.run(runner.submit(str(src), str(out), options))


def refused(runner: JobRunner, src: Path, out: Path, options: dict[str, Any]) -> list[Any]:
    with pytest.raises(JobRejected) as caught:
        runner.submit(str(src), str(out), options)
    assert not out.exists()
    return caught.value.problems


def test_classify_rows_get_vllms_classify_response(tmp_path: Path, fake_runner: JobRunner, model: str) -> None:
    rows = [
        classify_row("one", "aeiou"),
        classify_row("two", ["xyz", "aaa b"], url="/classify"),  # vLLM's own path, in the same file
        classify_row("raw", "hello", use_activation=False),
    ]
    report = submit(fake_runner, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl", {"model": model})
    assert report.status == "completed" and report.request_counts.completed == 3
    assert report.estimate.method.startswith("not needed")
    got = {k: v["response"]["body"] for k, v in answers(tmp_path / "out.jsonl").items()}
    one = got["one"]
    assert one["object"] == "list" and one["model"] == model and one["id"].startswith("classify-")
    assert one["data"] == [{"index": 0, "label": "vowels", "probs": [1.0, 0.0], "num_classes": 2}]
    assert [(d["index"], d["label"]) for d in got["two"]["data"]] == [(0, "other"), (1, "vowels")]
    assert got["two"]["usage"]["prompt_tokens"] == 3 and got["two"]["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": []}, "body.input"),
        ({"input": ""}, "body.input"),
        ({"input": "x", "temperature": 0}, "body.temperature"),
        ({"input": "x", "use_activation": "yes"}, "body.use_activation"),
        ({"text": "x"}, "body.text"),
    ],
)
def test_classify_row_problems_name_their_field(body: dict[str, Any], field: str) -> None:
    found = [p.field for p in check_body(body, "classify", frozenset({"clf"}))]
    assert field in found, found


def test_a_classify_job_names_its_model_and_the_http_engine_posts_to_classify(
    tmp_path: Path, fake_runner: JobRunner
) -> None:
    problems = refused(fake_runner, write_jsonl(tmp_path / "in.jsonl", [classify_row("a", "x")]), tmp_path / "o", {})
    assert [p.field for p in problems] == ["model"] and "sequence-classification" in problems[0].message
    from anex_pipeline.engine.base import EngineRequest

    req = EngineRequest(index=0, key="k", request_id="r", endpoint="classify", body={"input": ["a", "b"]})
    assert ENDPOINT_PATHS["classify"] == "/classify"
    assert request_body(req, "clf") == {"input": ["a", "b"], "model": "clf"}


def test_a_parquet_classify_job_gives_label_and_probs_columns(
    tmp_path: Path, fake_runner: JobRunner, model: str
) -> None:
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["aeiou", "xyz"]}), src)
    report = submit(fake_runner, src, tmp_path / "out.parquet", {"model": model, "endpoint": "classify"})
    assert report.status == "completed"
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column_names == ["id", "text", "label", "probs", "error_type", "prompt_tokens"]
    assert table.column("label").to_pylist() == ["vowels", "other"]
    assert table.column("probs").to_pylist() == [[1.0, 0.0], [0.0, 1.0]]
    assert table.schema.field("probs").type == pa.list_(pa.float64())


def test_label_tokens_are_the_last_run_that_spells_the_label() -> None:
    entries = [{"token": t, "logprob": lp} for t, lp in [("<think>", -1), ("pos", -0.5), ("itive", -0.25), ("", -3)]]
    assert [e["token"] for e in label_tokens(entries, "positive")] == ["pos", "itive"]
    assert label_tokens(entries, "negative") == []
    again = [{"token": t, "logprob": 0} for t in ("neg", "ative", " ", "neg", "ative")]
    assert label_tokens(again, "negative") == again[3:]


def test_a_labels_job_answers_one_label_with_its_probability(tmp_path: Path, fake_runner: JobRunner) -> None:
    rows = [chat_row(f"r{n}", f"Review {n}: it was fine.") for n in range(6)]
    rows.append(chat_row("asks", "Review: great.", logprobs=True, top_logprobs=1))
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report = submit(fake_runner, src, tmp_path / "out.jsonl", {"labels": LABELS, "temperature": 0})
    assert report.request_counts.completed == 7
    lines = answers(tmp_path / "out.jsonl")
    for key, line in lines.items():
        body = line["response"]["body"]
        label = body["choices"][0]["message"]["content"]
        assert label in LABELS and body["anex"]["label"] == label, key
        assert 0 < body["anex"]["label_prob"] <= 1
        if key != "asks":  # the logprobs were asked for the probability alone: not in the answer
            assert body["choices"][0]["logprobs"] is None
    asked = lines["asks"]["response"]["body"]
    spelt = label_tokens(asked["choices"][0]["logprobs"]["content"], asked["anex"]["label"])
    assert "".join(e["token"] for e in spelt) == asked["anex"]["label"]
    assert math.isclose(sum(e["logprob"] for e in spelt), math.log(asked["anex"]["label_prob"]))


def test_a_parquet_labels_job_adds_label_and_label_prob(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["good", "bad", "meh"]}), src)
    report = submit(fake_runner, src, tmp_path / "out.parquet", {"labels": LABELS, "temperature": 0})
    assert report.status == "completed"
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column_names[:6] == ["prompt", "row_index", "output", "label", "label_prob", "error_type"]
    assert table.column("label").to_pylist() == table.column("output").to_pylist()
    assert all(0 < p <= 1 for p in table.column("label_prob").to_pylist())


@pytest.mark.parametrize(
    ("options", "field", "words"),
    [
        ({"labels": ["only"]}, "labels", "give 2 to 256"),
        ({"labels": ["a", "b", "a"]}, "labels", "twice"),
        ({"labels": ["a", ""]}, "labels[1]", "1 to 256 characters"),
        ({"labels": ["a", "b"], "response_format": {"type": "json_object"}}, "labels", "response_format"),
    ],
)
def test_bad_labels_options_are_refused(
    tmp_path: Path, fake_runner: JobRunner, options: dict[str, Any], field: str, words: str
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("a", "hi")])
    [problem] = refused(fake_runner, src, tmp_path / "out.jsonl", options)
    assert problem.field == field and words in problem.message


def test_labels_refuse_rows_that_hold_the_answer_otherwise_and_other_endpoints(
    tmp_path: Path, fake_runner: JobRunner
) -> None:
    rows = [
        chat_row("ok", "hi"),
        chat_row("own", "hi", structured_outputs={"choice": ["x", "y"]}),
        chat_row("many", "hi", n=2, temperature=1),
    ]
    problems = refused(fake_runner, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "o.jsonl", {"labels": LABELS})
    assert [(p.line, p.field) for p in problems] == [(2, "body.structured_outputs"), (3, "body.n")]
    emb = write_jsonl(tmp_path / "e.jsonl", [{"custom_id": "e", "url": "/v1/embeddings", "body": {"input": "x"}}])
    [problem] = refused(fake_runner, emb, tmp_path / "e.out.jsonl", {"labels": LABELS})
    assert problem.field == "labels" and "embeddings job" in problem.message
