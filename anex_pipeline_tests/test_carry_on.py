"""A small job launched from Dagster is carried through by its submit run: the run goes on with
the job's other steps, each a run of its own, without waiting for job_driver. Bigger jobs, other
executors, a job another process drives, a failed step and a killed submit run are left to the
driver."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.engine.loader import register_engine
from anex_pipeline.orchestration.definitions import build_definitions
from anex_pipeline.orchestration.names import CARRIED_RUN, LAUNCHED_BY_TAG, PARTITION_TAG
from anex_pipeline.orchestration.partitions import job_shard_key
from anex_pipeline.orchestration.runs import job_progress
from anex_pipeline.spec import RowOutcome
from anex_pipeline.testing import FakeEngine, fake_engine
from anex_pipeline.workdir.lease import take_lease
from anex_pipeline_tests.harness.deployment import Deployment, storage_for
from anex_pipeline_tests.harness.jobs import REPO, chat_row, local_instance, read_jsonl, write_jsonl


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    """On disk, reopened by reference by the sensor contexts (as in test_sensors.py)."""
    with local_instance(set_dagster_home=True) as inst:
        yield inst


def runs(instance: dg.DagsterInstance) -> list[tuple[str, str, str | None]]:
    """Every run, oldest first: job name, partition and who launched it."""
    records = sorted(instance.get_run_records(), key=lambda r: r.create_timestamp)
    return [
        (r.dagster_run.job_name, r.dagster_run.tags[PARTITION_TAG], r.dagster_run.tags.get(LAUNCHED_BY_TAG))
        for r in records
    ]


def submit(deployment: Deployment, tmp_path: Path, job_id: str, rows: list, **options: object) -> Path:
    out = tmp_path / f"{job_id}.out.jsonl"
    src = write_jsonl(tmp_path / f"{job_id}.jsonl", rows)
    deployment.submit(job_id, {"input": str(src), "output": str(out), "options": options})
    return out


def report_of(out: Path) -> dict[str, Any]:
    return json.loads(out.with_name(out.name.removesuffix(".jsonl") + ".report.json").read_text())


def test_a_one_shard_job_is_carried_through_its_estimate_shard_and_finish(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    deployment = Deployment(build_definitions(storage_for(tmp_path), fake_engine()), instance)
    rows = [chat_row(f"r{i}", f"question {i}") for i in range(5)]  # no max_tokens: an estimate run
    out = submit(deployment, tmp_path, "small", rows)

    assert runs(instance) == [
        ("submit_job", "small", None),
        ("estimate_job", "small", CARRIED_RUN),
        ("shard_job", job_shard_key("small", 0), CARRIED_RUN),
        ("finish_job", "small", CARRIED_RUN),
    ]
    assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in instance.get_runs())
    assert [r["custom_id"] for r in read_jsonl(out)] == [f"r{i}" for i in range(5)]
    assert report_of(out)["status"] == "completed"
    assert deployment.drive() == []  # nothing left for the driver
    (progress,) = job_progress(instance)
    assert progress.finished > max(progress.shards.values()) > progress.estimated > progress.submitted


def test_a_job_of_more_shards_than_the_setting_waits_for_the_driver(
    tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    deployment = Deployment(build_definitions(storage_for(tmp_path), fake_engine()), instance)
    rows = [chat_row(f"r{i}", f"question {i}", max_tokens=8) for i in range(6)]
    submit(deployment, tmp_path, "two", rows, shards=2)
    assert runs(instance) == [("submit_job", "two", None)]
    assert deployment.drive() == [
        [f"shard_job:{job_shard_key('two', 0)}", f"shard_job:{job_shard_key('two', 1)}"],
        ["finish_job:two"],
    ]

    monkeypatch.setenv("ANEX_CARRY_ON_SHARDS", "2")
    out = submit(deployment, tmp_path, "two-carried", rows, shards=2)
    assert [(name, by) for name, key, by in runs(instance) if key.startswith("two-carried")] == [
        ("submit_job", None),
        ("shard_job", CARRIED_RUN),
        ("shard_job", CARRIED_RUN),
        ("finish_job", CARRIED_RUN),
    ]
    assert len(read_jsonl(out)) == 6


@pytest.mark.parametrize("setting", [("ANEX_CARRY_ON_SHARDS", "0"), ("ANEX_EXECUTOR", "multiprocess")])
def test_the_setting_at_zero_or_another_executor_leaves_every_step_to_the_driver(
    tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch, setting: tuple[str, str]
) -> None:
    deployment = Deployment(build_definitions(storage_for(tmp_path), fake_engine()), instance)
    monkeypatch.setenv(*setting)  # read by the hook when it runs
    submit(deployment, tmp_path, "one", [chat_row("a", "question", max_tokens=8)])
    assert runs(instance) == [("submit_job", "one", None)]
    monkeypatch.delenv(setting[0])
    assert deployment.drive() == [[f"shard_job:{job_shard_key('one', 0)}"], ["finish_job:one"]]


def test_a_setting_that_is_not_a_number_is_told_in_one_line_and_leaves_the_job_to_the_driver(
    tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    deployment = Deployment(build_definitions(storage_for(tmp_path), fake_engine()), instance)
    monkeypatch.setenv("ANEX_CARRY_ON_SHARDS", "one")
    submit(deployment, tmp_path, "typo", [chat_row("a", "question", max_tokens=8)])
    (run,) = instance.get_runs()
    assert run.status == dg.DagsterRunStatus.SUCCESS and runs(instance) == [("submit_job", "typo", None)]
    errors = [e.message for e in instance.all_logs(run.run_id) if e.level >= 40 and e.message]
    assert errors == [
        "ANEX_CARRY_ON_SHARDS='one' is not a whole number of shards; the job's other steps wait for "
        "job_driver (set it to 1, the default, or 0 to turn this off)"
    ]


def test_a_job_another_process_drives_is_not_carried(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    storage = storage_for(tmp_path)
    deployment = Deployment(build_definitions(storage, fake_engine()), instance)
    with take_lease(storage.job("held")):  # e.g. `anex-pipeline run` resuming the same job
        submit(deployment, tmp_path, "held", [chat_row("a", "question", max_tokens=8)])
    assert runs(instance) == [("submit_job", "held", None)]


class FailingEngine(FakeEngine):
    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        raise RuntimeError("the accelerator went away")


register_engine("carry-failing", lambda config, manifest: FailingEngine(manifest.model_name))


@pytest.mark.slow  # the shard's own retries wait 1 s and 2 s
def test_a_failed_step_ends_the_carrying_and_the_driver_finishes_the_job(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    deployment = Deployment(build_definitions(storage_for(tmp_path), fake_engine("carry-failing")), instance)
    out = submit(deployment, tmp_path, "sick", [chat_row("a", "question", max_tokens=8)])
    assert runs(instance) == [("submit_job", "sick", None), ("shard_job", job_shard_key("sick", 0), CARRIED_RUN)]
    (submit_run,) = instance.get_runs(filters=dg.RunsFilter(job_name="submit_job"))
    assert submit_run.status == dg.DagsterRunStatus.SUCCESS  # the submit itself went well
    logs = [e.message for e in instance.all_logs(submit_run.run_id) if e.message]
    assert any("failed: RuntimeError: the accelerator went away" in m and "job_driver" in m for m in logs), logs

    # Once: the failure is set against the finish by the instance's index (on SQLite the failed
    # run's own event ids are numbered apart, and the finish was asked for again and again).
    assert deployment.drive() == [["finish_job:sick"]]
    report = report_of(out)
    assert report["status"] == "failed" and report["failure_reason"].startswith(
        "shard 0: RuntimeError: the accelerator went away"
    )


class TerminatedWhileItRuns(FakeEngine):
    """Generates the rows, while a Terminate of the submit run lands (as from the UI): the shard
    step still succeeds, since its stop check never sees the signal."""

    instance: dg.DagsterInstance

    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        (submit_run,) = self.instance.get_runs(filters=dg.RunsFilter(job_name="submit_job"))
        self.instance.report_run_canceling(submit_run)
        return super().run(requests)


_terminated = TerminatedWhileItRuns("fake-model")
register_engine("carry-terminated", lambda config, manifest: _terminated)


def test_a_terminate_during_a_step_that_succeeds_starts_no_further_step(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    _terminated.instance = instance
    deployment = Deployment(build_definitions(storage_for(tmp_path), fake_engine("carry-terminated")), instance)
    src = write_jsonl(tmp_path / "ended.jsonl", [chat_row("a", "question", max_tokens=8)])
    instance.add_dynamic_partitions("jobs", ["ended"])
    config = {"input": str(src), "output": str(tmp_path / "ended.out.jsonl"), "options": {}}
    request = dg.RunRequest(partition_key="ended", run_config={"ops": {"validated_input": {"config": config}}})
    result = deployment.execute(request, "submit_job", must_succeed=False)
    assert not result.success, "the submit run ends as stopped, not as a success"
    assert runs(instance) == [("submit_job", "ended", None), ("shard_job", job_shard_key("ended", 0), CARRIED_RUN)]


@pytest.mark.subprocess
def test_a_submit_run_killed_while_it_carries_its_job_leaves_the_job_to_the_driver(tmp_path: Path) -> None:
    home, work = tmp_path / "dagster", tmp_path / "work"
    home.mkdir()
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"k{i}", f"question {i}", max_tokens=9) for i in range(8)])
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "DAGSTER_HOME": str(home), "ANEX_FAKE_ROW_DELAY_S": "10"}
    command = [sys.executable, "-m", "anex_pipeline_tests.harness.submit_run", str(work), "killed", str(src), str(out)]
    with local_instance(str(home), set_dagster_home=True) as instance:
        deployment = Deployment(build_definitions(storage_for(tmp_path), fake_engine()), instance)
        process = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            shard_run = wait_for_carried_shard(instance, process)
            assert not deployment.tick("job_driver").run_requests
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
        assert instance.get_run_by_id(shard_run.run_id).status == dg.DagsterRunStatus.STARTED  # for good
        # What the UI's Terminate does to a run whose process is gone (or the daemon's run
        # monitoring, where it is on): the submit run is marked ended. Its carried shard run is
        # not, but it was live only while the dead process held the job's lease.
        (submit_run,) = instance.get_runs(filters=dg.RunsFilter(job_name="submit_job"))
        instance.report_run_canceled(submit_run)

        assert deployment.drive() == [[f"shard_job:{job_shard_key('killed', 0)}"], ["finish_job:killed"]]
    assert [r["custom_id"] for r in read_jsonl(out)] == [f"k{i}" for i in range(8)]


def wait_for_carried_shard(instance: dg.DagsterInstance, process: subprocess.Popen[bytes]) -> dg.DagsterRun:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
        filters = dg.RunsFilter(
            job_name="shard_job", tags={LAUNCHED_BY_TAG: CARRIED_RUN}, statuses=[dg.DagsterRunStatus.STARTED]
        )
        if started := instance.get_runs(filters=filters):
            return started[0]
        time.sleep(0.2)
    raise AssertionError("the submit run never carried its shard on")
