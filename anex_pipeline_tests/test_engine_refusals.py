"""Rows vLLM cannot take, on the real engine: each fails alone as a 400 beside rows that complete,
and leaves nothing behind in the engine. The requests go to the engine directly, past the checks
made at submit, as a row those checks miss would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.engine.vllm.engine import VllmLocalEngine
from anex_pipeline.options import job_options
from anex_pipeline.runner import JobRunner
from anex_pipeline.stages.submit import prepare_job
from anex_pipeline_tests.harness.jobs import chat_row, write_jsonl

pytestmark = pytest.mark.engine


def shared_engine(tmp_path: Path, runner: JobRunner) -> VllmLocalEngine:
    """The engine the session's real runner uses for a default chat job."""
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("a", "Hello.")])
    job = prepare_job(src, str(tmp_path / "out.jsonl"), job_options({}), tmp_path / "work")
    engine = runner.engine.engine_for(job.manifest())
    assert isinstance(engine, VllmLocalEngine)
    return engine


def request(index: int, **fields: Any) -> EngineRequest:
    body = {"messages": [{"role": "user", "content": f"Name a colour ({index})."}]}
    return EngineRequest(index, f"k{index}", f"r{index}", "chat", body, max_tokens=8, **fields)


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_rows_vllm_cannot_take_fail_alone_and_leave_no_trace(tmp_path: Path, real_runner: JobRunner) -> None:
    engine = shared_engine(tmp_path, real_runner)
    requests = [
        request(0),
        request(1, sampling={"seed": 18446744073709551621}),  # too big for vLLM's message encoding
        request(2),
        request(3, response_format=schema_format({"$ref": "#"})),  # compiles, but allows no output
        request(4),
        request(5, response_format=schema_format({"type": "strnig"})),  # refused when added
        request(6),
    ]
    outcomes = engine.run(requests)

    assert [o.status_code for o in outcomes] == [200, 400, 200, 400, 200, 400, 200]
    assert all(o.body["choices"][0]["message"]["content"] for o in outcomes if o.status_code == 200)
    seed, looping, misspelt = (outcomes[i].error for i in (1, 3, 5))
    assert seed.type == "invalid_request_error"
    assert seed.message.startswith("the model rejected the request: OverflowError: can't serialize ints")
    assert looping.type == misspelt.type == "invalid_request_error"
    assert looping.param == misspelt.param == "response_format"
    assert "schema" in looping.message and "\n" not in looping.message
    assert misspelt.message.startswith("response_format cannot be used: ") and "strnig" in misspelt.message
    assert not engine.llm.llm_engine.has_unfinished_requests()  # no half-added request was left behind
    # and the engine goes on serving rows
    assert [o.status_code for o in engine.run([request(7), request(8)])] == [200, 200]
