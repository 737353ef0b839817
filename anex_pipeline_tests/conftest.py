"""Shared fixtures: a Dagster instance per test, jobs run on the fake or the real engine."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from anex_pipeline.instance import TERMINAL_OUTPUT
from anex_pipeline.orchestration.resources import EngineResource, StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobReport
from anex_pipeline_tests.fakes import fake_engine

REPO = Path(__file__).resolve().parents[1]
# An instance for Dagster's own commands (webserver, `dagster job backfill`) with no daemon: its
# coordinator starts each run at once instead of queueing it for the daemon `dagster dev` runs.
DAEMONLESS_INSTANCE_YAML = """\
run_coordinator:
  module: dagster._core.run_coordinator
  class: DefaultRunCoordinator
telemetry:
  enabled: false
"""


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")
    return path


def chat_row(cid: str, text: str | list[dict[str, Any]], **body: Any) -> dict[str, Any]:
    """A chat row of one user message: plain text, or a list of content parts."""
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": text}], **body},
    }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    # split on newlines only: str.splitlines() would also cut at U+2028 and U+0085 inside a JSON string
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def local_instance(
    temp_dir: str | None = None, *, set_dagster_home: bool = False
) -> contextlib.AbstractContextManager[dg.DagsterInstance]:
    """A Dagster instance on disk in a temporary folder, set up as the command sets up its own:
    step output is not captured. (The in-memory instance refuses a key-value write while another
    thread runs a job; Dagster's default capture redirects the whole process's output through
    helper processes, once per step, which threads running steps at once tangle.)"""
    return dg.instance_for_test(temp_dir=temp_dir, set_dagster_home=set_dagster_home, overrides=TERMINAL_OUTPUT)


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with local_instance() as inst:
        yield inst


@pytest.fixture
def fake_runner(tmp_path: Path, instance: dg.DagsterInstance) -> JobRunner:
    storage = StorageResource(work_root=str(tmp_path / "work"))
    return JobRunner(instance, storage, fake_engine())


def real_engine_resource(**more: Any) -> EngineResource:
    """The real vLLM engine in this process, sized for the CPU build and small test jobs (the
    machine's shared model server only where a test asks for it)."""
    return EngineResource(**{"max_model_len": 2048, "machine_server": False, **more})


@pytest.fixture(scope="session")
def real_runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobRunner]:
    """One runner on the real engine for the whole session: engine modules share its loaded model."""
    storage = StorageResource(work_root=str(tmp_path_factory.mktemp("real-work")))
    with local_instance() as inst:
        runner = JobRunner(inst, storage, real_engine_resource())
        yield runner
        runner.close()


@pytest.fixture(scope="session")
def vision_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random vision-language model (see tiny_models.py), built once per test session.
    Jobs that name it (the ``model`` option) share one loaded engine, like the embedded model's."""
    from anex_pipeline_tests.tiny_models import build_tiny_vision_model

    return build_tiny_vision_model(tmp_path_factory.mktemp("models") / "tiny-idefics3")


@pytest.fixture(scope="session")
def audio_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random audio-language model (see tiny_models.py), built once per test session."""
    from anex_pipeline_tests.tiny_models import build_tiny_audio_model

    return build_tiny_audio_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-audio")


@pytest.fixture
def media_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A loopback media server (test_media.MediaServer), and a media cache of the test's own
    (a ``serve`` process started by the test inherits it)."""
    from anex_pipeline_tests.test_media import MediaServer

    monkeypatch.setenv("ANEX_MEDIA_CACHE_DIR", str(tmp_path / "media-cache"))
    s = MediaServer()
    yield s
    s.close()


def run_job(runner: JobRunner, src: Path, out: Path, options: dict[str, Any] | None = None) -> JobReport:
    return runner.run(runner.submit(str(src), str(out), options or {}))
