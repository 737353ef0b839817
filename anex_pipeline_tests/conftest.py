"""Shared fixtures: a Dagster instance per test, jobs run on the fake or the real engine. The
helpers live in ``harness/``; the harness modules that hold fixtures of their own come in as plugins."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.testing import fake_engine
from anex_pipeline_tests.harness.jobs import local_instance, real_engine_resource

# `run` uses the machine's shared model server when one is warm for its settings: the tests' commands
# look for it in a folder of their own, so that a server someone left warm on this machine serves none.
os.environ.setdefault("ANEX_MACHINE_SERVER_DIR", tempfile.mkdtemp(prefix="anex-test-machine-server-"))

pytest_plugins = [
    "anex_pipeline_tests.harness.batch_api",  # slow_runner
    "anex_pipeline_tests.harness.cli_jobs",  # home
    "anex_pipeline_tests.harness.deployment",  # s3_endpoint
]


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with local_instance() as inst:
        yield inst


@pytest.fixture
def fake_runner(tmp_path: Path, instance: dg.DagsterInstance) -> JobRunner:
    storage = StorageResource(work_root=str(tmp_path / "work"))
    return JobRunner(instance, storage, fake_engine())


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
    from anex_pipeline_tests.harness.tiny_models import build_tiny_vision_model

    return build_tiny_vision_model(tmp_path_factory.mktemp("models") / "tiny-idefics3")


@pytest.fixture(scope="session")
def audio_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random audio-language model (see tiny_models.py), built once per test session."""
    from anex_pipeline_tests.harness.tiny_models import build_tiny_audio_model

    return build_tiny_audio_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-audio")


@pytest.fixture
def media_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A loopback media server (test_media.MediaServer), and a media cache of the test's own
    (a ``serve`` process started by the test inherits it)."""
    from anex_pipeline_tests.harness.media import MediaServer

    monkeypatch.setenv("ANEX_MEDIA_CACHE_DIR", str(tmp_path / "media-cache"))
    s = MediaServer()
    yield s
    s.close()
