"""The HTTP engine: rows sent to an OpenAI-compatible server, answers mapped to the result envelope.

The fast tests talk to a small fake server on loopback whose answer depends on the row's text
(``bad`` is refused with a 400, ``busy`` is rate-limited once, ``down`` always gets a 503,
``slow`` takes a moment). The engine test starts the real ``vllm serve`` with the embedded model.
"""

from __future__ import annotations

import base64
import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from anex_pipeline.cli import main
from anex_pipeline.engine.base import resolve_request
from anex_pipeline.engine.completions import Generated, chat_completion
from anex_pipeline.engine.config import EngineConfig, HttpSettings
from anex_pipeline.engine.http.engine import (
    OpenAIHttpEngine,
    ServerUnavailable,
    could_share_enough,
    named_context_error,
    row_error,
    tokenize_body,
)
from anex_pipeline.engine.http.replicas import ServersDown
from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL
from anex_pipeline.engine.prefix_order import PrefixCache, ordered
from anex_pipeline.engine.rows import run_checked
from anex_pipeline.engine.server.machine_server import prefix_cache
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.responses import chat_row as chat_row_of
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import InputRow, JobOptions
from anex_pipeline_tests.harness.jobs import chat_row, local_instance, read_jsonl, run_job, write_jsonl
from anex_pipeline_tests.harness.openai_server import SERVED, FakeServer, request
from anex_pipeline_tests.harness.ports import free_port
from anex_pipeline_tests.harness.vllm_serve import vllm_servers


@pytest.fixture
def server() -> Iterator[FakeServer]:
    fake = FakeServer()
    yield fake
    fake.close()


def engine_on(server: FakeServer, **settings: Any) -> OpenAIHttpEngine:
    defaults: dict[str, Any] = {"model_name": DEFAULT_CHAT_MODEL, "backoff_s": 0.01, "retries": 2}
    return OpenAIHttpEngine(HttpSettings(base_url=server.url, **{**defaults, **settings}))


def test_success_bodies_pass_through_and_carry_the_resolved_values(server: FakeServer) -> None:
    engine = engine_on(server, api_key="secret")
    chat = request(0, "hello", sampling={"temperature": 0.0, "seed": 7}, max_tokens=16)
    chat.body["max_completion_tokens"] = 99  # resolved into max_tokens already
    chat.response_format = {"type": "json_object"}
    chat.chat_template_kwargs = {"enable_thinking": False}
    outcomes = engine.run([chat, request(1, "world")])

    assert engine.model_name == SERVED  # the job left the model to its default: the server's one
    for outcome in outcomes:
        assert outcome.ok and outcome.status_code == 200
        assert outcome.body == server.answered[f"rid{outcome.index}"]
        ChatCompletion.model_validate(outcome.body)
        assert outcome.usage == {"prompt_tokens": 5, "completion_tokens": 3, "cached_prompt_tokens": 2}
    headers, sent = server.received["rid0"]
    assert headers["Authorization"] == "Bearer secret"
    assert sent["model"] == SERVED and sent["max_tokens"] == 16 and "max_completion_tokens" not in sent
    assert sent["temperature"] == 0.0 and sent["seed"] == 7
    assert sent["response_format"] == {"type": "json_object"}
    assert sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert "response_format" not in server.received["rid1"][1] and "max_tokens" not in server.received["rid1"][1]


def test_completions_validate_and_embeddings_come_back_unit_length(server: FakeServer) -> None:
    engine = engine_on(server)
    [text] = engine.run([request(0, "Once", "completions", max_tokens=4)])
    [vector] = engine.run([request(1, "a sentence", "embeddings", sampling={"temperature": 0.5})])

    assert Completion.model_validate(text.body).choices[0].text == " Once!"
    assert server.received["rid0"][1]["max_tokens"] == 4
    embedding = CreateEmbeddingResponse.model_validate(vector.body)
    assert embedding.data[0].embedding == pytest.approx([0.6, 0.8])
    assert vector.usage == {"prompt_tokens": 5}
    sent = server.received["rid1"][1]
    assert sent["encoding_format"] == "float" and "temperature" not in sent


def test_a_base64_embedding_is_encoded_here_from_the_unit_vector_and_dimensions_reach_the_server(
    server: FakeServer,
) -> None:
    row = request(0, "a sentence", "embeddings")
    row.body.update(encoding_format="base64", dimensions=2)
    [outcome] = engine_on(server).run([row])

    sent = server.received["rid0"][1]
    assert sent["encoding_format"] == "float" and sent["dimensions"] == 2  # the server shortens the vector
    encoded = outcome.body["data"][0]["embedding"]
    assert isinstance(encoded, str)
    assert struct.unpack("<2f", base64.b64decode(encoded)) == pytest.approx((0.6, 0.8))


def test_a_400_fails_only_its_row_with_the_servers_message_and_param(server: FakeServer) -> None:
    outcomes = engine_on(server).run([request(0, "fine"), request(1, "bad"), request(2, "also fine")])

    assert [o.status_code for o in outcomes] == [200, 400, 200]
    failed = outcomes[1]
    assert failed.body is None and failed.error is not None
    assert failed.error.as_dict() == {
        "message": "temperature must be at least 0",
        "type": "invalid_request_error",
        "code": 400,
        "param": "temperature",
    }
    assert server.attempts["bad"] == 1  # a refusal is final: never retried


@pytest.mark.parametrize(
    ("endpoint", "server_param", "param"),
    [("chat", "input_tokens", "messages"), ("completions", None, "prompt"), ("chat", "max_tokens", "max_tokens")],
)
def test_a_refusal_over_the_context_gets_openais_code(endpoint: str, server_param: str | None, param: str) -> None:
    message = "This model's maximum context length is 2048 tokens. However, your prompt contains 2100 input tokens."
    answer = httpx.Response(
        400, json={"error": {"message": message, "type": "BadRequestError", "param": server_param, "code": 400}}
    )
    error = named_context_error(row_error(answer), endpoint)
    assert (error.type, error.code, error.param, error.message) == (
        "invalid_request_error",
        "context_length_exceeded",
        param,
        message,
    )
    other = httpx.Response(400, json={"error": {"message": "temperature must be at least 0", "param": "temperature"}})
    assert named_context_error(row_error(other), endpoint).code is None


def test_a_429_is_retried_after_the_wait_the_server_asks_for(server: FakeServer) -> None:
    started = time.monotonic()
    [outcome] = engine_on(server).run([request(0, "busy")])

    assert outcome.ok and outcome.status_code == 200
    assert server.attempts["busy"] == 2
    assert time.monotonic() - started >= 1.0  # Retry-After: 1 wins over the 0.01 s backoff


def test_a_server_that_stays_down_ends_in_a_503_row_error_after_the_retries(server: FakeServer) -> None:
    outcomes = engine_on(server, retries=3).run([request(0, "down"), request(1, "up")])

    assert server.attempts["down"] == 4
    down = outcomes[0]
    assert down.status_code == 503 and down.body is None and down.error is not None
    assert (down.error.type, down.error.message, down.error.code) == ("engine_error", "overloaded", 503)
    assert outcomes[1].ok


def test_requests_in_flight_never_exceed_the_bound(server: FakeServer) -> None:
    outcomes = engine_on(server, max_concurrency=3).run([request(i, "slow") for i in range(12)])

    assert all(o.ok for o in outcomes) and [o.index for o in outcomes] == list(range(12))
    assert server.max_in_flight == 3


def test_a_lost_server_fails_the_stream_with_one_line_naming_it_after_its_probes(server: FakeServer) -> None:
    engine = engine_on(server, retries=2)
    server.close()

    with pytest.raises(ServersDown) as lost:
        engine.run([request(0, "hello")])

    message = str(lost.value)
    assert "\n" not in message and server.url in message and "Connection refused" in message
    assert "rows finished so far are kept" in message


def test_the_model_sent_is_the_one_the_server_serves(server: FakeServer) -> None:
    assert engine_on(server, model_name=SERVED, model_named=True).model_name == SERVED
    with pytest.raises(ServerUnavailable, match="not the job's model 'my/model'"):
        engine_on(server, model_name="my/model", model_named=True)
    with pytest.raises(ServerUnavailable, match="cannot reach"):
        OpenAIHttpEngine(HttpSettings(base_url=f"http://127.0.0.1:{free_port()}/v1", model_name="m", retries=0))


def test_cli_runs_a_job_on_the_server_given_by_base_url(
    tmp_path: Path, server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ANEX_API_KEY", "from-env")
    rows = [chat_row("a", "hello", max_tokens=8), chat_row("b", "bad", max_tokens=8)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"

    code = main(
        ["run", str(src), "-o", str(out), "--quiet", "--work-dir", str(tmp_path / "work"), "--base-url", server.url]
    )

    assert code == 0
    ok, bad = read_jsonl(out)
    assert ok["response"]["status_code"] == 200 and ok["error"] is None
    assert ok["response"]["body"]["choices"][0]["message"]["content"] == "echo: hello"
    assert bad["response"] == {"status_code": 400, "request_id": bad["response"]["request_id"], "body": None}
    assert bad["error"]["type"] == "invalid_request_error" and bad["error"]["param"] == "temperature"
    assert all(headers["Authorization"] == "Bearer from-env" for headers, _ in server.received.values())
    report = json.loads((tmp_path / "out.report.json").read_text())
    assert report["request_counts"] == {"total": 2, "completed": 1, "failed": 1, "format_error_rows": 0}
    assert report["usage"]["prompt_tokens"] >= 5 and report["usage"]["cached_prompt_tokens"] >= 2


# -- the real server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``vllm serve`` with the embedded chat model on a loopback port; always stopped afterwards."""
    with vllm_servers(tmp_path_factory.mktemp("vllm-serve"), 1) as [served]:
        yield served.url


@pytest.mark.vllm_serve
@pytest.mark.engine
def test_rows_sharing_a_document_reach_vllm_serve_together_by_its_own_tokens(vllm_server: str) -> None:
    """The server says what its prefix cache holds, and renders and tokenises each row itself:
    the tokens are the ones its generation counts, and rows of one document are ordered together."""
    cache = prefix_cache(vllm_server)
    assert cache is not None and cache.block_tokens > 0 and cache.capacity_tokens >= 1024
    engine = OpenAIHttpEngine(HttpSettings(base_url=vllm_server, model_name=DEFAULT_CHAT_MODEL))
    try:
        documents = [" ".join(f"fact {d}.{k} is about river {d}." for k in range(60)) for d in range(3)]
        rows = [  # question-major: each document's questions far apart in the file
            request(q * 3 + d, f"{documents[d]} Question {q}: which river?", max_tokens=1)
            for q in range(2)
            for d in range(3)
        ]
        assert engine.prefix_cache is None and engine.prompts_tokens(rows) == [None] * 6  # only when given a cache
        engine.prefix_cache = PrefixCache(block_tokens=cache.block_tokens, capacity_tokens=cache.block_tokens)
        tokens = engine.prompts_tokens(rows)
        [counted] = engine.run([rows[0]])
        assert counted.usage["prompt_tokens"] == len(tokens[0])  # the rendering generation used
        assert tokens[0][: 3 * cache.block_tokens] == tokens[3][: 3 * cache.block_tokens]
        assert [r.index % 3 for r in ordered(rows, engine)] == [0, 0, 1, 1, 2, 2]
    finally:
        engine.shutdown()


@pytest.mark.vllm_serve
@pytest.mark.engine
def test_a_job_through_vllm_serve_has_the_in_process_result_shape(tmp_path: Path, vllm_server: str) -> None:
    questions = ["What is the capital of France?", "Say hello.", "Name a colour."]
    rows = [chat_row(f"q-{i}", q, max_tokens=8, temperature=0) for i, q in enumerate(questions)]
    rows.insert(1, chat_row("too-long", "tell me a story " * 700, max_tokens=8))  # about 2,800 tokens
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    storage = StorageResource(work_root=str(tmp_path / "work"))
    with local_instance() as instance:
        runner = JobRunner(instance, storage, EngineConfig(base_url=vllm_server))
        try:
            report = run_job(runner, src, out)
        finally:
            runner.close()

    assert report.status == "completed"
    assert report.request_counts.model_dump() == {"total": 4, "completed": 3, "failed": 1, "format_error_rows": 0}
    assert report.usage.prompt_tokens > 0 and report.usage.completion_tokens > 0
    lines = read_jsonl(out)
    assert [line["custom_id"] for line in lines] == ["q-0", "too-long", "q-1", "q-2"]
    # The keys the in-process engine writes are all there (the server adds a few of its own).
    local = chat_completion("x", "m", Generated("text", "stop", 1, 1))
    for line in lines:
        assert set(line) == {"id", "custom_id", "response", "error"}
        assert set(line["response"]) == {"status_code", "request_id", "body"}
    for line in (lines[0], lines[2], lines[3]):
        body = line["response"]["body"]
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert body["model"] == DEFAULT_CHAT_MODEL
        assert set(local) <= set(body) and set(local["choices"][0]) <= set(body["choices"][0])
        assert set(local["choices"][0]["message"]) - {"reasoning_content"} <= set(body["choices"][0]["message"])
        completion = ChatCompletion.model_validate(body)
        assert completion.choices[0].message.content
        assert completion.usage is not None and 0 < completion.usage.completion_tokens <= 8
    long_row = lines[1]
    assert long_row["response"]["status_code"] == 400 and long_row["response"]["body"] is None
    assert set(long_row["error"]) == {"message", "type", "code", "param"}
    assert long_row["error"]["type"] == "invalid_request_error"
    assert "maximum context length" in long_row["error"]["message"]
    assert (long_row["error"]["code"], long_row["error"]["param"]) == ("context_length_exceeded", "messages")


def test_rows_that_cannot_share_much_are_not_sent_to_the_tokenizer() -> None:
    cache = PrefixCache(block_tokens=16, capacity_tokens=4096)
    unique = [request(i, f"question {i}: how far is town {i}?") for i in range(50)]
    assert not could_share_enough(unique, cache)
    document = "a long shared document, " * 200  # about 4,800 bytes
    assert could_share_enough([request(i, f"{document} question {i}") for i in range(3)], cache)
    with_tools = request(0, "hi")
    with_tools.body["tools"] = [{"type": "function", "function": {"name": "f"}}]
    assert could_share_enough([with_tools], cache), "a template may render the tools first"


def test_the_tokenize_body_is_the_rows_rendering_and_nothing_is_asked_about_media() -> None:
    chat = request(0, "hello", chat_template_kwargs={"enable_thinking": False})
    assert tokenize_body(chat, "m") == {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert tokenize_body(request(1, "once upon", "completions"), "m") == {"model": "m", "prompt": "once upon"}
    assert tokenize_body(request(2, "text", "embeddings"), "m") is None
    image = request(3, "x")
    image.body["messages"][0]["content"] = [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    ]
    assert tokenize_body(image, "m") is None


def test_a_responses_row_is_sent_as_chat_and_answered_as_a_response(server: FakeServer) -> None:
    body = {"input": "hello", "instructions": "Be brief.", "max_output_tokens": 8, "temperature": 0}
    row = chat_row_of(InputRow(0, "r0", body))
    req = resolve_request(row, "job", "responses", JobOptions(), None, None)
    [outcome] = run_checked(engine_on(server), [req])

    _, sent = server.received[req.request_id]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    assert sent["max_tokens"] == 8 and sent["temperature"] == 0
    assert not {"input", "instructions", "max_output_tokens"} & set(sent)
    answer = Response.model_validate(outcome.body)
    assert answer.output_text == server.answered[req.request_id]["choices"][0]["message"]["content"]
    assert answer.usage is not None and answer.usage.input_tokens_details.cached_tokens == 2
    assert (answer.usage.input_tokens, answer.usage.output_tokens, answer.instructions) == (5, 3, "Be brief.")
