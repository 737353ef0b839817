"""Stopping real commands on the real engine: Ctrl-C to ``anex-pipeline run`` (sent to its whole
process group, as a terminal does, so vLLM's engine process gets it too; the job is small, so the
command runs vLLM's engine core in its own process, and the Ctrl-C test of
``test_engine_tensor_parallel.py`` covers engine processes), and SIGTERM to ``anex-pipeline serve``
while its engine loads and while it generates."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from anex_pipeline.engine.orphans import signal_child_group
from anex_pipeline_tests.harness.commands import (
    Lines,
    Served,
    own_lines,
    start,
    story_rows,
)
from anex_pipeline_tests.harness.jobs import read_jsonl, write_jsonl

pytestmark = pytest.mark.engine

ROWS = 100


@pytest.mark.subprocess
def test_ctrl_c_stops_a_real_run_within_seconds_and_the_rerun_resumes(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", story_rows(ROWS))
    out = tmp_path / "out.jsonl"
    args = ["run", str(src), "-o", str(out), "--max-tokens", "64", "--work-dir", str(tmp_path / "work")]
    first = start(args, tmp_path / "dagster_home")
    err = Lines(first.stderr)  # type: ignore[arg-type]
    err.wait_for(r"\[anex\] [1-9]\d*/\d+ rows", timeout=400)  # rows are finishing
    assert signal_child_group(first, signal.SIGINT)  # a terminal's Ctrl-C: the whole group
    asked = time.monotonic()
    stdout = first.stdout.read()  # type: ignore[union-attr]
    code = first.wait(timeout=60)
    took = time.monotonic() - asked
    stderr = err.rest()
    assert code == 1, stderr
    assert took < 30, f"the run took {took:.1f} s to stop"
    assert "Traceback" not in own_lines(stderr) and "KeyboardInterrupt" not in stderr, stderr
    assert "Ctrl-C again" in stderr
    report = json.loads(stdout)
    assert report["status"] == "stopped_early", report
    assert "cancelled by the user" in report["failure_reason"]
    kept = report["request_counts"]["completed"]
    assert 0 < kept < ROWS

    second = start(args, tmp_path / "dagster_home")
    stdout, stderr = second.communicate(timeout=600)
    assert second.returncode == 0, stderr
    assert json.loads(stdout)["status"] == "completed"
    assert json.loads(stdout)["engine"]["core_in_process"] is True  # a small job
    assert [r["custom_id"] for r in read_jsonl(out)] == [f"r{i}" for i in range(ROWS)]


@pytest.mark.subprocess
def test_sigterm_ends_serve_within_seconds_while_its_engine_loads(tmp_path: Path) -> None:
    with Served(tmp_path) as served:
        served.submit(write_jsonl(tmp_path / "in.jsonl", story_rows(4)))
        served.err.wait_for(r"loading .* into vLLM", timeout=120)
        took = served.terminate(timeout=15)
        stderr = served.err.rest()
    assert took < 15, f"serve took {took:.1f} s to end"
    assert served.process.returncode == 0 and "serve: ended on SIGTERM" in stderr, stderr
    assert "Traceback" not in own_lines(stderr), stderr


@pytest.mark.subprocess
def test_cancel_stops_a_real_batch_within_seconds_and_answers_every_row(tmp_path: Path) -> None:
    rows = 60
    with Served(tmp_path) as served:
        # the longest rows take 256 engine steps: the batch cannot end before the cancel on a fast machine
        batch_id = served.submit(write_jsonl(tmp_path / "in.jsonl", story_rows(rows, longest=256)))
        seen = {served.wait_for_rows(batch_id, 1)}
        started = time.monotonic()
        while time.monotonic() - started < 4:  # 4 s into generation, watching the counts move
            seen.add(served.completed(batch_id))
            time.sleep(0.1)
        served.sdk.batches.cancel(batch_id)
        asked = time.monotonic()
        while (batch := served.sdk.batches.retrieve(batch_id)).status != "cancelled":
            assert time.monotonic() - asked < 20, f"still {batch.status} 20 s after the cancel"
            time.sleep(0.1)
        assert len(seen) > 1, "request_counts followed the rows as they finished"
        counts = batch.request_counts
        assert counts is not None and counts.total == rows
        output = [json.loads(x) for x in served.sdk.files.content(batch.output_file_id).text.splitlines()]
        errors = [json.loads(x) for x in served.sdk.files.content(batch.error_file_id).text.splitlines()]
        assert 0 < counts.completed == len(output) < rows
        assert counts.failed == len(errors) == rows - len(output)
        assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
        ids = [r["custom_id"] for r in output] + [e["custom_id"] for e in errors]
        assert sorted(ids, key=lambda c: int(c[1:])) == [f"r{i}" for i in range(rows)]
        assert [e["custom_id"] for e in errors] == sorted((e["custom_id"] for e in errors), key=lambda c: int(c[1:]))

        # SIGTERM while a batch generates: serve stops it at once and ends.
        second = served.submit(write_jsonl(tmp_path / "more.jsonl", story_rows(rows, topic="river")))
        served.wait_for_rows(second, 1)
        took = served.terminate(timeout=15)
        stderr = served.err.rest()
        assert took < 15, f"serve took {took:.1f} s to end"
        assert served.process.returncode == 0 and "serve: ended on SIGTERM" in stderr, stderr
    assert "Traceback" not in own_lines(stderr), stderr
