"""The Batch API served on loopback (in a thread or as its own process) and driven with the openai
SDK; the ``slow_runner`` fixture."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
import pytest
import uvicorn
from openai import OpenAI
from openai.types import Batch

from anex_pipeline.batch_api.app import create_app
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.testing import fake_engine
from anex_pipeline_tests.harness.commands import FAKE_CLI
from anex_pipeline_tests.harness.fake_cli import SLOW_FAKE
from anex_pipeline_tests.harness.jobs import REPO, chat_row
from anex_pipeline_tests.harness.ports import free_port

KEY_A = "sk-test-alice-0123456789"

KEY_B = "sk-test-bob-9876543210"

DONE = {"completed", "failed", "cancelled", "expired"}


@contextmanager
def serving(runner: JobRunner, keys: list[str] | None = None, **settings: Any) -> Iterator[str]:
    """The Batch API on a free loopback port, in a thread; yields the SDK's base_url."""
    app = create_app(runner, [KEY_A, KEY_B] if keys is None else keys, **settings)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the service did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=120)
        assert not thread.is_alive(), "the service did not stop"


def client(base_url: str, key: str = KEY_A) -> OpenAI:
    return OpenAI(base_url=base_url, api_key=key, max_retries=0)


def wait(sdk: OpenAI, batch_id: str, until: set[str] = DONE, timeout: float = 120) -> Batch:
    deadline = time.monotonic() + timeout
    while (batch := sdk.batches.retrieve(batch_id)).status not in until:
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.1)
    return batch


def wait_for_rows(sdk: OpenAI, batch_id: str, completed: int) -> None:
    deadline = time.monotonic() + 60
    while (counts := sdk.batches.retrieve(batch_id).request_counts) is None or counts.completed < completed:
        assert time.monotonic() < deadline, "the batch made no progress"
        time.sleep(0.05)


def content(sdk: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(line) for line in sdk.files.content(file_id).text.splitlines()]


def submit(sdk: OpenAI, path: Path, options: dict[str, Any] | None = None) -> Batch:
    with path.open("rb") as f:
        uploaded = sdk.files.create(file=f, purpose="batch")
    metadata = {"team": "tests", **({"anex_options": json.dumps(options)} if options else {})}
    return sdk.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=metadata,
    )


@pytest.fixture
def slow_runner(tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch) -> JobRunner:
    """The fake engine, taking 0.1 s per row: a cancel or a restart lands in the middle of a job."""
    monkeypatch.setenv("ANEX_FAKE_ROW_DELAY_S", "0.1")
    return JobRunner(instance, StorageResource(work_root=str(tmp_path / "work")), fake_engine(SLOW_FAKE))


def rows(n: int, long_one: int | None = None) -> list[dict[str, Any]]:
    """Chat rows; the row ``long_one`` has a prompt over the fake engine's context, so it fails."""
    return [chat_row(f"r{i}", "word " * 300 if i == long_one else f"question number {i}") for i in range(n)]


@contextmanager
def serve_process(
    tmp_path: Path, *flags: str, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``anex-pipeline serve`` on the slow fake engine in a process (and process group) of its
    own, on a free loopback port, with both tenants' keys and these further ``flags`` and
    environment; yields the process and the SDK's base_url once it answers. Its output goes to
    files, so no unread pipe can fill and stall it."""
    port = free_port()
    home = tmp_path / "dagster_home"
    home.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "ANEX_BATCH_API_KEYS": f"{KEY_A},{KEY_B}",
        "ANEX_FAKE_ROW_DELAY_S": "0.1",
        "NO_PROXY": "127.0.0.1",
        **(env or {}),
    }
    command = [*FAKE_CLI, "serve", "--port", str(port)]
    with (tmp_path / "serve.log").open("ab") as log:
        process = subprocess.Popen(
            [*command, "--work-dir", str(tmp_path / "work"), *flags],
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "serve did not start"
            try:
                httpx.get(f"{url}/batches", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=5)
                break
            except httpx.TransportError:  # not listening yet
                time.sleep(0.2)
        yield process, url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
