"""Score and rerank jobs on a tiny random cross-encoder: the in-process engine (``LLM.score``)
against a real ``vllm serve`` of the same model, asked directly and through the HTTP engine."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from anex_pipeline.engine.config import EngineConfig
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobReport
from anex_pipeline_tests.harness.jobs import answers, local_instance, real_engine_resource, run_job, write_jsonl
from anex_pipeline_tests.harness.tiny_models import build_tiny_cross_encoder
from anex_pipeline_tests.harness.vllm_serve import START_TIMEOUT_S, Served, start_server, stop_group, wait_healthy

pytestmark = [pytest.mark.engine, pytest.mark.vllm_serve]

TOLERANCE = 1e-4
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "France borders Spain.", "The sky is blue."]
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "pair": ("/v1/score", {"text_1": "What is the capital of France?", "text_2": "Paris is the capital of France."}),
    "one-to-many": ("/v1/score", {"text_1": "capital of France", "text_2": DOCS}),
    "many-to-many": ("/v1/score", {"text_1": ["a cat", "a dog"], "text_2": ["a kitten", "a car"]}),
    "too-long": ("/v1/score", {"text_1": "a question", "text_2": "word " * 600}),  # past BERT's 512 positions
    "rerank-all": ("/v1/rerank", {"query": "What is the capital of France?", "documents": DOCS}),
    "rerank-top": ("/v1/rerank", {"query": "What is the capital of France?", "documents": DOCS, "top_n": 2}),
}


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_cross_encoder(tmp_path_factory.mktemp("models") / "tiny-cross-encoder")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, cross_encoder: Path) -> Iterator[Served]:
    """``vllm serve`` of the cross-encoder, started now and awaited by the test that needs it, so
    it loads while the in-process engine does."""
    server = start_server(tmp_path_factory.mktemp("vllm-serve") / "server.log", model=str(cross_encoder))
    try:
        yield server
    finally:
        stop_group(server.proc)


def scored(runner_engine: EngineConfig, tmp_path: Path, model: Path) -> tuple[list[JobReport], dict[str, Any]]:
    """Runs the rows of BODIES as JSONL jobs, one per endpoint (a file holds one), on one engine;
    the reports and each row's response body."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    storage = StorageResource(work_root=str(tmp_path / "work"))
    reports, bodies = [], {}
    with local_instance() as instance:
        runner = JobRunner(instance, storage, runner_engine)
        try:
            for name in ("score", "rerank"):
                url = f"/v1/{name}"
                rows = [
                    {"custom_id": key, "method": "POST", "url": url, "body": body}
                    for key, (row_url, body) in BODIES.items()
                    if row_url == url
                ]
                src = write_jsonl(tmp_path / f"{name}.jsonl", rows)
                out = tmp_path / f"{name}.results.jsonl"
                reports.append(run_job(runner, src, out, {"model": str(model)}))
                bodies.update({key: line["response"]["body"] or line for key, line in answers(out).items()})
        finally:
            runner.close()
    return reports, bodies


def scores_of(body: dict[str, Any]) -> list[tuple[int, float]]:
    """A body's (index, score) items in its own order: score data, or rerank results as ranked."""
    if "results" in body:
        return [(r["index"], r["relevance_score"]) for r in body["results"]]
    return [(d["index"], d["score"]) for d in body["data"]]


def assert_close(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    ours, servers = scores_of(mine), scores_of(theirs)
    assert [i for i, _ in ours] == [i for i, _ in servers], (ours, servers)
    for (_, a), (_, b) in zip(ours, servers, strict=True):
        assert abs(a - b) <= TOLERANCE, (ours, servers)
    assert mine["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]


def test_in_process_scores_match_vllm_serve_and_the_http_engine(
    tmp_path: Path, cross_encoder: Path, served: Served
) -> None:
    reports, local = scored(real_engine_resource(), tmp_path / "local", cross_encoder)
    assert [r.status for r in reports] == ["completed", "completed"]
    assert sum(r.request_counts.completed for r in reports) == len(BODIES) - 1
    too_long = local.pop("too-long")  # fails alone, with the model's reason
    assert too_long["response"]["status_code"] == 400 and too_long["error"]["type"] == "invalid_request_error"
    assert sum(r.usage.prompt_tokens for r in reports) == sum(body["usage"]["prompt_tokens"] for body in local.values())
    assert len(local["one-to-many"]["data"]) == len(DOCS)
    ranked = local["rerank-all"]["results"]
    assert [r["relevance_score"] for r in ranked] == sorted((r["relevance_score"] for r in ranked), reverse=True)
    assert {r["document"]["text"] for r in ranked} == set(DOCS)
    top = local["rerank-top"]["results"]  # scored in another batch: equal to float32's last digits
    assert [r["index"] for r in top] == [r["index"] for r in ranked[:2]]
    assert all(abs(a["relevance_score"] - b["relevance_score"]) <= TOLERANCE for a, b in zip(top, ranked, strict=False))
    spread = [s for _, s in scores_of(local["one-to-many"])]
    assert max(spread) - min(spread) > 100 * TOLERANCE  # the model tells pairs apart, so the match means something

    wait_healthy(served, time.monotonic() + START_TIMEOUT_S)
    for key, (url, body) in BODIES.items():
        if key not in local:
            continue
        path = url.removeprefix("/v1")  # vLLM serves /score and /rerank (and the /v1 spellings, with a warning)
        answer = httpx.post(f"{served.url}{path}", json={**body, "model": str(cross_encoder)}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert_close(local[key], answer.json())

    reports, remote = scored(EngineConfig(base_url=served.url), tmp_path / "http", cross_encoder)
    assert [r.status for r in reports] == ["completed", "completed"]
    assert remote.pop("too-long")["response"]["status_code"] == 400
    for key in local:
        assert_close(local[key], remote[key])
