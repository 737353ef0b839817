"""The Dagster instance of ``anex-pipeline``: first use of an empty DAGSTER_HOME by several
processes at once, in real processes started together; a new home keeps every run's events in
one database file."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from anex_pipeline_tests.harness.commands import FAKE_CLI
from anex_pipeline_tests.harness.jobs import chat_row, write_jsonl

PROCESSES = 4
# Each process imports everything first, says it is ready, then waits for the common start.
CREATE = """
import os, sys, time
from pathlib import Path
from anex_pipeline.instance import dagster_instance
ready, go = Path(sys.argv[1]), Path(sys.argv[2])
ready.touch()
while not go.exists():
    time.sleep(0.001)
dagster_instance().get_runs()
"""


@pytest.mark.subprocess
def test_first_runs_at_once_share_one_new_home(tmp_path: Path) -> None:
    home = tmp_path / "dagster"
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    go = tmp_path / "go"
    ready = [tmp_path / f"ready-{i}" for i in range(PROCESSES)]
    procs = [
        subprocess.Popen([sys.executable, "-c", CREATE, str(r), str(go)], env=env, stderr=subprocess.PIPE, text=True)
        for r in ready
    ]
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ready):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a process did not start"
        time.sleep(0.01)
    go.touch()
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * PROCESSES, "\n".join(errors)
    # the new home gets its own settings, so Dagster prints no warning or telemetry banner about it
    assert (home / "dagster.yaml").is_file()
    assert not any("No dagster instance configuration" in e or "Telemetry" in e for e in errors), errors

    with sqlite3.connect(home / "history" / "runs.db") as db:
        assert len(db.execute("select * from alembic_version").fetchall()) == 1  # one migration head

    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("r0", "hello")])
    run = subprocess.run(
        [
            *FAKE_CLI,
            "run",
            str(src),
            "-o",
            str(tmp_path / "out.jsonl"),
        ],
        env={**env, "ANEX_WORK_DIR": str(tmp_path / "work")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    # every run's events are in the one event database of the home, none in a file of its own
    assert [p.name for p in (home / "history").rglob("*.db")] == ["runs.db"]
    with sqlite3.connect(home / "event_log.db") as db:
        runs = db.execute("select count(distinct run_id) from event_logs where run_id != ''").fetchone()[0]
        stored = db.execute(
            "select count(*) from event_logs where dagster_event_type = 'ASSET_MATERIALIZATION'"
        ).fetchone()[0]
    assert runs == 4 and stored >= 4  # submit, estimate, the shard and finish, each with its materializations
