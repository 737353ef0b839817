"""/v1/responses rows on the real engine (the session's shared one): a JSONL job, structured output
through text.format, and a Batch API batch on that endpoint driven with the openai SDK."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from openai.types.responses import Response

from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.batch_api import client, content, serving, wait
from anex_pipeline_tests.harness.jobs import read_jsonl, responses_row, run_job, write_jsonl

pytestmark = pytest.mark.engine

COLOUR = {
    "type": "object",
    "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
    "required": ["colour"],
    "additionalProperties": False,
}
COLOUR_FORMAT = {"type": "json_schema", "name": "colour", "schema": COLOUR, "strict": True}


def test_20_row_responses_job(tmp_path: Path, real_runner: JobRunner) -> None:
    rows = [responses_row(f"r{i}", f"What is {i} plus {i}?", max_output_tokens=12, temperature=0) for i in range(16)]
    rows += [
        responses_row("items", [{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}]),
        responses_row("told", "Name a fruit.", instructions="Answer with one word.", temperature=0),
        responses_row("cut", "Tell me a long story about a dragon.", max_output_tokens=3, temperature=0),
        responses_row("json", "Pick a colour of the sky.", text={"format": COLOUR_FORMAT}, max_output_tokens=30),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report = run_job(real_runner, src, tmp_path / "out.jsonl", {"max_tokens": 16})
    assert report.status == "completed" and report.request_counts.completed == 20

    lines = read_jsonl(tmp_path / "out.jsonl")
    assert [line["custom_id"] for line in lines] == [row["custom_id"] for row in rows]
    bodies = {line["custom_id"]: Response.model_validate(line["response"]["body"]) for line in lines}
    for cid, body in bodies.items():
        assert body.object == "response" and body.model == report.model
        assert body.output_text.strip(), cid
        assert body.usage is not None and body.usage.input_tokens > 10  # the chat template around the prompt
        assert body.usage.total_tokens == body.usage.input_tokens + body.usage.output_tokens
        assert body.status in ("completed", "incomplete")
        assert (body.status == "incomplete") == (body.incomplete_details is not None)
    assert all(bodies[f"r{i}"].usage.output_tokens <= 12 for i in range(16))  # type: ignore[union-attr]
    assert bodies["told"].instructions == "Answer with one word."
    assert bodies["items"].usage.output_tokens <= 16  # type: ignore[union-attr]  # the job's cap
    cut = bodies["cut"]
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage is not None and cut.usage.output_tokens == 3
    structured = bodies["json"]
    assert structured.status == "completed"
    jsonschema.validate(json.loads(structured.output_text), COLOUR)
    assert structured.text is not None and structured.text.format is not None
    assert structured.text.format.type == "json_schema"
    assert report.usage.completion_tokens == sum(b.usage.output_tokens for b in bodies.values())  # type: ignore[union-attr]


def test_batch_api_batch_on_the_responses_endpoint(tmp_path: Path, real_runner: JobRunner) -> None:
    rows = [
        responses_row("a", "What is the capital of France?", max_output_tokens=10, temperature=0),
        responses_row("b", [{"role": "user", "content": "Say hello."}], instructions="Be brief.", temperature=0),
        responses_row("long", "tell me a story " * 700),  # about 2,800 tokens, over the 2,048-token context
        responses_row("greedy", "Hi.", max_output_tokens=2040),  # more than the prompt leaves of the context
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    with serving(real_runner) as url:
        sdk = client(url)
        with src.open("rb") as f:
            uploaded = sdk.files.create(file=f, purpose="batch")
        created = sdk.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/responses",
            completion_window="24h",
            metadata={"anex_options": json.dumps({"max_tokens": 12})},
        )
        batch = wait(sdk, created.id, timeout=300)
        output, errors = content(sdk, batch.output_file_id), content(sdk, batch.error_file_id)
    assert batch.status == "completed" and batch.endpoint == "/v1/responses"
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 2)
    assert [line["custom_id"] for line in output] == ["a", "b"]
    for line in output:
        body = Response.model_validate(line["response"]["body"])
        assert body.status in ("completed", "incomplete") and body.output_text.strip()
    assert "Paris" in Response.model_validate(output[0]["response"]["body"]).output_text
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("long", 400), ("greedy", 400)]
    assert [(e["error"]["code"], e["error"]["param"]) for e in errors] == [
        ("context_length_exceeded", "input"),
        ("context_length_exceeded", "max_output_tokens"),
    ]
    assert "max_output_tokens is 2040" in errors[1]["error"]["message"]
