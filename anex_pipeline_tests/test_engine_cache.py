"""The per-process engine cache: one engine per settings, other models shut down first, and an
engine that died replaced by a new one on the next request for it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from anex_pipeline.engine import loader
from anex_pipeline.engine.base import Engine, EngineRequest
from anex_pipeline.engine.config import EngineSettings
from anex_pipeline.engine.loader import load_engine, release_engines
from anex_pipeline.spec import RowOutcome


class StubEngine(Engine):
    """Stands in for the vLLM engine class: the loader's cache only builds, marks and shuts engines down."""

    def __init__(self, settings: EngineSettings):
        self.model_name = settings.model_name
        self.dead = False
        self.stopped = False

    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        raise AssertionError("the cache's tests never run rows")

    def shutdown(self) -> None:
        self.stopped = True


@pytest.fixture(autouse=True)
def stub_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("anex_pipeline.engine.vllm.engine.VllmLocalEngine", StubEngine)
    yield
    release_engines()


def test_same_settings_share_one_engine_and_another_model_replaces_it() -> None:
    a = EngineSettings(model="/models/a", model_name="a")
    first = load_engine(a)
    assert load_engine(a) is first
    other = load_engine(EngineSettings(model="/models/b", model_name="b"))
    assert other is not first and first.stopped  # two models never hold memory at once
    assert list(loader._loaded.values()) == [other]


def test_a_dead_engine_is_shut_down_and_loaded_again() -> None:
    a = EngineSettings(model="/models/a", model_name="a")
    first = load_engine(a)
    first.dead = True  # what VllmLocalEngine.run sets when vLLM raises EngineDeadError
    second = load_engine(a)
    assert second is not first and first.stopped and not second.dead
