"""Rows spread over several model servers (replicas of one model), and a server that goes away.

The fast tests use the fake OpenAI-compatible server of ``test_http_engine``; the engine test runs
two real ``vllm serve`` replicas and kills one (SIGKILL to its process group) in the middle of a job.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from anex_pipeline.cli import main
from anex_pipeline.engine.config import HttpSettings
from anex_pipeline.engine.http.engine import OpenAIHttpEngine, ServerUnavailable
from anex_pipeline.engine.http.replicas import ServersDown, server_urls
from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL
from anex_pipeline.engine.orphans import signal_child_group
from anex_pipeline.orchestration.resources import EngineResource, StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.jobs import chat_row, local_instance, read_jsonl, run_job, write_jsonl
from anex_pipeline_tests.harness.openai_server import FakeServer, request
from anex_pipeline_tests.harness.ports import free_port
from anex_pipeline_tests.harness.vllm_serve import Served, vllm_servers


@pytest.fixture
def two() -> Iterator[list[FakeServer]]:
    servers = [FakeServer(), FakeServer()]
    yield servers
    for server in servers:
        server.close()


def engine_on(urls: list[str], **settings: object) -> OpenAIHttpEngine:
    defaults: dict[str, object] = {"model_name": DEFAULT_CHAT_MODEL, "backoff_s": 0.01, "retries": 2}
    return OpenAIHttpEngine(HttpSettings(base_url=tuple(urls), **{**defaults, **settings}))  # type: ignore[arg-type]


def answered(server: FakeServer) -> set[int]:
    return {int(rid.removeprefix("rid")) for rid in server.answered}


def test_rows_spread_over_the_servers_with_a_bound_per_server(two: list[FakeServer]) -> None:
    engine = engine_on([s.url for s in two], max_concurrency=2)
    outcomes = engine.run([request(i, "slow") for i in range(16)])

    assert all(o.ok for o in outcomes) and [o.index for o in outcomes] == list(range(16))
    assert [s.max_in_flight for s in two] == [2, 2]  # both busy, never more than the bound each
    by_server = engine.served_rows()
    assert by_server == {s.url: len(answered(s)) for s in two} and sum(by_server.values()) == 16
    assert min(by_server.values()) >= 4
    assert {o.server for o in outcomes} == {s.url for s in two}


@pytest.mark.slow
def test_a_server_that_goes_away_mid_stream_loses_no_row(two: list[FakeServer]) -> None:
    engine = engine_on([s.url for s in two], max_concurrency=2)
    stream = engine.stream((request(i, "slow") for i in range(30)), 8)
    seen = list(next(stream))
    two[1].close()  # from now on its connections are refused
    for group in stream:
        seen.extend(group)

    assert sorted(o.index for o in seen) == list(range(30))  # each row once
    assert all(o.ok for o in seen)
    assert answered(two[0]) | answered(two[1]) == set(range(30))
    assert 0 < len(answered(two[1])) < 15 < len(answered(two[0]))
    assert engine.served_rows()[two[1].url] == len(answered(two[1]))


def test_a_server_down_at_the_start_is_probed_back_in(two: list[FakeServer]) -> None:
    later_port = free_port()
    engine = engine_on([two[0].url, f"http://127.0.0.1:{later_port}"], max_concurrency=1, retries=50)
    back = FakeServer(port=later_port)  # the server comes up after the engine started
    try:
        deadline = time.monotonic() + 20
        outcomes = []
        i = 0
        while not answered(back):  # keep sending until the probe has put it back
            assert time.monotonic() < deadline, "the server that came up later was never probed back in"
            outcomes += engine.run([request(i, "slow"), request(i + 1, "slow")])
            i += 2
        assert all(o.ok for o in outcomes)
    finally:
        back.close()


def test_every_server_gone_fails_with_one_line_naming_each(two: list[FakeServer]) -> None:
    engine = engine_on([s.url for s in two])
    for server in two:
        server.close()
    started = time.monotonic()

    with pytest.raises(ServersDown) as down:
        engine.run([request(i, "hello") for i in range(5)])

    message = str(down.value)
    assert "\n" not in message and all(s.url in message for s in two)
    assert time.monotonic() - started < 10


def test_a_row_the_servers_keep_failing_gets_the_last_answer_after_its_tries(two: list[FakeServer]) -> None:
    [down, up] = engine_on([s.url for s in two], retries=3).run([request(0, "down"), request(1, "up")])

    assert sum(s.attempts["down"] for s in two) == 4
    assert all(s.attempts["down"] >= 1 for s in two)  # a retry goes to the other server
    assert down.status_code == 503 and down.error is not None and down.error.code == 503
    assert up.ok


def test_server_urls_read_lists_and_refuse_what_is_not_a_server() -> None:
    assert server_urls("http://a:1, http://b:2/v1") == ("http://a:1", "http://b:2/v1")
    assert server_urls(["http://a:1", "http://b:2,http://c:3"]) == ("http://a:1", "http://b:2", "http://c:3")
    assert server_urls(None) == ()
    with pytest.raises(ValueError, match="'gpu-1:8000' is not an http:// or https:// server address"):
        server_urls("http://a:1,gpu-1:8000")
    with pytest.raises(ValueError, match="a server is named twice"):
        server_urls("http://a:1,http://a:1")
    with pytest.raises(ServerUnavailable, match="cannot reach the model server"):
        engine_on([f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"], retries=0)


@pytest.mark.slow
def test_cli_takes_several_base_urls_and_the_report_says_who_served_what(
    tmp_path: Path, two: list[FakeServer], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", "slow", max_tokens=8) for i in range(24)])
    out = tmp_path / "out.jsonl"
    common = ["run", str(src), "-o", str(out), "--quiet", "--work-dir", str(tmp_path / "work")]

    assert main([*common, "--base-url", two[0].url, "--base-url", two[1].url, "--max-concurrency", "3"]) == 0

    assert [line["custom_id"] for line in read_jsonl(out)] == [f"r{i}" for i in range(24)]
    report = json.loads((tmp_path / "out.report.json").read_text())
    assert report["served_by"] == {s.url: len(s.answered) for s in two}
    assert sum(report["served_by"].values()) == 24 and all(report["served_by"].values())

    assert main([*common, "--base-url", f"{two[0].url},ftp://x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "error: --base-url: 'ftp://x' is not an http:// or https:// server address (e.g. http://gpu-1:8000)"
    )


# -- two real vllm serve replicas --------------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Served]]:
    with vllm_servers(tmp_path_factory.mktemp("replicas"), 2) as servers:
        yield servers


def finished_requests(url: str) -> int:
    """Requests the server has finished, from its Prometheus metrics."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return int(sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M)))


@pytest.mark.vllm_serve
@pytest.mark.engine
def test_two_replicas_share_a_job_and_killing_one_mid_job_loses_no_row(tmp_path: Path, replicas: list[Served]) -> None:
    kept, killed = replicas
    rows = [chat_row(f"q-{i}", f"Count from {i} to {i + 9}, one number per line.", max_tokens=24) for i in range(48)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    storage = StorageResource(work_root=str(tmp_path / "work"))
    engine = EngineResource(base_url=f"{kept.url},{killed.url}", max_concurrency=4)
    report_box: list[object] = []
    with local_instance() as instance:
        runner = JobRunner(instance, storage, engine)
        job = threading.Thread(target=lambda: report_box.append(run_job(runner, src, out)))
        try:
            job.start()
            deadline = time.monotonic() + 300
            while finished_requests(killed.url) < 4:  # the replica has served rows of the job
                assert job.is_alive() and time.monotonic() < deadline, "the second replica served no row"
                time.sleep(0.2)
            assert signal_child_group(killed.proc, signal.SIGKILL)  # the replica and its engine process, at once
            killed.proc.wait(timeout=30)
            job.join(timeout=600)
            assert not job.is_alive()
        finally:
            runner.close()

    [report] = report_box
    lines = read_jsonl(out)
    assert [line["custom_id"] for line in lines] == [f"q-{i}" for i in range(48)]  # complete, once, in order
    assert all(line["error"] is None and line["response"]["status_code"] == 200 for line in lines)
    assert report.status == "completed" and report.request_counts.completed == 48  # type: ignore[attr-defined]
    served = report.served_by  # type: ignore[attr-defined]
    assert set(served) == {kept.url, killed.url} and sum(served.values()) == 48
    assert served[killed.url] >= 4 and served[kept.url] > served[killed.url]
