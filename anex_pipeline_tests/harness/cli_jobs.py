"""The command run in this process on the fake engine (the ``home`` fixture), the command for
jobs that must be refused before any step runs (``refusing_cli``), and a job's traces in the
instance."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from anex_pipeline import cli
from anex_pipeline.orchestration.partitions import JOBS, SHARDS
from anex_pipeline.orchestration.runs import job_of_run
from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.jobs import chat_row, write_jsonl

ASSETS = ["validated_input", "length_estimate", "fetched_media", "generations", "merged_result", "result_file"]

DAY = 86400.0


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A Dagster home on disk and a work folder, as the installed command uses them, on the fake engine."""
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ANEX_WORK_DIR", str(tmp_path / "work"))
    monkeypatch.setenv("ANEX_ENGINE", "fake")  # the command's engine settings read it
    yield tmp_path / "home"


@pytest.fixture
def refusing_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The command's work folder and Dagster instance in tmp_path, and no Dagster step allowed:
    a job that reaches one fails its test."""
    monkeypatch.setenv("ANEX_WORK_DIR", str(tmp_path / "work"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))

    def no_steps(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a refused job reached the Dagster steps")

    monkeypatch.setattr(JobRunner, "_execute", no_steps)
    progress = logging.getLogger("anex_pipeline.progress")
    handlers = list(progress.handlers)
    yield
    progress.handlers[:] = handlers  # `run` adds a handler bound to this test's captured stderr


def anex(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def run_cli_job(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> tuple[str, Path]:
    src = write_jsonl(tmp_path / f"{name}.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(4)])
    out = tmp_path / f"{name}.results.jsonl"
    code, report, err = anex(capsys, "run", str(src), "-o", str(out), "--shards", "2", "--quiet")
    assert code == 0, err
    return json.loads(report)["job_id"], out


def partitions_of(instance: dg.DagsterInstance, job_id: str) -> dict[str, list[str]]:
    """Every trace of a job in the instance: partition keys, materialized partitions, runs."""
    found = {
        "jobs": [k for k in instance.get_dynamic_partitions(JOBS) if k == job_id],
        "job|shard": [k for k in instance.get_dynamic_partitions(SHARDS) if k.startswith(f"{job_id}|")],
        "runs": [r.run_id for r in instance.get_runs() if job_of_run(r) == job_id],
    }
    for asset in ASSETS:
        keys = instance.get_latest_storage_id_by_partition(
            dg.AssetKey(asset), dg.DagsterEventType.ASSET_MATERIALIZATION
        )
        found[asset] = [k for k in keys if job_id in k]
    return found


def make_old(root: Path, age_s: float) -> None:
    stamp = time.time() - age_s
    for dirpath, _, filenames in os.walk(root):
        for name in [*filenames, "."]:
            os.utime(os.path.join(dirpath, name), (stamp, stamp))
