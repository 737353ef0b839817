"""The garbage collector's pause while a process starts and builds an engine: off during any span,
on again when the last one ends (overlapping spans on two threads, the start-up hold), and left
off when it was off before."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from anex_pipeline.engine import collector
from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.jobs import chat_row, run_job, write_jsonl


@pytest.fixture(autouse=True)
def _collector_on() -> Iterator[None]:
    gc.enable()
    yield
    collector.end_start_up()
    gc.enable()


def test_overlapping_spans_keep_it_off_until_the_last_one_ends() -> None:
    inside, leave = threading.Event(), threading.Event()

    def other_thread() -> None:
        with collector.paused():
            inside.set()
            leave.wait(10)

    worker = threading.Thread(target=other_thread)
    worker.start()
    assert inside.wait(10) and not gc.isenabled()
    with collector.paused():
        leave.set()
        worker.join(10)
        assert not gc.isenabled()  # the other span ended; this one has not
    assert gc.isenabled()


def test_the_start_up_hold_ends_once_and_outlasts_spans() -> None:
    collector.hold_for_start_up()
    collector.hold_for_start_up()  # once per process
    with collector.paused():
        pass
    assert not gc.isenabled()
    collector.end_start_up()
    assert gc.isenabled()
    collector.end_start_up()  # a second end takes nothing away from a span
    with collector.paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    with collector.paused():
        pass
    assert not gc.isenabled()


def test_a_job_ends_the_start_up_hold_once_its_engine_is_in_hand(tmp_path: Path, fake_runner: JobRunner) -> None:
    collector.hold_for_start_up()
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("a", "hello")])
    assert run_job(fake_runner, src, tmp_path / "out.jsonl").status == "completed"
    assert gc.isenabled()  # the job generated with the collector on
