"""Which engine a job gets: every knob that takes part goes through engine_mode, one function."""

from __future__ import annotations

import pytest

from anex_pipeline.engine.config import EngineConfig
from anex_pipeline.engine.modes import EngineMode, engine_mode
from anex_pipeline.orchestration.resources import EngineResource
from anex_pipeline_tests.harness.manifests import job_manifest


@pytest.mark.parametrize(
    ("settings", "rows", "mode"),
    [
        ({"machine_server": False}, 8, EngineMode.IN_PROCESS),
        ({"machine_server": False, "core_in_process_rows": 10}, 8, EngineMode.IN_PROCESS_CORE),
        ({"machine_server": False, "core_in_process_rows": 10}, 11, EngineMode.IN_PROCESS),
        (
            {"machine_server": False, "core_in_process_rows": 10, "engine_args": {"tensor_parallel_size": 2}},
            8,
            EngineMode.IN_PROCESS,
        ),
        ({"machine_server": True}, 8, EngineMode.MACHINE_SERVER),
        ({"machine_server": False, "warm_server": True}, 8, EngineMode.WARM_SERVER),
        ({"base_url": "http://127.0.0.1:9"}, 8, EngineMode.EXTERNAL),
        ({"kind": "registered-elsewhere", "machine_server": True}, 8, EngineMode.EXTERNAL),
    ],
)
def test_the_settings_pick_one_mode(settings: dict, rows: int, mode: EngineMode) -> None:
    assert engine_mode(EngineConfig(**settings), job_manifest(rows)) is mode


@pytest.mark.parametrize(
    ("env", "on"), [({}, True), ({"ANEX_EXECUTOR": "k8s"}, False), ({"ANEX_MACHINE_SERVER": "0"}, False)]
)
def test_the_machine_server_is_on_by_default_outside_pods(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], on: bool
) -> None:
    for name in ("ANEX_EXECUTOR", "ANEX_MACHINE_SERVER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert EngineConfig().machine_server is on


def test_a_process_that_runs_every_step_keeps_its_engine_in_process() -> None:
    wrapped = EngineResource.wrapping(EngineConfig(machine_server=True, warm_server=True), keep_loaded=True)
    assert engine_mode(wrapped.plain(), job_manifest(8)) is EngineMode.WARM_SERVER
    assert engine_mode(EngineResource.wrapping(EngineConfig()).plain(), job_manifest(8)) is EngineMode.IN_PROCESS
