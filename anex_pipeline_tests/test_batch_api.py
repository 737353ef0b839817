"""The OpenAI-compatible Batch API, served for real on loopback and driven only with the ``openai`` SDK.

Most tests run on the fake engine; the one marked ``engine`` runs a tiny batch on the embedded
model through real vLLM and compares it with the same input run directly through the pipeline.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import shutil
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
import openai
import pytest
from openai import OpenAI
from openai.types import Batch, CreateEmbeddingResponse

from anex_pipeline import cli
from anex_pipeline.batch_api.requests import MAX_OPTIONS_BYTES, MAX_SYSTEM_PROMPT_BYTES
from anex_pipeline.batches.store import Store
from anex_pipeline.cli.parser import UsageError, _media_policy, build_parser
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import MediaOptions
from anex_pipeline.stages import submit as submit_stage
from anex_pipeline.testing import fake_engine
from anex_pipeline.workdir import layout
from anex_pipeline.workdir.manifest import JobDir
from anex_pipeline_tests.harness.batch_api import (
    DONE,
    KEY_A,
    KEY_B,
    client,
    content,
    rows,
    serve_process,
    serving,
    submit,
    wait,
    wait_for_rows,
)
from anex_pipeline_tests.harness.fake_cli import SLOW_FAKE
from anex_pipeline_tests.harness.jobs import chat_row, local_instance, read_jsonl, run_job, write_jsonl
from anex_pipeline_tests.harness.media import MediaServer, image, media_row
from anex_pipeline_tests.harness.stepping import STEPPING, StepGate, SteppingEngine, stepping


def comparable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Result rows without what differs between two jobs of the same input: the completion's id
    (made from the job id) and its creation time."""
    for row in rows:
        body = row["response"]["body"]
        if body is not None:
            body.pop("id")
            body.pop("created")
    return rows


def test_sdk_round_trip_matches_the_pipeline(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(6, long_one=4))
    options = {"max_tokens": 16, "temperature": 0}
    run_job(fake_runner, src, tmp_path / "direct.jsonl", options)
    direct = read_jsonl(tmp_path / "direct.jsonl")
    with serving(fake_runner) as url:
        sdk = client(url)
        created = submit(sdk, src, options)
        assert created.status in {"validating", "in_progress"}
        assert created.metadata == {"team": "tests", "anex_options": json.dumps(options)}
        batch = wait(sdk, created.id)
        assert batch.status == "completed", batch.errors
        assert batch.request_counts is not None
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 5, 1)
        assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
        assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
        assert batch.usage is not None and batch.usage.output_tokens > 0
        output, errors = content(sdk, batch.output_file_id), content(sdk, batch.error_file_id)
        assert sdk.files.retrieve(batch.output_file_id).purpose == "batch_output"  # type: ignore[arg-type]
        listed = sdk.batches.list()
        assert [b.id for b in listed.data] == [batch.id]
    # The batch ran as an ordinary job: its own `jobs` partition, materialized by Dagster runs.
    (job_id,) = [p for p in fake_runner.instance.get_dynamic_partitions("jobs") if p.startswith(batch.id)]
    result = fake_runner.instance.get_latest_materialization_event(dg.AssetKey("result_file"))
    assert result is not None and result.dagster_event is not None
    assert result.dagster_event.partition == job_id
    assert comparable(output) == comparable([r for r in direct if r["error"] is None])
    assert errors == [r for r in direct if r["error"] is not None]
    assert [r["custom_id"] for r in errors] == ["r4"] and errors[0]["response"]["status_code"] == 400
    assert (errors[0]["error"]["code"], errors[0]["error"]["param"]) == ("context_length_exceeded", "messages")


def test_another_key_sees_nothing(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(2))
    with serving(fake_runner) as url:
        alice, bob = client(url, KEY_A), client(url, KEY_B)
        batch = wait(alice, submit(alice, src, {"max_tokens": 8}).id)
        assert batch.status == "completed"
        for attempt in (
            lambda: bob.batches.retrieve(batch.id),
            lambda: bob.batches.cancel(batch.id),
            lambda: bob.files.retrieve(batch.input_file_id),
            lambda: bob.files.content(batch.output_file_id),  # type: ignore[arg-type]
            lambda: bob.batches.create(
                input_file_id=batch.input_file_id, endpoint="/v1/chat/completions", completion_window="24h"
            ),
        ):
            with pytest.raises(openai.NotFoundError):
                attempt()
        assert bob.batches.list().data == []
        assert alice.batches.retrieve(batch.id).status == "completed"


def test_malformed_input_fails_with_line_numbered_errors(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            chat_row("a", "fine"),
            '{"custom_id": "b", "body": ',
            {"body": {"messages": [{"role": "user", "content": "x"}]}},
        ],
    )
    with serving(fake_runner) as url:
        sdk = client(url)
        batch = wait(sdk, submit(sdk, src).id)
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors is not None and batch.errors.data is not None
    assert [(e.line, e.code) for e in batch.errors.data] == [(2, "invalid_json"), (3, "missing_required_parameter")]
    assert batch.errors.data[1].param == "custom_id"
    assert batch.output_file_id is None


def test_cancel_delivers_the_finished_rows(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(40))
    gate = StepGate()
    stepping[0] = SteppingEngine(gate=gate)
    runner = JobRunner(instance, StorageResource(work_root=str(tmp_path / "work")), fake_engine(STEPPING))
    with serving(runner) as url:
        sdk = client(url)
        batch = submit(sdk, src, {"max_tokens": 8, "checkpoint_rows": 1})
        wait(sdk, batch.id, until={"in_progress"})
        gate.release(3)
        wait_for_rows(sdk, batch.id, 3)
        cancelling = sdk.batches.cancel(batch.id)  # while the engine waits for its fourth step
        assert cancelling.status in {"cancelling", "cancelled"} and cancelling.cancelling_at is not None
        batch = wait(sdk, batch.id)
        output = content(sdk, batch.output_file_id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    assert batch.request_counts is not None
    assert batch.request_counts.completed == len(output) == 3
    assert [r["custom_id"] for r in output] == [f"r{i}" for i in range(len(output))]


@pytest.mark.slow
def test_restart_keeps_records_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANEX_FAKE_ROW_DELAY_S", "0.1")
    src = write_jsonl(tmp_path / "in.jsonl", rows(30))
    storage = StorageResource(work_root=str(tmp_path / "work"))
    home = tmp_path / "dagster_home"  # a SQLite instance on disk, opened twice
    home.mkdir()
    with (
        local_instance(str(home), set_dagster_home=True) as instance,
        serving(JobRunner(instance, storage, fake_engine(SLOW_FAKE))) as url,
    ):
        sdk = client(url)
        batch = submit(sdk, src, {"max_tokens": 8, "checkpoint_rows": 2})
        wait_for_rows(sdk, batch.id, 4)
    with local_instance(str(home), set_dagster_home=True) as instance:
        # No keys given: the ones stored (hashed) at the first start are still valid.
        with serving(JobRunner(instance, storage, fake_engine(SLOW_FAKE)), keys=None) as url:
            sdk = client(url)
            listed = sdk.batches.list().data
            assert [(b.id, b.status) for b in listed] == [(batch.id, "in_progress")]
            assert listed[0].request_counts is not None and 4 <= listed[0].request_counts.completed < 30
            assert sdk.files.retrieve(batch.input_file_id).bytes == src.stat().st_size
            resumed = wait(sdk, batch.id)
            assert resumed.status == "completed", resumed.errors
            assert [r["custom_id"] for r in content(sdk, resumed.output_file_id)] == [f"r{i}" for i in range(30)]
        runs = instance.get_runs(dg.RunsFilter(job_name="shard_job"))
        assert runs, "the resumed shard ran as a Dagster run on the instance"


def test_same_idempotency_key_same_batch(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(2))
    with serving(fake_runner) as url:
        alice, bob = client(url, KEY_A), client(url, KEY_B)
        with src.open("rb") as f:
            uploaded = alice.files.create(file=f, purpose="batch")
        args: dict[str, Any] = {
            "input_file_id": uploaded.id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "extra_headers": {"Idempotency-Key": "order-17"},
        }
        first, again = alice.batches.create(**args), alice.batches.create(**args)
        assert again.id == first.id
        assert wait(alice, first.id).status == "completed"
        assert [b.id for b in alice.batches.list().data] == [first.id]
        with src.open("rb") as f:
            bobs = bob.files.create(file=f, purpose="batch")
        assert bob.batches.create(**{**args, "input_file_id": bobs.id}).id != first.id  # keys are per API key


def test_size_limits_and_keys(tmp_path: Path, fake_runner: JobRunner) -> None:
    big = write_jsonl(tmp_path / "big.jsonl", rows(40))
    assert big.stat().st_size > 2000
    bob_hash = hashlib.sha256(KEY_B.encode()).hexdigest()
    with serving(fake_runner, [KEY_A, f"sha256:{bob_hash}"], max_upload_bytes=2000, max_body_bytes=1000) as url:
        sdk = client(url)
        assert client(url, KEY_B).batches.list().data == []  # a key configured by its hash only
        with pytest.raises(openai.AuthenticationError):
            client(url, f"sha256:{bob_hash}").batches.list()  # the stored hash is not a key
        with pytest.raises(openai.APIStatusError) as too_big, big.open("rb") as f:
            sdk.files.create(file=f, purpose="batch")
        assert too_big.value.status_code == 413
        assert too_big.value.body["code"] == "request_too_large"  # type: ignore[index]
        embedded = {"endpoint": "/v1/chat/completions", "requests": [{"custom_id": "x", "body": {"p": "y" * 2000}}]}
        with pytest.raises(openai.APIStatusError) as too_big:
            sdk.post("/batches", body=embedded, cast_to=Batch)
        assert too_big.value.status_code == 413
        with pytest.raises(openai.AuthenticationError) as wrong:
            client(url, "sk-not-a-key").batches.list()
        assert wrong.value.body["code"] == "invalid_api_key"  # type: ignore[index]
        with pytest.raises(openai.AuthenticationError) as missing:
            sdk.batches.list(extra_headers={"Authorization": openai.omit})
        assert missing.value.body["code"] == "missing_api_key"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as bad:
            sdk.batches.create(input_file_id="file-x", endpoint="/v1/moderations", completion_window="24h")
        assert bad.value.body["param"] == "endpoint"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as bad:
            sdk.post(
                "/batches",
                body={"endpoint": "/v1/chat/completions", "requests": [], "anex_options": {"max_token": 3}},
                cast_to=Batch,
            )
        assert "max_token" in bad.value.message and "max_tokens" in bad.value.message
        assert bad.value.body["code"] == "unknown_parameter"  # type: ignore[index]
        for options in ({"logprobs": True}, {"n": 3}):  # a batch's rows ask for these in their own bodies
            with pytest.raises(openai.BadRequestError) as bad:
                sdk.post(
                    "/batches",
                    body={"endpoint": "/v1/chat/completions", "requests": [], "anex_options": options},
                    cast_to=Batch,
                )
            [name] = options
            assert f"{name}:" in bad.value.message and "body" in bad.value.message, bad.value.message


def test_validation_errors_carry_openais_codes(tmp_path: Path, fake_runner: JobRunner) -> None:
    """Metadata over OpenAI's limits, and requests that are not JSON, lack a field or give one of
    the wrong kind, are refused with the code OpenAI gives each."""
    src = write_jsonl(tmp_path / "in.jsonl", rows(1))
    args = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
    with serving(fake_runner) as url:
        sdk = client(url)
        with src.open("rb") as f:
            args["input_file_id"] = sdk.files.create(file=f, purpose="batch").id
        refusals = {
            "string_above_max_length": [{"k" * 65: "v"}, {"k": "v" * 513}],
            "object_above_max_properties": [{f"k{n}": "v" for n in range(17)}],
        }
        for code, cases in refusals.items():
            for metadata in cases:
                with pytest.raises(openai.BadRequestError) as refused:
                    sdk.batches.create(**args, metadata=metadata)  # type: ignore[arg-type]
                assert refused.value.body["code"] == code, metadata  # type: ignore[index]
        longest = {f"k{n:02d}" + "k" * 61: "v" * 512 for n in range(16)}  # 16 pairs at the limits
        assert sdk.batches.create(**args, metadata=longest).metadata == longest  # type: ignore[arg-type]
        for body, code, param in (
            ("{not json", "invalid_json", None),
            (
                json.dumps({"completion_window": "24h", "input_file_id": "file-x"}),
                "missing_required_parameter",
                "endpoint",
            ),
            (json.dumps({**args, "metadata": {"a": 5}}), "invalid_type", "metadata.a"),
            (json.dumps({**args, "completion_window": "1h"}), "invalid_value", "completion_window"),
        ):
            answer = httpx.post(
                f"{url}/batches", content=body, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=10
            )
            assert answer.status_code == 400
            assert (answer.json()["error"]["code"], answer.json()["error"]["param"]) == (code, param), body


def test_embedded_requests(tmp_path: Path, fake_runner: JobRunner) -> None:
    requests = [
        {"custom_id": f"e{i}", "body": {"messages": [{"role": "user", "content": f"hi {i}"}]}} for i in range(3)
    ]
    with serving(fake_runner) as url:
        sdk = client(url)
        created = sdk.post(
            "/batches",
            body={"endpoint": "/v1/chat/completions", "requests": requests, "anex_options": {"max_tokens": 8}},
            cast_to=Batch,
        )
        batch = wait(sdk, created.id)
        output = content(sdk, batch.output_file_id)
        sent = content(sdk, batch.input_file_id)
    assert batch.status == "completed"
    assert [r["custom_id"] for r in output] == ["e0", "e1", "e2"]
    assert batch.model_extra is not None and batch.model_extra["results"] == output
    assert sent[0] == {"method": "POST", "url": "/v1/chat/completions", **requests[0]}


@pytest.mark.engine
def test_real_engine_batch_matches_the_pipeline(tmp_path: Path, real_runner: JobRunner) -> None:
    src = write_jsonl(
        tmp_path / "tiny.jsonl",
        [chat_row("q1", "What is the capital of France?"), chat_row("q2", "Say hello."), chat_row("q3", "2+2=?")],
    )
    options = {"max_tokens": 12, "temperature": 0, "seed": 1}
    report = run_job(real_runner, src, tmp_path / "direct.jsonl", options)  # loads the session's engine here
    direct = read_jsonl(tmp_path / "direct.jsonl")
    with serving(real_runner) as url:
        sdk = client(url)
        batch = wait(sdk, submit(sdk, src, options).id, timeout=300)
        output = content(sdk, batch.output_file_id)
    assert batch.status == "completed" and batch.error_file_id is None
    assert batch.model == report.model
    assert comparable(output) == comparable(direct)
    assert all(r["response"]["body"]["choices"][0]["message"]["content"] for r in output)


def media_batch(sdk: OpenAI, path: Path, **extra: Any) -> Batch:
    """A batch of ``path`` created with its job options in the body (``anex_options``) or in
    ``metadata``, as given."""
    with path.open("rb") as f:
        uploaded = sdk.files.create(file=f, purpose="batch")
    body = {"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **extra}
    return sdk.post("/batches", body=body, cast_to=Batch)


def test_callers_cannot_open_media_hosts_or_raise_limits(
    tmp_path: Path, fake_runner: JobRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANEX_MEDIA_CACHE_DIR", str(tmp_path / "media-cache"))
    metadata_service = MediaServer()  # stands for 169.254.169.254 or an admin port on loopback
    hidden = metadata_service.url("/latest/meta-data/iam.png")
    src = write_jsonl(tmp_path / "in.jsonl", [media_row("m0", image(hidden)), chat_row("t1", "plain text")])
    opening = {"media": {"allowed_hosts": [f"127.0.0.1:{metadata_service.port}"]}}
    try:
        with serving(fake_runner) as url:
            sdk = client(url)
            for where in ({"anex_options": opening}, {"metadata": {"anex_options": json.dumps(opening)}}):
                with pytest.raises(openai.BadRequestError) as refused:
                    media_batch(sdk, src, **where)
                assert refused.value.body["param"] == "anex_options.media.allowed_hosts"  # type: ignore[index]
                assert f"127.0.0.1:{metadata_service.port}" in refused.value.message
            for name, value in (("max_bytes", 10**12), ("timeout_s", 10**6), ("per_host_connections", 64)):
                with pytest.raises(openai.BadRequestError) as raised:
                    media_batch(sdk, src, anex_options={"media": {name: value}})
                assert raised.value.body["param"] == f"anex_options.media.{name}"  # type: ignore[index]
            narrowed = media_batch(sdk, src, anex_options={"media": {"max_bytes": 1000, "allowed_hosts": []}})
            batch = wait(sdk, narrowed.id)
            errors = content(sdk, batch.error_file_id)
    finally:
        metadata_service.close()
    assert batch.status == "completed" and [e["custom_id"] for e in errors] == ["m0"]
    assert errors[0]["error"]["type"] == "media_fetch_error"
    assert metadata_service.total_hits() == 0


def test_the_operators_media_policy_applies_to_every_batch(
    tmp_path: Path, fake_runner: JobRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANEX_MEDIA_CACHE_DIR", str(tmp_path / "media-cache"))
    media = MediaServer()
    src = write_jsonl(tmp_path / "in.jsonl", [media_row("m0", image(media.url("/img/0.png")))])
    policy = MediaOptions(allowed_hosts=[f"127.0.0.1:{media.port}"], max_bytes=100_000)
    try:
        with serving(fake_runner, media=policy) as url:
            sdk = client(url)
            batch = wait(sdk, media_batch(sdk, src).id)  # no media options: the operator's hosts
            with pytest.raises(openai.BadRequestError) as raised:
                media_batch(sdk, src, anex_options={"media": {"max_bytes": 100_001}})
            assert "100000" in raised.value.message or "100,000" in raised.value.message
    finally:
        media.close()
    assert batch.status == "completed" and batch.error_file_id is None
    assert media.total_hits() == 1


def test_deeply_nested_json_is_a_400(tmp_path: Path, fake_runner: JobRunner) -> None:
    def nested(depth: int) -> str:
        return "[" * depth + "]" * depth

    bodies = {}
    for depth in (5_000, 100_000):
        bodies[f"whole body, {depth} levels"] = nested(depth)
        bodies[f"anex_options, {depth} levels"] = (
            '{"endpoint": "/v1/chat/completions", "input_file_id": "file-x", "anex_options": {"x": '
            + nested(depth)
            + "}}"
        )
        bodies[f"embedded request, {depth} levels"] = (
            '{"endpoint": "/v1/chat/completions", "requests": [{"custom_id": "a", "body": {"x": '
            + nested(depth)
            + "}}]}"
        )
    with serving(fake_runner) as url:
        for what, body in bodies.items():
            answer = httpx.post(
                f"{url}/batches",
                content=body.encode(),
                headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"},
                timeout=30,
            )
            assert answer.status_code == 400, (what, answer.text[:300])
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, what
            assert "nested" in error["message"], (what, error)
        sdk = client(url)
        deep = '{"custom_id": "d", "method": "POST", "url": "/v1/chat/completions", "body": {"x": '
        lines = [chat_row("ok", "hello"), deep + nested(100_000) + "}}", deep + '{"a":' * 5_000 + "1" + "}" * 5_002]
        src = write_jsonl(tmp_path / "deep.jsonl", lines)
        batch = wait(sdk, submit(sdk, src).id)
    assert batch.status == "failed" and batch.errors is not None and batch.errors.data is not None
    assert [(e.line, "nested too deeply" in (e.message or "")) for e in batch.errors.data] == [(2, True), (3, True)]


def test_serve_reads_the_operators_media_policy(tmp_path: Path) -> None:
    (tmp_path / "media.json").write_text('{"max_bytes": 5000, "allowed_hosts": ["images.internal"]}')
    args = build_parser().parse_args(
        ["serve", "--media", f"@{tmp_path / 'media.json'}", "--media-allowed-host", "10.0.0.7:9000"]
    )
    assert _media_policy(args) == MediaOptions(allowed_hosts=["images.internal", "10.0.0.7:9000"], max_bytes=5000)
    with pytest.raises(UsageError, match="max_byte"):
        _media_policy(build_parser().parse_args(["serve", "--media", '{"max_byte": 5}']))


def create_raw(url: str, body: dict[str, Any], key: str = KEY_A) -> httpx.Response:
    """``POST /v1/batches`` with this body, as plain HTTP."""
    return httpx.post(f"{url}/batches", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)


@pytest.mark.slow
def test_only_the_operators_models_are_served(tmp_path: Path, fake_runner: JobRunner) -> None:
    """A model outside the operator's list gets one refusal, whatever it names on the server: no
    answer tells an existing file, folder or unreadable folder from a missing one."""
    own = tmp_path / "models" / "house-model"
    own.mkdir(parents=True)
    src = write_jsonl(tmp_path / "in.jsonl", rows(2))
    probes = ["/etc/passwd", "/nonexistent/dir", "/root/.ssh", "/etc", str(tmp_path / "models"), "gpt-4o-mini"]
    with serving(fake_runner, models=["SmolLM2-135M-Instruct", str(own)]) as url:
        alice, bob = client(url, KEY_A), client(url, KEY_B)
        with src.open("rb") as f:
            file_id = alice.files.create(file=f, purpose="batch").id
        base = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        for where, param in (
            (lambda m: {"model": m}, "model"),
            (lambda m: {"anex_options": {"model": m}}, "anex_options.model"),
            (lambda m: {"metadata": {"anex_options": json.dumps({"model": m})}}, "anex_options.model"),
        ):
            answers = [create_raw(url, {**base, **where(m)}) for m in probes]
            assert {a.status_code for a in answers} == {400}
            assert len({a.text for a in answers}) == 1, [a.text for a in answers]  # byte for byte the same
            error = answers[0].json()["error"]
            assert (error["param"], error["code"]) == (param, "model_not_found")
            assert str(own) in error["message"] and "SmolLM2-135M-Instruct" in error["message"]
        assert alice.batches.list().data == []  # nothing was created
        default = wait(alice, alice.batches.create(**base).id)  # no model: the first listed
        assert default.status == "completed" and default.model == "HuggingFaceTB/SmolLM2-135M-Instruct"
        with src.open("rb") as f:
            bobs = bob.files.create(file=f, purpose="batch").id
        chosen = wait(bob, create_raw(url, {**base, "input_file_id": bobs, "model": str(own)}, KEY_B).json()["id"])
        assert chosen.status == "completed" and chosen.model == str(own)


def test_without_a_model_list_only_the_default_models_are_served(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(1))
    with serving(fake_runner) as url:
        sdk = client(url)
        with src.open("rb") as f:
            file_id = sdk.files.create(file=f, purpose="batch").id
        base = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        answers = [create_raw(url, {**base, "model": m}) for m in ("/etc", "/nonexistent/dir", "/etc/passwd")]
        assert [a.status_code for a in answers] == [400] * 3 and len({a.text for a in answers}) == 1
        named = create_raw(url, {**base, "model": "smollm2-135m-instruct"})
        assert named.status_code == 200, named.text
        assert wait(sdk, named.json()["id"]).status == "completed"


def test_serve_takes_the_operators_models(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "--model", "SmolLM2-135M-Instruct", "--model", str(tmp_path)])
    assert args.models == ["SmolLM2-135M-Instruct", str(tmp_path)]
    missing = str(tmp_path / "no-such-model")
    assert cli.main(["serve", "--model", missing, "--work-dir", str(tmp_path / "work")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --model: ") and missing in line


def test_a_listing_limit_that_is_not_a_number_in_range_is_a_400(fake_runner: JobRunner) -> None:
    with serving(fake_runner) as url:
        for path, most in (("files", 10_000), ("batches", 100)):
            for limit in ("²", "١٢", "0", str(most + 1), "-1", "1.5", ""):
                answer = httpx.get(
                    f"{url}/{path}", params={"limit": limit}, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=10
                )
                assert answer.status_code == 400, (path, limit, answer.text)
                error = answer.json()["error"]
                assert error["param"] == "limit" and f"from 1 to {most}" in error["message"], error


def test_job_options_over_the_services_limits_are_a_400(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(40))
    with serving(fake_runner) as url:
        sdk = client(url)
        with src.open("rb") as f:
            file_id = sdk.files.create(file=f, purpose="batch").id
        base = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        for options, param, code in (
            (
                {"system_prompt": "x" * (MAX_SYSTEM_PROMPT_BYTES + 1)},
                "anex_options.system_prompt",
                "string_above_max_length",
            ),
            (
                {"system_prompt": "é" * (MAX_SYSTEM_PROMPT_BYTES // 2 + 1)},
                "anex_options.system_prompt",
                "string_above_max_length",
            ),
            ({"stop": ["s" * 1000] * (MAX_OPTIONS_BYTES // 1000)}, "anex_options", "invalid_value"),
        ):
            answer = create_raw(url, {**base, "anex_options": options})
            assert answer.status_code == 400, answer.text[:300]
            error = answer.json()["error"]
            assert (error["param"], error["code"]) == (param, code), error
            limit = MAX_SYSTEM_PROMPT_BYTES if param.endswith("system_prompt") else MAX_OPTIONS_BYTES
            assert f"{limit:,}" in error["message"], error
        assert sdk.batches.list().data == []
        at_limit = create_raw(
            url, {**base, "anex_options": {"system_prompt": "x" * MAX_SYSTEM_PROMPT_BYTES, "max_tokens": 4}}
        )
        assert at_limit.status_code == 200, at_limit.text[:300]
        assert wait(sdk, at_limit.json()["id"]).status == "completed"


def test_a_batch_asking_for_more_tokens_than_the_service_allows_is_a_400(
    tmp_path: Path, fake_runner: JobRunner
) -> None:
    """The operator's budget of output tokens per batch (serve --max-job-tokens): a batch may set a
    lower one, never a higher one (a 400 at creation), and one whose rows ask for more fails its
    validation with nothing generated."""
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", "Hi", max_tokens=100) for i in range(5)])
    with serving(fake_runner, max_job_tokens=400) as url:
        sdk = client(url)
        with src.open("rb") as f:
            file_id = sdk.files.create(file=f, purpose="batch").id
        base = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        higher = create_raw(url, {**base, "anex_options": {"max_job_tokens": 10_000}})
        assert higher.status_code == 400, higher.text[:300]
        error = higher.json()["error"]
        assert error["param"] == "anex_options.max_job_tokens" and "400" in error["message"], error
        assert sdk.batches.list().data == []
        over = wait(sdk, submit(sdk, src).id)  # 5 rows x 100 tokens
        assert over.status == "failed" and over.errors is not None and over.errors.data is not None
        (error,) = over.errors.data
        assert error.param == "max_job_tokens" and "500 output tokens" in (error.message or ""), error
        assert over.request_counts is None or over.request_counts.completed == 0
        small = write_jsonl(tmp_path / "small.jsonl", [chat_row(f"r{i}", "Hi", max_tokens=100) for i in range(4)])
        assert wait(sdk, submit(sdk, small).id).status == "completed"


@pytest.fixture
def endless_check(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Makes every input check endless (its rows come round again and again, as in a check that
    takes hours); the event is set once a check has begun."""
    begun = threading.Event()
    real = submit_stage.read_input

    def endless(path: Path, options: Any, priority: bool | None = None) -> tuple[Any, Any, Iterator[Any]]:
        kind, endpoint, chunks = real(path, options, priority)
        first = list(chunks)

        def again() -> Iterator[Any]:
            begun.set()
            while True:
                yield from first
                time.sleep(0.01)

        return kind, endpoint, again()

    monkeypatch.setattr(submit_stage, "read_input", endless)
    return begun


def test_a_cancel_or_a_stop_cuts_the_check_short(
    tmp_path: Path, fake_runner: JobRunner, endless_check: threading.Event
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(3))
    work = Path(fake_runner.storage.work_root)
    with serving(fake_runner) as url:
        alice, bob = client(url, KEY_A), client(url, KEY_B)
        first = submit(alice, src, {"max_tokens": 8})
        assert endless_check.wait(30), "the check never began"
        assert alice.batches.retrieve(first.id).status == "validating"
        with pytest.raises(openai.NotFoundError):
            bob.batches.cancel(first.id)
        assert alice.batches.cancel(first.id).status == "cancelling"
        cancelled = wait(alice, first.id, timeout=10)
        assert cancelled.status == "cancelled" and cancelled.output_file_id is None
        for job in (p for p in work.iterdir() if p.name.startswith(first.id)):  # the check kept nothing
            assert not (job / layout.STAGING).exists() and not JobDir(work, job.name).exists()
        endless_check.clear()
        second = submit(bob, src, {"max_tokens": 4})
        assert endless_check.wait(30), "the second check never began"
        closing = time.monotonic()
    assert time.monotonic() - closing < 10, "closing waited for the check"
    stored = Store(fake_runner.instance, work).batch(second.id)
    assert stored is not None and stored.status == "validating"  # the next start checks it again


def race(*calls: Callable[[], httpx.Response]) -> list[httpx.Response]:
    """The calls made at the same moment from threads of their own (a barrier lets them go)."""
    barrier = threading.Barrier(len(calls))
    answers: list[httpx.Response | None] = [None] * len(calls)

    def go(n: int) -> None:
        barrier.wait(timeout=30)
        answers[n] = calls[n]()

    threads = [threading.Thread(target=go, args=(n,)) for n in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(a is not None for a in answers), "a call did not return"
    return answers  # type: ignore[return-value]


@pytest.mark.slow
def test_a_batch_made_from_a_file_and_a_delete_of_it_never_both_succeed(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("big", "x" * 2_000_000)])  # its copy takes a while
    headers = {"Authorization": f"Bearer {KEY_A}"}
    outcomes = []
    with serving(fake_runner) as url, httpx.Client(headers=headers, timeout=60) as http:
        sdk = client(url)
        for _ in range(20):
            with src.open("rb") as f:
                file_id = sdk.files.create(file=f, purpose="batch").id
            body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
            created, deleted = race(
                functools.partial(http.post, f"{url}/batches", json=body),
                functools.partial(http.delete, f"{url}/files/{file_id}"),
            )
            outcomes.append((created.status_code, deleted.status_code))
            assert outcomes[-1] in {(200, 400), (404, 200)}, (created.text, deleted.text)
            if created.status_code == 200:
                sdk.batches.cancel(created.json()["id"])
                assert "is the input of batch" in deleted.json()["error"]["message"]
            else:
                assert all(b.input_file_id != file_id for b in sdk.batches.list())


@pytest.mark.slow
def test_creates_racing_with_one_idempotency_key_leave_no_stray_input_files(
    tmp_path: Path, fake_runner: JobRunner
) -> None:
    work = Path(fake_runner.storage.work_root)
    headers = {"Authorization": f"Bearer {KEY_B}"}
    with serving(fake_runner) as url, httpx.Client(timeout=60) as http:
        bob = client(url, KEY_B)
        made = []
        for key in range(5):
            body = {
                "endpoint": "/v1/chat/completions",
                "requests": [{"custom_id": "a", "body": {"messages": [{"role": "user", "content": f"hi {key}"}]}}],
                "anex_options": {"max_tokens": 4},
            }
            sent = {**headers, "Idempotency-Key": f"key-{key}"}
            answers = race(*[functools.partial(http.post, f"{url}/batches", json=body, headers=sent)] * 6)
            assert {a.status_code for a in answers} == {200}, [a.text for a in answers]
            ids = {a.json()["id"] for a in answers}
            assert len(ids) == 1, ids
            made.append(ids.pop())
        done = [wait(bob, batch_id) for batch_id in made]
        inputs = [f.id for f in bob.files.list(purpose="batch")]
        assert sorted(inputs) == sorted(b.input_file_id for b in done)  # one input per batch, no other
        stored = {p.name for p in (work / "batch-api" / "files").iterdir()}
        assert stored == {f.id for f in bob.files.list()}  # no bytes without a record either


@pytest.mark.subprocess
def test_after_a_sigkilled_serve_a_lost_job_breaks_no_listing_and_its_batch_comes_back(tmp_path: Path) -> None:
    """serve is SIGKILLed while two of Alice's batches generate, then their jobs' folders are
    removed (by hand, say) and one batch's own input copy too. On the next start both tenants'
    listings answer; the batch with its input copy runs again from the start to the end, the other
    fails with a line that names no path of the server."""
    src = write_jsonl(tmp_path / "in.jsonl", rows(30))
    work = tmp_path / "work"
    with serve_process(tmp_path) as (process, url):
        alice, bob = client(url, KEY_A), client(url, KEY_B)
        bobs = wait(bob, submit(bob, src, {"max_tokens": 4, "checkpoint_rows": 2}).id)
        kept = submit(alice, src, {"max_tokens": 8, "checkpoint_rows": 2})
        lost = submit(alice, src, {"max_tokens": 16, "checkpoint_rows": 2})
        for batch in (kept, lost):
            wait_for_rows(alice, batch.id, 2)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    for batch in (kept, lost):
        (job,) = [p for p in work.iterdir() if p.name.startswith(batch.id)]
        shutil.rmtree(job)
    (work / "batch-api" / "batches" / f"{lost.id}.jsonl").unlink()
    with serve_process(tmp_path) as (_, url):
        alice, bob = client(url, KEY_A), client(url, KEY_B)
        assert [b.id for b in alice.batches.list().data] == [lost.id, kept.id]
        assert [(b.id, b.status) for b in bob.batches.list().data] == [(bobs.id, "completed")]
        failed = wait(alice, lost.id)
        assert failed.status == "failed" and failed.errors is not None and failed.errors.data is not None
        (error,) = failed.errors.data
        assert error.code == "job_failed" and str(tmp_path) not in (error.message or "")
        again = wait(alice, kept.id)
        assert again.status == "completed", again.errors
        assert [r["custom_id"] for r in content(alice, again.output_file_id)] == [f"r{i}" for i in range(30)]
        assert [b.status for b in alice.batches.list().data] == ["failed", "completed"]


@pytest.mark.slow
def test_a_batch_whose_job_cannot_be_read_breaks_no_listing(tmp_path: Path, slow_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(40))
    work = Path(slow_runner.storage.work_root)
    with serving(slow_runner) as url:
        alice = client(url, KEY_A)
        fine = wait(alice, submit(alice, src, {"max_tokens": 4}).id)
        broken = submit(alice, src, {"max_tokens": 8, "checkpoint_rows": 2})
        wait_for_rows(alice, broken.id, 2)
        (job,) = [p for p in work.iterdir() if p.name.startswith(broken.id)]
        (job / "job.json").write_text('{"job_id": ')  # torn
        deadline = time.monotonic() + 60
        while True:  # while it runs on and once it has ended, both batches are shown
            assert [b.id for b in alice.batches.list().data] == [broken.id, fine.id]
            if (status := alice.batches.retrieve(broken.id).status) in DONE:
                break
            assert time.monotonic() < deadline, f"the broken batch is still {status}"
            time.sleep(0.2)
        assert [b.id for b in alice.batches.list().data] == [broken.id, fine.id]
        assert client(url, KEY_B).batches.list().data == []


def test_a_delivery_cut_short_by_a_dead_service_leaves_no_stray_file(tmp_path: Path, slow_runner: JobRunner) -> None:
    """A service killed while it stored a finished batch's files (one stored, the record not yet
    updated) delivers them again at its next start: the file stored before is removed."""
    src = write_jsonl(tmp_path / "in.jsonl", rows(6))
    store = Store(slow_runner.instance, slow_runner.storage.work_root)
    with serving(slow_runner) as url:
        alice = client(url, KEY_A)
        batch = submit(alice, src, {"max_tokens": 4})
        record = store.batch(batch.id)
        assert record is not None
        stale = tmp_path / "stale.jsonl"
        stale.write_text('{"custom_id": "r0"}\n')
        earlier = store.add_file(record.owner, f"{batch.id}_output.jsonl", "batch_output", stale, batch_id=batch.id)
        done = wait(alice, batch.id)
        assert done.status == "completed"
        listed = [f.id for f in alice.files.list(purpose="batch_output")]
        assert listed == [done.output_file_id] and earlier.id not in listed
        with pytest.raises(openai.NotFoundError):
            alice.files.retrieve(earlier.id)


def test_embedding_lists_and_base64_through_the_sdk(tmp_path: Path, fake_runner: JobRunner) -> None:
    url_of = "/v1/embeddings"
    requests = [
        {"custom_id": "list", "body": {"input": ["one", "two words", "three more words"]}},
        {"custom_id": "b64", "body": {"input": ["one", "two words"], "encoding_format": "base64"}},
    ]
    with serving(fake_runner) as url:
        sdk = client(url)
        batch = wait(sdk, sdk.post("/batches", body={"endpoint": url_of, "requests": requests}, cast_to=Batch).id)
        output = content(sdk, batch.output_file_id)
        refused_rows = [{"custom_id": "short", "body": {"input": "x", "dimensions": 64}}]
        refused = wait(sdk, sdk.post("/batches", body={"endpoint": url_of, "requests": refused_rows}, cast_to=Batch).id)
    assert batch.status == "completed" and batch.usage is not None
    listed = CreateEmbeddingResponse.model_validate(output[0]["response"]["body"])
    assert [d.index for d in listed.data] == [0, 1, 2] and listed.usage.prompt_tokens == 6
    encoded = [d["embedding"] for d in output[1]["response"]["body"]["data"]]
    floats = [struct.unpack(f"<{len(base64.b64decode(e)) // 4}f", base64.b64decode(e)) for e in encoded]
    assert [list(f) for f in floats] == [pytest.approx(d.embedding, abs=1e-6) for d in listed.data[:2]]
    assert refused.status == "failed" and refused.errors is not None and refused.errors.data is not None
    [error] = refused.errors.data
    assert (error.line, error.param) == (1, "body.dimensions") and "Matryoshka" in (error.message or "")
