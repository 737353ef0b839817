"""The one seam for swapping the engine: engines are looked up by the config's kind."""

from __future__ import annotations

import threading

import pytest

from anex_pipeline.engine import loader
from anex_pipeline.engine.config import EngineConfig
from anex_pipeline.engine.loader import engine_for, register_engine
from anex_pipeline.errors import EngineLoadFailed
from anex_pipeline.orchestration.resources import EngineResource
from anex_pipeline.testing import FakeEngine
from anex_pipeline.workdir.manifest import JobManifest, ShardRange


def manifest(model_name: str = "m") -> JobManifest:
    return JobManifest(
        job_id="j", input="in.jsonl", input_sha256="0", output="out.jsonl", report="out.report.json",
        format="jsonl", endpoint="chat", model="m", model_name=model_name, options={}, total_rows=1,
        shards=[ShardRange(start=0, stop=1)], submitted_at=0.0,
    )  # fmt: skip


def test_a_registered_kind_gives_its_engine_from_plain_settings_and_from_the_resource() -> None:
    made: list[tuple[EngineConfig, str]] = []

    def factory(config: EngineConfig, job: JobManifest) -> FakeEngine:
        made.append((config, job.model_name))
        return FakeEngine(job.model_name)

    register_engine("registry-test", factory)
    engine = engine_for(EngineConfig(kind="registry-test", max_model_len=77), manifest("a"))
    assert isinstance(engine, FakeEngine) and engine.model_name == "a"
    resource = EngineResource(kind="registry-test", max_model_len=88)
    assert isinstance(resource, EngineConfig)  # the resource carries the plain settings' fields
    assert resource.engine_for(manifest("b")).model_name == "b"
    assert [(c.max_model_len, type(c)) for c, _ in made] == [(77, EngineConfig), (88, EngineConfig)]


def test_the_kind_can_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANEX_ENGINE", "registry-env")
    assert EngineConfig().kind == "registry-env"
    monkeypatch.delenv("ANEX_ENGINE")
    assert EngineConfig().kind == "auto"


def test_an_unknown_kind_is_one_clear_line() -> None:
    with pytest.raises(EngineLoadFailed) as raised:
        engine_for(EngineConfig(kind="nope"), manifest())
    assert str(raised.value).startswith("no engine named 'nope': use one of auto, ")
    assert "http" in str(raised.value) and "vllm" in str(raised.value)


def test_loading_ahead_sets_up_vllms_logging_on_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's first engine in a process runs ``dictConfig``; on the loading thread, while another
    thread logs, that deadlocked. ``load_ahead`` does it on the caller's thread first, and builds
    the engine on its own."""
    import logging.config

    import vllm.logger
    from vllm.config.logging import LoggingConfig

    configured_on: list[str] = []
    real_dict_config = logging.config.dictConfig
    monkeypatch.setattr(vllm.logger, "_last_configured_logging_config", None)
    monkeypatch.setattr(
        vllm.logger,
        "dictConfig",
        lambda c: (configured_on.append(threading.current_thread().name), real_dict_config(c)),
    )
    built_on: list[str] = []
    loaded = threading.Event()

    def factory(config: EngineConfig, job: JobManifest) -> FakeEngine:
        built_on.append(threading.current_thread().name)
        return FakeEngine(job.model_name)

    monkeypatch.setitem(loader._factories, "vllm", factory)
    EngineResource(kind="vllm", machine_server=False).load_ahead(manifest(), lambda _: loaded.set(), "ahead")
    assert configured_on == [threading.current_thread().name]
    assert vllm.logger._last_configured_logging_config == LoggingConfig()  # the engine's own call finds it done
    assert loaded.wait(30) and built_on == ["ahead"]

    configured_on.clear()  # an engine that is not built in this process needs no set-up
    register_engine("registry-ahead", factory)
    EngineResource(kind="registry-ahead").load_ahead(manifest(), lambda _: None, "ahead-2")
    assert configured_on == []
