"""Where vLLM's engine core runs: in the command's process for a small job (one import of vLLM
instead of three), in processes of its own otherwise. The choice shapes how an engine runs, never
what it answers, so engines and the machine's shared server are shared across it."""

from __future__ import annotations

import os
from typing import Any

import pytest

from anex_pipeline.engine import loader
from anex_pipeline.engine.base import Engine
from anex_pipeline.engine.config import EngineConfig
from anex_pipeline.engine.loader import vllm_settings
from anex_pipeline.engine.server.machine_server import settings_key
from anex_pipeline.engine.vllm.engine import MULTIPROCESSING_ENV, build_llm
from anex_pipeline_tests.harness.manifests import job_manifest as manifest


def test_small_jobs_get_the_core_in_process_and_the_rest_get_processes() -> None:
    small = EngineConfig(kind="vllm", core_in_process_rows=256)
    assert vllm_settings(small, manifest(8)).core_in_process
    assert vllm_settings(small, manifest(256)).core_in_process
    assert not vllm_settings(small, manifest(257)).core_in_process
    assert not vllm_settings(EngineConfig(kind="vllm"), manifest(1)).core_in_process  # Dagster's default: never
    assert not vllm_settings(EngineConfig(kind="vllm"), manifest(0)).core_in_process  # a service's warm-up
    spread = EngineConfig(kind="vllm", core_in_process_rows=256, engine_args={"tensor_parallel_size": 2})
    assert not vllm_settings(spread, manifest(8)).core_in_process  # one process per device


def test_the_choice_leaves_the_engine_and_its_shared_server_the_same() -> None:
    config = EngineConfig(kind="vllm", core_in_process_rows=256)
    in_process, processes = vllm_settings(config, manifest(8)), vllm_settings(config, manifest(5000))
    assert in_process.core_in_process != processes.core_in_process
    assert in_process == processes and hash(in_process) == hash(processes)
    assert settings_key(in_process) == settings_key(processes)


def test_the_core_is_built_in_process_only_when_asked_and_the_variable_is_put_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm import envs

    seen: list[str | None] = []

    def fake_llm(**kwargs: Any) -> str:
        seen.append(os.environ.get(MULTIPROCESSING_ENV))
        envs.enable_envs_cache()  # what vLLM's engine core does once it is built
        return "llm"

    monkeypatch.delenv(MULTIPROCESSING_ENV, raising=False)
    assert build_llm(fake_llm, {}, core_in_process=True) == "llm"
    assert not envs._is_envs_cache_enabled()  # a later engine of the process reads the variables afresh
    build_llm(fake_llm, {}, core_in_process=False)
    assert seen == ["0", None] and MULTIPROCESSING_ENV not in os.environ
    monkeypatch.setenv(MULTIPROCESSING_ENV, "1")  # the user's own choice is kept
    build_llm(fake_llm, {}, core_in_process=True)
    assert seen[-1] == "1" and os.environ[MULTIPROCESSING_ENV] == "1"
    envs.disable_envs_cache()  # the fake core above cached them this time: later tests read them afresh


class _Held(Engine):
    model_name = "m"

    def __init__(self, ends_with_process: bool):
        self.ends_with_process = ends_with_process
        self.calls: list[str] = []

    def run(self, requests: Any) -> list[Any]:
        return []

    def shutdown(self) -> None:
        self.calls.append("shutdown")

    def let_go(self) -> None:
        self.calls.append("let_go")


@pytest.mark.parametrize("exiting", [True, False])
def test_a_process_that_ends_next_lets_go_of_an_engine_that_ends_with_it(
    exiting: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The installed command, about to end, skips the 1.5 s shutdown of an engine core in its own
    process; an engine with processes of its own is shut down all the same, and so is every
    engine of a process that goes on."""
    inside, outside = _Held(ends_with_process=True), _Held(ends_with_process=False)
    monkeypatch.setattr(loader, "_loaded", {"a": inside, "b": outside})
    loader.release_engines(exiting)
    assert inside.calls == (["let_go"] if exiting else ["shutdown"])
    assert outside.calls == ["shutdown"] and loader._loaded == {}
