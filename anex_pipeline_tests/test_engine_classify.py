"""Classify jobs on a tiny random sequence classifier (three labels): the in-process engine
(``LLM.classify``), as JSONL and as Parquet, against a real ``vllm serve`` of the same model asked
directly at its ``/classify`` and through the HTTP engine."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anex_pipeline.engine.config import EngineConfig
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.jobs import answers, local_instance, real_engine_resource, run_job, write_jsonl
from anex_pipeline_tests.harness.tiny_models import CLASSIFIER_LABELS, build_tiny_classifier
from anex_pipeline_tests.harness.vllm_serve import START_TIMEOUT_S, Served, start_server, stop_group, wait_healthy

pytestmark = [pytest.mark.engine, pytest.mark.vllm_serve]

TOLERANCE = 1e-4
TEXTS = ["The weather is lovely today.", "I lost my keys again.", "The meeting is at noon.", "What a mess!"]
BODIES: dict[str, dict[str, Any]] = {
    "one": {"input": TEXTS[0]},
    "several": {"input": TEXTS},
    "ids": {"input": [101, 7592, 2088, 102]},  # token ids, as given
    "logits": {"input": TEXTS[1], "use_activation": False},  # the raw logits
    "too-long": {"input": "word " * 600},  # past BERT's 512 positions
}


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_classifier(tmp_path_factory.mktemp("models") / "tiny-classifier")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, classifier: Path) -> Iterator[Served]:
    """``vllm serve`` of the classifier, started now and awaited by the test, so it loads while the
    in-process engine does."""
    server = start_server(tmp_path_factory.mktemp("vllm-serve") / "server.log", model=str(classifier))
    try:
        yield server
    finally:
        stop_group(server.proc)


def classified(engine: EngineConfig, folder: Path, model: Path) -> tuple[dict[str, Any], pa.Table]:
    """The rows of BODIES as a JSONL job and TEXTS as a Parquet job on one engine: each row's
    response (or its whole line when it failed) and the Parquet result."""
    folder.mkdir(parents=True, exist_ok=True)
    storage = StorageResource(work_root=str(folder / "work"))
    rows = [{"custom_id": key, "method": "POST", "url": "/v1/classify", "body": body} for key, body in BODIES.items()]
    src = write_jsonl(folder / "in.jsonl", rows)
    table = folder / "in.parquet"
    pq.write_table(pa.table({"id": [f"t{n}" for n in range(len(TEXTS))], "text": TEXTS}), table)
    with local_instance() as instance:
        runner = JobRunner(instance, storage, engine)
        try:
            report = run_job(runner, src, folder / "out.jsonl", {"model": str(model)})
            assert report.status == "completed" and report.request_counts.failed == 1
            report = run_job(runner, table, folder / "out.parquet", {"model": str(model), "endpoint": "classify"})
            assert report.status == "completed" and report.request_counts.completed == len(TEXTS)
        finally:
            runner.close()
    bodies = {key: line["response"]["body"] or line for key, line in answers(folder / "out.jsonl").items()}
    return bodies, pq.read_table(folder / "out.parquet")


def assert_close(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert [d["label"] for d in mine["data"]] == [d["label"] for d in theirs["data"]]
    assert (
        [d["num_classes"] for d in mine["data"]]
        == [d["num_classes"] for d in theirs["data"]]
        == [3] * len(mine["data"])
    )
    for a, b in zip(mine["data"], theirs["data"], strict=True):
        assert max(abs(x - y) for x, y in zip(a["probs"], b["probs"], strict=True)) <= TOLERANCE, (a, b)
    assert mine["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]


def test_in_process_classes_match_vllm_serve_and_the_http_engine(
    tmp_path: Path, classifier: Path, served: Served
) -> None:
    local, table = classified(real_engine_resource(), tmp_path / "local", classifier)
    too_long = local.pop("too-long")  # fails alone, with the model's reason
    assert too_long["response"]["status_code"] == 400 and too_long["error"]["param"] == "input"
    assert len(local["several"]["data"]) == len(TEXTS)
    probs = [d["probs"] for d in local["several"]["data"]]
    assert all(abs(sum(p) - 1) < 1e-5 for p in probs)  # softmax over three classes
    assert {d["label"] for d in local["several"]["data"]} <= set(CLASSIFIER_LABELS)
    spread = [p[2] for p in probs]
    assert max(spread) - min(spread) > 100 * TOLERANCE  # the model tells texts apart, so the match means something
    assert abs(sum(local["logits"]["data"][0]["probs"]) - 1) > 1e-3  # raw logits, no softmax
    # the Parquet job's columns hold what the JSONL rows' responses hold for the same texts
    assert table.column("label").to_pylist() == [d["label"] for d in local["several"]["data"]]
    for row, theirs in zip(table.column("probs").to_pylist(), probs, strict=True):
        assert max(abs(a - b) for a, b in zip(row, theirs, strict=True)) <= TOLERANCE

    wait_healthy(served, time.monotonic() + START_TIMEOUT_S)
    for key, body in BODIES.items():
        answer = httpx.post(f"{served.url}/classify", json={**body, "model": str(classifier)}, timeout=60)
        if key == "too-long":
            assert answer.status_code == 400, answer.text
            continue
        assert answer.status_code == 200, answer.text
        assert_close(local[key], answer.json())

    remote, remote_table = classified(EngineConfig(base_url=served.url), tmp_path / "http", classifier)
    assert remote.pop("too-long")["response"]["status_code"] == 400
    for key in local:
        assert_close(local[key], remote[key])
    assert remote_table.column("label").to_pylist() == table.column("label").to_pylist()
