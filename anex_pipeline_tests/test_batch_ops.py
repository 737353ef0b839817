"""What an operator of ``serve`` watches: webhooks when batches end, Prometheus metrics, health,
the model list and live usage; and ``run --metrics-port``. Real HTTP servers on loopback (the
service, the webhook receiver), a real Dagster instance, the fake engine."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
import pytest
from dagster._core.instance.ref import InstanceRef
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from anex_pipeline import cli, metrics
from anex_pipeline.batch_api.webhooks import WebhookSettings
from anex_pipeline.batches.store import Store, key_hash
from anex_pipeline.engine.loader import register_engine
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import MediaOptions
from anex_pipeline.testing import FakeEngine, fake_engine
from anex_pipeline_tests.harness.batch_api import (
    KEY_A,
    client,
    rows,
    serve_process,
    serving,
    submit,
    wait,
    wait_for_rows,
)
from anex_pipeline_tests.harness.commands import FAKE_CLI
from anex_pipeline_tests.harness.jobs import write_jsonl
from anex_pipeline_tests.harness.ports import free_port
from anex_pipeline_tests.harness.webhooks import SECRET, Receiver, no_event_pending, receiving


def hook(receiver: Receiver) -> WebhookSettings:
    return WebhookSettings(receiver.url, SECRET, ("127.0.0.1",), retry_first_s=0.2)


@pytest.mark.slow
def test_a_finished_and_a_cancelled_batch_send_one_signed_event_each(tmp_path: Path, slow_runner: JobRunner) -> None:
    done_src = write_jsonl(tmp_path / "done.jsonl", rows(2))
    long_src = write_jsonl(tmp_path / "long.jsonl", rows(40))
    with receiving() as receiver, serving(slow_runner, webhook=hook(receiver)) as url:
        sdk = client(url)
        done = wait(sdk, submit(sdk, done_src, {"max_tokens": 4}).id)
        assert done.status == "completed"
        receiver.wait_for(1)
        long = submit(sdk, long_src, {"max_tokens": 4, "checkpoint_rows": 1})
        wait_for_rows(sdk, long.id, 2)
        sdk.batches.cancel(long.id)
        assert wait(sdk, long.id).status == "cancelled"
        receiver.wait_for(2)
        no_event_pending(slow_runner.instance, slow_runner.storage.work_root)
    events = receiver.delivered()
    assert [(e["type"], e["data"]) for e in events] == [
        ("batch.completed", {"id": done.id}),
        ("batch.cancelled", {"id": long.id}),
    ]
    for event in events:
        assert event["object"] == "event" and event["id"].startswith("evt_")
        assert abs(event["created_at"] - time.time()) < 120
    assert len(receiver.requests) == 2  # one request each: nothing was sent twice
    headers = receiver.requests[0][0]
    assert headers["webhook-id"] == events[0]["id"] and headers["webhook-signature"].startswith("v1,")


@pytest.mark.slow
def test_a_batch_that_fails_or_reaches_its_time_limit_sends_its_event(tmp_path: Path, slow_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(40))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"custom_id": "a", "body": {"messages": []}\nnot json\n')
    with receiving() as receiver, serving(slow_runner, webhook=hook(receiver)) as url:
        sdk = client(url)
        failed = wait(sdk, submit(sdk, broken).id)
        receiver.wait_for(1)
        expired = wait(sdk, submit(sdk, src, {"max_tokens": 4, "checkpoint_rows": 1, "time_limit_s": 1.5}).id)
        receiver.wait_for(2)
        no_event_pending(slow_runner.instance, slow_runner.storage.work_root)
    assert (failed.status, expired.status) == ("failed", "expired")
    events = [(e["type"], e["data"]["id"]) for e in receiver.delivered()]
    assert events == [("batch.failed", failed.id), ("batch.expired", expired.id)]


def test_a_wrong_signature_does_not_verify(tmp_path: Path, fake_runner: JobRunner) -> None:
    """The SDK's check is not a formality: the same delivery fails it under another secret."""
    with receiving() as receiver, serving(fake_runner, webhook=hook(receiver)) as url:
        sdk = client(url)
        wait(sdk, submit(sdk, write_jsonl(tmp_path / "in.jsonl", rows(1)), {"max_tokens": 4}).id)
        receiver.wait_for(1)
    headers, body, _ = receiver.requests[0]
    other = OpenAI(api_key="unused", webhook_secret="whsec_" + base64.b64encode(b"x" * 32).decode())
    with pytest.raises(Exception, match="signature"):
        other.webhooks.verify_signature(body, headers)


@pytest.mark.slow
def test_a_receiver_that_never_answers_holds_up_no_batch(tmp_path: Path, fake_runner: JobRunner) -> None:
    """The receiver takes the connection and never answers: while the first event's delivery
    waits for it, later batches still run and end."""
    src = write_jsonl(tmp_path / "in.jsonl", rows(2))
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections wait in the backlog, never accepted, never answered
        settings = WebhookSettings(
            f"http://127.0.0.1:{silent.getsockname()[1]}/hook", SECRET, ("127.0.0.1",), timeout_s=120
        )
        with serving(fake_runner, webhook=settings) as url:
            sdk = client(url)
            first = wait(sdk, submit(sdk, src, {"max_tokens": 4}).id)
            later = [wait(sdk, submit(sdk, src, {"max_tokens": 4, "seed": n}).id) for n in range(2)]
            assert [b.status for b in (first, *later)] == ["completed"] * 3
            pending = Store(fake_runner.instance, fake_runner.storage.work_root).pending_events()
            assert [p["attempts"] for p in pending] == [0, 0, 0]  # the first is still on its first try
            silent.close()  # the waiting connection is reset: the service can stop


@pytest.mark.subprocess
def test_an_event_survives_a_receiver_that_is_down_and_a_restart_of_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver answers 503 twice; serve is stopped after the first failed try and started
    again: the event arrives once, every try with the same id."""
    with receiving(down_for=2) as receiver:
        flags = ("--webhook-allowed-host", "127.0.0.1")
        env = {"ANEX_WEBHOOK_URL": receiver.url, "ANEX_WEBHOOK_SECRET": SECRET}
        with serve_process(tmp_path, *flags, env=env) as (process, url):
            sdk = client(url)
            batch = wait(sdk, submit(sdk, write_jsonl(tmp_path / "in.jsonl", rows(2)), {"max_tokens": 4}).id)
            receiver.wait_for(1)
            os.killpg(process.pid, signal.SIGTERM)
            assert process.wait(timeout=60) == 0
        assert len(receiver.requests) <= 2  # the first start got no 200: the event is still pending
        with serve_process(tmp_path, *flags, env=env):
            receiver.wait_for(3)
            # Once the service has forgotten the event (after the 200), nothing more can come.
            monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))  # its settings name it
            with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(tmp_path / "dagster_home"))) as instance:
                no_event_pending(instance, str(tmp_path / "work"))
    assert [status for _, _, status in receiver.requests] == [503, 503, 200]
    assert len({headers["webhook-id"] for headers, _, _ in receiver.requests}) == 1
    assert [(e["type"], e["data"]["id"]) for e in receiver.delivered()] == [("batch.completed", batch.id)]


def test_webhook_settings_that_cannot_work_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work = ["--work-dir", str(tmp_path / "work")]
    cases = [
        (["--webhook-url", "http://169.254.169.254/hook", "--webhook-secret", SECRET], "cloud metadata address"),
        (["--webhook-url", "http://127.0.0.1:9/hook", "--webhook-secret", SECRET], "--webhook-allowed-host"),
        (["--webhook-url", "http://example.com/hook", "--webhook-secret", "not-a-secret"], "whsec_"),
        (["--webhook-url", "ftp://example.com/hook", "--webhook-secret", SECRET], "http(s) URL"),
        (["--webhook-url", "http://example.com/hook"], "--webhook-secret"),
    ]
    for flags, expected in cases:
        assert cli.main(["serve", *flags, *work]) == 2, flags
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("error: ") and expected in line, line


def scrape(url: str) -> dict[str, float]:
    """The service's metrics as {name{label=value,...}: value}, parsed by prometheus_client."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}"] = sample.value
    return found


@pytest.mark.parametrize("options", [{"max_tokens": 8, "temperature": 0}, {"temperature": 0}], ids=["cap", "estimated"])
def test_metrics_after_a_batch_equal_its_counts_and_usage(
    tmp_path: Path, fake_runner: JobRunner, options: dict[str, Any]
) -> None:
    """With a cap, or with the cap estimated from a sample whose answers the rows reuse."""
    src = write_jsonl(tmp_path / "in.jsonl", rows(3, long_one=1))
    with serving(fake_runner, keys=[KEY_A]) as url:
        before = scrape(url)
        sdk = client(url)
        batch = wait(sdk, submit(sdk, src, options).id)
        after = scrape(url)
    assert batch.status == "completed" and batch.request_counts is not None and batch.usage is not None

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    chat = "endpoint=chat"
    assert grew(f"anex_rows_total{{{chat},error_type=,outcome=completed}}") == batch.request_counts.completed == 2
    assert grew(f"anex_rows_total{{{chat},error_type=context_length_exceeded,outcome=failed}}") == 1
    assert grew(f"anex_prompt_tokens_total{{{chat}}}") == batch.usage.input_tokens > 0
    assert grew(f"anex_completion_tokens_total{{{chat}}}") == batch.usage.output_tokens > 0
    assert grew(f"anex_cached_prompt_tokens_total{{{chat}}}") == batch.usage.input_tokens_details.cached_tokens
    assert grew("anex_batches_finished_total{status=completed}") == 1
    assert after["anex_batches{status=in_progress}"] == 0 and after["anex_batches_queued{}"] == 0
    assert after["anex_rows_in_flight{}"] == 0
    assert KEY_A not in json.dumps(after) and key_hash(KEY_A) not in json.dumps(after)  # no tenant key in labels


class GatedEngines:
    """An engine kind whose load waits until the test opens the gate, as a real load takes time."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def __call__(self, config: Any, manifest: Any) -> FakeEngine:
        with metrics.engine_load() as ready:
            assert self.gate.wait(60), "the test never opened the gate"
            engine = FakeEngine(manifest.model_name)
            ready(engine)
        return engine


def test_health_is_503_while_the_engine_loads_and_models_lists_the_served_model(
    tmp_path: Path, fake_runner: JobRunner
) -> None:
    gated = GatedEngines()
    register_engine("gated-fake", gated)
    metrics.engines_released()
    runner = JobRunner(fake_runner.instance, fake_runner.storage, fake_engine("gated-fake"))
    with serving(runner, models=["SmolLM2-135M-Instruct"]) as url:
        root = url.removesuffix("/v1")
        loading = httpx.get(f"{root}/health", timeout=10)
        assert (loading.status_code, loading.json()) == (503, {"status": "loading"})
        assert scrape(url)["anex_engine_state{state=loading}"] == 1
        gated.gate.set()
        deadline = time.monotonic() + 30
        while (ready := httpx.get(f"{root}/health", timeout=10)).status_code != 200:
            assert time.monotonic() < deadline, ready.text
            time.sleep(0.05)
        assert ready.json() == {"status": "ready"}
        figures = scrape(url)
        assert figures["anex_engine_state{state=ready}"] == 1 and figures["anex_engine_ready_seconds{}"] > 0
        models = client(url).models.list()
        assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
        assert httpx.get(f"{url}/models", timeout=10).status_code == 401  # the list takes a key too


def broken_engines(config: Any, manifest: Any) -> FakeEngine:
    with metrics.engine_load():
        raise RuntimeError("out of memory")


def test_health_is_503_dead_when_the_engine_cannot_load(tmp_path: Path, fake_runner: JobRunner) -> None:
    register_engine("broken-fake", broken_engines)
    metrics.engines_released()
    runner = JobRunner(fake_runner.instance, fake_runner.storage, fake_engine("broken-fake"))
    with serving(runner) as url:
        root = url.removesuffix("/v1")
        deadline = time.monotonic() + 30
        while (answer := httpx.get(f"{root}/health", timeout=10)).json() != {"status": "dead"}:
            assert answer.status_code == 503 and time.monotonic() < deadline, answer.text
            time.sleep(0.05)
        assert answer.status_code == 503
        assert scrape(url)["anex_engine_state{state=dead}"] == 1


def test_a_running_batch_shows_its_usage_so_far(tmp_path: Path, slow_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(40))
    with serving(slow_runner) as url:
        sdk = client(url)
        batch = submit(sdk, src, {"max_tokens": 4, "checkpoint_rows": 1})
        wait_for_rows(sdk, batch.id, 3)
        running = sdk.batches.retrieve(batch.id)
        assert running.status == "in_progress" and running.usage is not None
        assert running.usage.output_tokens > 0 and running.usage.input_tokens > 0
        later = sdk.batches.retrieve(batch.id)
        assert later.usage is not None and later.usage.output_tokens >= running.usage.output_tokens
        sdk.batches.cancel(batch.id)
        wait(sdk, batch.id)


@pytest.mark.subprocess
def test_run_serves_its_metrics_while_the_job_runs(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(30))
    port = free_port()
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "ANEX_FAKE_ROW_DELAY_S": "0.1"}
    command = [
        *FAKE_CLI,
        "run",
        str(src),
        "-o",
        str(tmp_path / "out.jsonl"),
    ]
    flags = ["--max-tokens", "4", "--set", "checkpoint_rows=1", "--metrics-port", str(port)]
    with (tmp_path / "run.log").open("wb") as log:
        process = subprocess.Popen(
            [*command, *flags, "--work-dir", str(tmp_path / "work")],
            env=env,
            cwd=Path(__file__).parent.parent,
            stdout=log,
            stderr=log,
        )
    try:
        deadline = time.monotonic() + 120
        completed = 0.0
        while completed < 3:
            assert process.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no rows counted"
            try:
                figures = scrape(f"http://127.0.0.1:{port}/v1")
            except httpx.TransportError:  # not listening yet
                figures = {}
            completed = figures.get("anex_rows_total{endpoint=chat,error_type=,outcome=completed}", 0.0)
            time.sleep(0.1)
        assert process.wait(timeout=120) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    with pytest.raises(httpx.TransportError):  # the job's end closes the port
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_a_busy_or_impossible_metrics_port_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(1))
    out = tmp_path / "out.jsonl"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for given, expected in ((str(port), "cannot listen on 127.0.0.1"), ("70000", "from 1 to 65535")):
            command = ["run", str(src), "-o", str(out), "--metrics-port", given, "--work-dir", str(tmp_path / "w")]
            assert cli.main(command) == 2
            (line,) = capsys.readouterr().err.splitlines()
            assert line.startswith("error: --metrics-port") and expected in line, line
    assert not out.exists()


def test_media_fetches_count_downloads_hits_and_failures(media_server: Any) -> None:
    from anex_pipeline.media.fetcher import MediaFetcher, MediaFetchError
    from anex_pipeline_tests.harness.media import allowing

    def counted() -> tuple[float, float, float]:
        figures = {
            s.name: s.value for f in text_string_to_metric_families(metrics.exposition().decode()) for s in f.samples
        }
        return tuple(figures[f"anex_media_{n}_total"] for n in ("downloads", "cache_hits", "failures"))  # type: ignore[return-value]

    before = counted()
    url = media_server.url("/img/a.png")
    with MediaFetcher(allowing(media_server)) as first:
        first.fetch(url)
        first.fetch(url)  # the same URL again within one fetcher: no second count
    with MediaFetcher(allowing(media_server)) as second:
        second.fetch(url)
    with MediaFetcher(MediaOptions()) as refused, pytest.raises(MediaFetchError):
        refused.fetch(url)  # loopback without the operator's leave
    after = counted()
    assert [b - a for a, b in zip(before, after, strict=True)] == [1, 1, 1]


@pytest.mark.engine
def test_a_real_engine_load_turns_health_ready_and_its_batch_shows_in_the_metrics(
    tmp_path: Path, real_runner: JobRunner
) -> None:
    """serve loads real vLLM as it starts: /health answers 503 until it is loaded (unless an
    earlier test of the session loaded it already), then 200; a 3-row batch's counts and usage
    equal what /metrics counted."""
    loaded_before = metrics.engine_state() == "ready"
    src = write_jsonl(tmp_path / "in.jsonl", rows(3))
    with serving(real_runner) as url:
        root = url.removesuffix("/v1")
        first = httpx.get(f"{root}/health", timeout=10)
        assert (
            first.status_code == 200
            if loaded_before
            else (first.status_code, first.json()) == (503, {"status": "loading"})
        )
        deadline = time.monotonic() + 300
        while httpx.get(f"{root}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the engine did not become ready"
            time.sleep(0.5)
        before = scrape(url)
        assert before["anex_engine_state{state=ready}"] == 1
        assert loaded_before or before["anex_engine_ready_seconds{}"] > 1
        sdk = client(url)
        batch = wait(sdk, submit(sdk, src, {"max_tokens": 8, "temperature": 0}).id, timeout=300)
        after = scrape(url)
    assert batch.status == "completed" and batch.request_counts is not None and batch.usage is not None

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew("anex_rows_total{endpoint=chat,error_type=,outcome=completed}") == batch.request_counts.completed == 3
    assert grew("anex_prompt_tokens_total{endpoint=chat}") == batch.usage.input_tokens
    assert grew("anex_completion_tokens_total{endpoint=chat}") == batch.usage.output_tokens
    assert grew("anex_cached_prompt_tokens_total{endpoint=chat}") == batch.usage.input_tokens_details.cached_tokens
