"""/v1/responses rows on the fake engine: what they run as, the Responses objects they get back,
and what the submit check refuses. The real engine runs them in test_engine_responses.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types.responses import Response

from anex_pipeline.responses import chat_body
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobRejected
from anex_pipeline.testing import shared_fake_engine
from anex_pipeline_tests.harness.jobs import read_jsonl, responses_row, write_jsonl
from anex_pipeline_tests.harness.media import MediaServer

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


def test_a_responses_request_means_a_chat_request() -> None:
    body = {
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "what is this?"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a cat"}]},
            {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]},
        ],
        "instructions": "Be brief.",
        "max_output_tokens": 20,
        "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": True}},
        "reasoning": {"effort": "low"},
        "metadata": {"team": "x"},
    }
    assert chat_body(body) == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
        ],
        "max_tokens": 20,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}},
        "chat_template_kwargs": {"enable_thinking": True},
        "thinking_token_budget": 1024,
        "reasoning_effort": "low",
        "metadata": {"team": "x"},
    }
    quiet = chat_body({"input": "hi", "reasoning": {"effort": "minimal"}})
    assert quiet["chat_template_kwargs"] == {"enable_thinking": False} and "thinking_token_budget" not in quiet
    assert "thinking_token_budget" not in chat_body({"input": "hi", "reasoning": {"effort": "max"}})


def test_responses_rows_answer_with_responses_objects(tmp_path: Path, fake_runner: JobRunner) -> None:
    rows = [
        responses_row("plain", "tell me about owls", instructions="Be brief.", metadata={"n": "1"}, temperature=0),
        responses_row("cut", "tell me about owls", max_output_tokens=2),
        responses_row("json", [{"role": "user", "content": "owls?"}], text={"format": {"type": "json_object"}}),
        responses_row("long", "word " * 300),  # over the fake engine's context
        responses_row("over", "owls", max_output_tokens=2_000_000_000, temperature=0),
        responses_row("twin", "tell me about owls", instructions="Be brief.", metadata={"n": "1"}, temperature=0),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    engine = shared_fake_engine("HuggingFaceTB/SmolLM2-135M-Instruct")
    seen = len(engine.seen)
    report = fake_runner.run(
        fake_runner.submit(str(src), str(tmp_path / "out.jsonl"), {"system_prompt": "Be kind.", "max_tokens": 50})
    )
    lines = {line["custom_id"]: line for line in read_jsonl(tmp_path / "out.jsonl")}
    assert report.request_counts.completed == 5 and report.error_counts["context_length_exceeded"] == 1

    bodies = {cid: Response.model_validate(line["response"]["body"]) for cid, line in lines.items() if cid != "long"}
    plain = bodies["plain"]
    assert plain.object == "response" and plain.status == "completed" and plain.incomplete_details is None
    assert plain.output_text.startswith("answer to plain")
    assert (plain.instructions, plain.metadata, plain.temperature) == ("Be brief.", {"n": "1"}, 0)
    assert plain.usage is not None and plain.usage.total_tokens == plain.usage.input_tokens + plain.usage.output_tokens
    cut = bodies["cut"]
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens" and cut.usage is not None
    assert cut.usage.output_tokens == 2 and cut.instructions == "Be kind."  # the job's system prompt
    assert json.loads(bodies["json"].output_text) == {"answer": "json"}
    assert bodies["json"].text is not None and bodies["json"].text.format is not None
    assert bodies["json"].text.format.type == "json_object"
    # an identical deterministic row gets a copy of the answer, under its own ids
    twin = bodies["twin"]
    assert twin.output_text == plain.output_text and twin.id != plain.id and twin.output[0].id != plain.output[0].id
    assert "twin" not in engine.seen[seen:]

    long_row = lines["long"]
    assert long_row["response"]["status_code"] == 400 and long_row["response"]["body"] is None
    assert long_row["error"]["code"] == "context_length_exceeded" and long_row["error"]["param"] == "input"


def test_a_parquet_job_on_the_responses_endpoint(tmp_path: Path, fake_runner: JobRunner) -> None:
    pq.write_table(pa.table({"input": ["owls?", "cats?"]}), tmp_path / "in.parquet")
    job = fake_runner.submit(
        str(tmp_path / "in.parquet"), str(tmp_path / "out.parquet"), {"endpoint": "responses", "max_tokens": 3}
    )
    fake_runner.run(job)
    table = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["output"] for r in table] == ["answer to 0:", "answer to 1:"]
    assert [r["finish_reason"] for r in table] == ["length", "length"]
    assert [r["completion_tokens"] for r in table] == [3, 3]


@pytest.mark.parametrize(
    ("body", "field", "code", "words"),
    [
        ({"input": "hi", "max_tokens": 5}, "body.max_tokens", "unknown_parameter", "did you mean 'max_output_tokens'"),
        ({"input": "hi", "instruction": "x"}, "body.instruction", "unknown_parameter", "did you mean 'instructions'"),
        ({"instructions": "x"}, "body.input", "missing_required_parameter", "string input"),
        ({"input": []}, "body.input", "invalid_type", "non-empty list"),
        (
            {"input": [{"type": "function_call_output", "output": "x"}]},
            "body.input[0].type",
            "invalid_value",
            "message",
        ),
        ({"input": [{"role": "robot", "content": "x"}]}, "body.input[0].role", "invalid_value", "user"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "body.input[0].content[0].type",
            "invalid_value",
            "input_text",
        ),
        ({"input": "hi", "max_output_tokens": 0}, "body.max_output_tokens", "invalid_value", "outside the range"),
        ({"input": "hi", "reasoning": {"effort": "huge"}}, "body.reasoning.effort", "invalid_value", "medium"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}}},
            "body.text.format.json_schema",
            "unknown_parameter",
            "straight in text.format",
        ),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}},
            "body.text.format.name",
            "missing_required_parameter",
            "name",
        ),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "body.text.format.type", "invalid_value", "json_schema"),
    ],
)
def test_the_submit_check_names_what_is_wrong(
    tmp_path: Path, fake_runner: JobRunner, body: dict[str, Any], field: str, code: str, words: str
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "url": "/v1/responses", "body": body}])
    with pytest.raises(JobRejected) as rejected:
        fake_runner.submit(str(src), str(tmp_path / "out.jsonl"), {})
    (problem,) = rejected.value.problems
    assert (problem.line, problem.field, problem.code) == (1, field, code)
    assert words in problem.message


def test_images_by_url_are_fetched_and_a_failed_one_names_the_input_part(
    tmp_path: Path, fake_runner: JobRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANEX_MEDIA_CACHE_DIR", str(tmp_path / "media-cache"))
    server = MediaServer()
    try:

        def asking(url: str) -> list[dict[str, Any]]:
            parts = [{"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": url}]
            return [{"role": "user", "content": parts}]

        rows = [
            responses_row("found", asking(server.url("/img/1.png"))),
            responses_row("gone", asking(server.url("/x"))),
        ]
        src = write_jsonl(tmp_path / "in.jsonl", rows)
        options = {"max_tokens": 8, "media": {"allowed_hosts": ["127.0.0.1"], "max_retries": 0}}
        fake_runner.run(fake_runner.submit(str(src), str(tmp_path / "out.jsonl"), options))
    finally:
        server.close()
    found, gone = read_jsonl(tmp_path / "out.jsonl")
    assert Response.model_validate(found["response"]["body"]).status in ("completed", "incomplete")  # as data
    assert server.hits["/img/1.png"] == 1
    assert gone["error"]["type"] == "media_fetch_error" and gone["error"]["code"] == 404
    assert gone["error"]["param"] == "input[0].content[1]"
