"""A job that cannot succeed is refused at submit, in seconds, with one line that says why: a model
this machine cannot load, a result location that cannot be written; an engine that cannot load
fails its job once; a job where no row succeeded is not a success."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from anex_pipeline import testing
from anex_pipeline.cli import main
from anex_pipeline.engine import loader, models
from anex_pipeline.engine.vllm import engine as vllm_engine
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobRejected
from anex_pipeline.storage import output_problem
from anex_pipeline_tests.harness.batch_api import client, serving, submit, wait
from anex_pipeline_tests.harness.deployment import dummy_aws_credentials
from anex_pipeline_tests.harness.jobs import REPO, chat_row, read_jsonl, write_jsonl

ABSENT = "no-such-org/no-such-model"


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Work folder, Dagster home and Hugging Face cache in tmp_path."""
    monkeypatch.setenv("ANEX_WORK_DIR", str(tmp_path / "work"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf"))
    progress = logging.getLogger("anex_pipeline.progress")
    handlers = list(progress.handlers)
    yield
    progress.handlers[:] = handlers  # `run` adds a handler bound to this test's captured stderr


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run` in this process generates with the fake engine."""
    monkeypatch.setenv("ANEX_ENGINE", "fake")  # the command's engine settings read it


def rows(n: int) -> list[dict[str, Any]]:
    return [chat_row(f"r{i}", f"question {i}") for i in range(n)]


# -- the model -------------------------------------------------------------------------------------


@pytest.mark.subprocess
@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "hub-unreachable"])
@pytest.mark.parametrize("command", ["run", "validate"])
def test_an_absent_model_is_refused_by_the_command_in_seconds(tmp_path: Path, command: str, offline: bool) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(2))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "ANEX_WORK_DIR": str(tmp_path / "work")}
    env["DAGSTER_HOME"] = str(tmp_path / "dagster_home")
    env.pop("HF_HUB_OFFLINE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "anex_pipeline.cli", command, str(src), "--model", ABSENT]
    argv += ["-o", str(out)] if command == "run" else []
    started = time.monotonic()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    assert ABSENT in done.stderr and "field 'model'" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert ("offline" in done.stderr) == offline, done.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert not out.exists()


def hub_cache_entry(cache: Path, repo_id: str) -> None:
    """What a download leaves in the Hugging Face cache: a ref to a snapshot holding config.json."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")


def test_a_model_is_found_bundled_in_a_folder_or_in_the_hub_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_cache_entry(tmp_path / "hf", "some-org/cached-model")
    (tmp_path / "folder").mkdir()
    for found in [None, "SmolLM2-135M-Instruct", models.DEFAULT_EMBEDDING_MODEL, str(tmp_path / "folder")]:
        assert models.model_unavailable(found) is None, found
    assert models.model_unavailable("some-org/cached-model") is None
    assert "offline" in (models.model_unavailable("some-org/other-model") or "")
    assert "local folder" in (models.model_unavailable(str(tmp_path / "missing")) or "")
    (tmp_path / "weights.bin").write_bytes(b"")
    assert "is a file" in (models.model_unavailable(str(tmp_path / "weights.bin")) or "")


def test_a_misspelt_model_gets_the_nearest_known_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_cache_entry(tmp_path / "hf", "some-org/cached-model")
    typo = models.model_unavailable("HuggingFaceTB/SmolLM2-135M-Instuct") or ""
    assert "was not found (did you mean 'HuggingFaceTB/SmolLM2-135M-Instruct'?)" in typo
    assert "did you mean 'some-org/cached-model'?" in (models.model_unavailable("some-org/cahced-model") or "")
    assert "did you mean 'SmolLM2-135M-Instruct'?" in (models.model_unavailable("SmolLM2-135-Instruct") or "")
    assert "did you mean" not in (models.model_unavailable("meta-llama/Llama-3.1-8B") or "x")


def test_a_job_sent_to_a_model_server_does_not_look_for_its_model_here(
    tmp_path: Path, fake_runner: JobRunner, instance: Any
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(2))
    with pytest.raises(JobRejected, match=ABSENT):
        fake_runner.submit(str(src), str(tmp_path / "out.jsonl"), {"model": ABSENT})
    http = JobRunner(instance, fake_runner.storage, testing.fake_engine(base_url="http://127.0.0.1:9"))
    assert http.submit(str(src), str(tmp_path / "out.jsonl"), {"model": ABSENT}).manifest().model == ABSENT
    http.close()


def test_the_batch_api_fails_a_batch_whose_model_is_absent(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(2))
    with serving(fake_runner, models=[ABSENT]) as url:  # listed by the operator, absent from the machine
        sdk = client(url)
        batch = wait(sdk, submit(sdk, src, {"model": ABSENT}).id, timeout=60)
    assert batch.status == "failed" and batch.errors is not None and batch.errors.data
    assert ABSENT in (batch.errors.data[0].message or "")


class _UnloadableEngine:
    loads = 0

    def __init__(self, settings: Any):
        type(self).loads += 1
        time.sleep(0.5)  # a load takes a while: the steps of the job come to wait for it
        raise ValueError("max_model_len 99999999 is larger than the model's 8192\n(see the config)")


def test_an_engine_that_cannot_load_fails_the_job_once_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(vllm_engine, "VllmLocalEngine", _UnloadableEngine)
    monkeypatch.setattr(loader, "_failed", {}, raising=False)  # a fresh memory of failed loads
    (tmp_path / "model").mkdir()
    src = write_jsonl(tmp_path / "in.jsonl", rows(4))
    argv = ["run", str(src), "-o", str(tmp_path / "out.jsonl"), "--model", str(tmp_path / "model")]
    code = main([*argv, "--shards", "2", "--max-tokens", "8", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "larger than the model's 8192 (see the config)" in err.splitlines()[-1], err
    assert "max_retries" not in err and "Traceback" not in err, err
    assert _UnloadableEngine.loads == 1  # no retry, no second shard, no load after the one ahead of time


# -- the output ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cause", ["no-bucket", "no-credentials"])
def test_an_unwritable_s3_output_is_refused_before_generation(
    tmp_path: Path,
    s3_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    cause: str,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # it keeps the credentials it found first
    boto3.session.Session().client("s3").create_bucket(Bucket="results")
    output = "s3://results/out/run.jsonl" if cause == "no-credentials" else "s3://no-such-bucket/out/run.jsonl"
    if cause == "no-credentials":
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(name)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")

    def no_steps(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a refused job reached the Dagster steps")

    monkeypatch.setattr(JobRunner, "_execute", no_steps)
    src = write_jsonl(tmp_path / "in.jsonl", rows(2))
    started = time.monotonic()
    code = main(["run", str(src), "-o", output])
    err = capsys.readouterr().err
    assert code == 2, err
    assert output in err and "field 'output'" in err, err
    assert ("credentials" if cause == "no-credentials" else "NoSuchBucket") in err, err
    assert time.monotonic() - started < 60


def test_an_output_that_is_a_folder_or_under_a_read_only_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.geteuid() == 0:  # root writes into read-only folders: take the folder away instead
        locked = tmp_path / "file-not-folder"
        locked.write_text("")
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
    src = write_jsonl(tmp_path / "in.jsonl", rows(2))
    for output, says in [(tmp_path, "not a regular file"), (locked / "out.jsonl", str(locked))]:
        assert main(["run", str(src), "-o", str(output)]) == 2
        err = capsys.readouterr().err
        assert says in err and "field 'output'" in err, err


def test_run_and_validate_read_an_s3_input(
    tmp_path: Path,
    s3_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    fake_engine: None,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="inputs")
    s3.upload_file(str(write_jsonl(tmp_path / "in.jsonl", rows(3))), "inputs", "jobs/in.jsonl")
    assert main(["validate", "s3://inputs/jobs/in.jsonl"]) == 0
    assert "ok: 3 rows" in capsys.readouterr().out
    assert main(["run", "s3://inputs/jobs/in.jsonl", "-o", str(tmp_path / "out.jsonl"), "--max-tokens", "8"]) == 0
    assert [r["custom_id"] for r in read_jsonl(tmp_path / "out.jsonl")] == ["r0", "r1", "r2"]
    assert main(["validate", "s3://inputs/jobs/absent.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "s3://inputs/jobs/absent.jsonl" in err and "Traceback" not in err, err


@pytest.fixture
def silent_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An S3 endpoint on loopback that accepts every connection and never answers."""
    dummy_aws_credentials(monkeypatch)
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    yield endpoint
    done.set()
    thread.join(timeout=5)
    for conn in [*held, listener]:
        conn.close()


@pytest.mark.slow
def test_an_s3_input_on_a_silent_endpoint_gives_up_as_soon_as_the_output_probe(
    silent_endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    assert output_problem("s3://results/out.jsonl", StorageResource().s3_client(quick=True)) is not None
    probe_s = time.monotonic() - started
    started = time.monotonic()
    assert main(["validate", "s3://inputs/jobs/in.jsonl"]) == 2
    input_s = time.monotonic() - started
    err = capsys.readouterr().err
    problem = err.splitlines()[-1]
    assert err.splitlines()[0] == "job rejected: 1 problem(s) found" and len(err.splitlines()) == 2, err
    assert "cannot read the input s3://inputs/jobs/in.jsonl" in problem and "timeout" in problem.lower(), err
    assert input_s < probe_s + 5, (input_s, probe_s)  # boto3's own defaults took 182 s


# -- the outcome -----------------------------------------------------------------------------------


def test_a_job_where_every_row_failed_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_engine: None
) -> None:
    too_long = [chat_row(f"r{i}", "word " * 300) for i in range(3)]  # over the fake engine's context
    src = write_jsonl(tmp_path / "in.jsonl", too_long)
    assert main(["run", str(src), "-o", str(tmp_path / "out.jsonl"), "--max-tokens", "8", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "no row succeeded" in err.splitlines()[-1], err
    src = write_jsonl(tmp_path / "mixed.jsonl", [*too_long, chat_row("ok", "hello")])
    assert main(["run", str(src), "-o", str(tmp_path / "mixed-out.jsonl"), "--max-tokens", "8", "--quiet"]) == 0


def test_the_probe_client_makes_one_attempt_with_short_timeouts() -> None:
    config = StorageResource().s3_client(quick=True).meta.config
    assert config.retries["total_max_attempts"] == 1 and config.connect_timeout <= 5


# -- the request bodies ----------------------------------------------------------------------------

REAL_WORLD_BODY = {  # fields real OpenAI batch files carry, and vLLM's extras: all accepted
    "model": models.DEFAULT_CHAT_MODEL,
    "n": 1,
    "user": "u-1",
    "metadata": {"team": "a"},
    "store": False,
    "stream": False,
    "stream_options": None,
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "reasoning_effort": "low",
    "service_tier": "auto",
    "logit_bias": {"42": -100},
    "seed": 7,
    "stop": ["\n\n"],
    "response_format": {"type": "text"},
    "chat_template_kwargs": {"enable_thinking": False},
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 40,
    "min_p": 0.05,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.1,
    "min_tokens": 1,
    "max_tokens": 16,
    "max_completion_tokens": 16,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "include_stop_str_in_output": False,
    "stop_token_ids": [2],
    "thinking_token_budget": 32,
}


def test_every_field_of_a_real_world_body_is_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("a", "hi", **REAL_WORLD_BODY)])
    assert main(["validate", str(src)]) == 0, capsys.readouterr().err


BAD_BODIES = [
    chat_row("good", "hi"),
    chat_row("hot", "hi", temperature="hot"),
    chat_row("negative", "hi", max_tokens=-5),
    chat_row("wide", "hi", top_p=7),
    chat_row("typo", "hi", max_tokenz=5),
]
BAD_FIELDS = [
    (2, "body.temperature", "must be a number, got a string"),
    (3, "body.max_tokens", "-5"),
    (4, "body.top_p", "at most 1"),
    (5, "body.max_tokenz", "did you mean 'max_tokens'?"),
]


@pytest.mark.parametrize("command", ["validate", "run"])
def test_bad_request_bodies_are_refused_at_submit_line_by_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    def no_engine(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a refused job reached the engine or the Dagster steps")

    monkeypatch.setattr(JobRunner, "_execute", no_engine)
    monkeypatch.setattr(vllm_engine, "VllmLocalEngine", no_engine)
    src = write_jsonl(tmp_path / "in.jsonl", BAD_BODIES)
    argv = [command, str(src)] + (["-o", str(tmp_path / "out.jsonl")] if command == "run" else [])
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[anex]")]
    assert "4 problem(s)" in lines[0], lines
    for (line, field, says), text in zip(BAD_FIELDS, lines[1:], strict=True):
        assert f"line {line}, field '{field}'" in text and says in text, text


@pytest.mark.parametrize("base_url", [None, "http://127.0.0.1:9"], ids=["in-process", "model-server"])
def test_submit_job_in_dagster_fails_for_an_absent_model_unless_a_server_runs_it(
    tmp_path: Path, instance: Any, base_url: str | None
) -> None:
    from anex_pipeline.orchestration.definitions import build_definitions
    from anex_pipeline.orchestration.partitions import JOBS
    from anex_pipeline.orchestration.runs import first_step_error, step_error_message

    src = write_jsonl(tmp_path / "in.jsonl", rows(2))
    defs = build_definitions(StorageResource(work_root=str(tmp_path / "w")), testing.fake_engine(base_url=base_url))
    instance.add_dynamic_partitions(JOBS, ["ui-job"])
    config = {"input": str(src), "output": str(tmp_path / "out.jsonl"), "options": {"model": ABSENT}}
    result = defs.resolve_job_def("submit_job").execute_in_process(
        instance=instance,
        partition_key="ui-job",
        run_config={"ops": {"validated_input": {"config": config}}},
        raise_on_error=False,
    )
    assert result.success == (base_url is not None)
    if base_url is None:
        assert ABSENT in step_error_message(first_step_error(result))


@pytest.mark.engine
def test_a_real_engine_that_refuses_its_configuration_fails_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM refuses a context longer than the model's: the job fails with that reason, no retry."""
    loads = []
    real = vllm_engine.VllmLocalEngine
    monkeypatch.setattr(vllm_engine, "VllmLocalEngine", lambda settings: loads.append(settings) or real(settings))
    monkeypatch.setattr(loader, "_failed", {}, raising=False)  # a fresh memory of failed loads
    src = write_jsonl(tmp_path / "in.jsonl", rows(2))
    argv = ["run", str(src), "-o", str(tmp_path / "out.jsonl"), "--max-tokens", "8", "--quiet"]
    started = time.monotonic()
    code = main([*argv, "--max-model-len", "99999999"])
    err = capsys.readouterr().err
    assert code == 1, err
    last = err.splitlines()[-1]
    assert "the engine could not load" in last and "99999999" in last, err
    assert "max_retries" not in err and "Traceback" not in err, err
    assert len(loads) == 1
    assert time.monotonic() - started < 120
