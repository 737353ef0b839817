"""Terminating a generating run from Dagster, as the UI's "Terminate" button does: a real webserver
launches the runs in processes of their own (the default run launcher), and the termination
reaches the step as a signal. The step stops at its next engine step, keeps its finished rows, and
is not retried. The same holds for a small job's submit run while it carries the job's shard."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from dagster_graphql import DagsterGraphQLClient

from anex_pipeline.orchestration.names import CARRIED_RUN, LAUNCHED_BY_TAG
from anex_pipeline.orchestration.partitions import job_shard_key
from anex_pipeline.workdir.manifest import JobDir
from anex_pipeline_tests.harness.jobs import REPO, chat_row, write_jsonl
from anex_pipeline_tests.harness.webserver import (
    ADD_PARTITION,
    LOCATION_QUERY,
    Webserver,
    serving,
    step_errors,
    wait_for_run,
)

ROWS = 400
RUN_EVENTS = """
query ($runId: ID!) {
  logsForRun(runId: $runId) {
    ... on EventConnection {
      events { __typename ... on MessageEvent { message } ... on ExecutionStepStartEvent { stepKey } }
    }
  }
}
"""


RUNS_TAGGED = """
query ($key: String!, $value: String!) {
  runsOrError(filter: {tags: [{key: $key, value: $value}]}) {
    ... on Runs { results { runId jobName status } }
  }
}
"""


def messages(ws: Webserver, run_id: str) -> list[str]:
    return [e.get("message") or "" for e in ws.graphql(RUN_EVENTS, runId=run_id)["logsForRun"]["events"]]


def wait_for_progress(ws: Webserver, run_id: str) -> None:
    """Until the run's log says some rows are done."""
    deadline = time.monotonic() + 120
    while not any(re.match(r"[1-9]\d*/\d+ rows done", m) for m in messages(ws, run_id)):
        assert time.monotonic() < deadline, "the shard made no progress"
        time.sleep(0.2)


def carried_runs(ws: Webserver) -> list[dict[str, str]]:
    return ws.graphql(RUNS_TAGGED, key=LAUNCHED_BY_TAG, value=CARRIED_RUN)["runsOrError"]["results"]


def stepping_workspace(tmp_path: Path) -> Path:
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(
        "load_from:\n  - python_module:\n      module_name: anex_pipeline_tests.harness.stepping\n"
        f"      working_directory: {REPO}\n"
    )
    return workspace


def launch_submit(ws: Webserver, tmp_path: Path, job_id: str) -> tuple[DagsterGraphQLClient, str]:
    """A new job of ROWS rows, one shard, launched from the launchpad; returns the submit run's id."""
    location = ws.graphql(LOCATION_QUERY)["workspaceOrError"]["locationEntries"][0]
    selector = {
        "repositoryLocationName": location["name"],
        "repositoryName": location["locationOrLoadError"]["repositories"][0]["name"],
    }
    client = DagsterGraphQLClient("127.0.0.1", port_number=ws.port)
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(ROWS)])
    ws.graphql(ADD_PARTITION, selector=selector, key=job_id)
    config = {"input": str(src), "output": str(tmp_path / "out.jsonl"), "options": {"max_tokens": 8}}
    run_id = client.submit_job_execution(
        "submit_job",
        run_config={"ops": {"validated_input": {"config": config}}},
        tags={"dagster/partition": job_id},
    )
    return client, run_id


@pytest.mark.daemon
def test_a_run_terminated_from_dagster_keeps_its_rows_and_is_not_retried(tmp_path: Path) -> None:
    # Every step waits for its own run here: the shard run is the one launched and terminated.
    with serving(tmp_path, stepping_workspace(tmp_path), ANEX_FAKE_STEP_S="0.05", ANEX_CARRY_ON_SHARDS="0") as ws:
        client, submitted = launch_submit(ws, tmp_path, "ui-stop")  # 400 rows take 20 s
        assert wait_for_run(client, submitted) == "SUCCESS", step_errors(ws, submitted)
        assert carried_runs(ws) == []

        job = JobDir(tmp_path / "work", "ui-stop")
        key = job_shard_key("ui-stop", 0)
        run_id = client.submit_job_execution(
            "shard_job",
            tags={"dagster/partition": key},
        )
        wait_for_progress(ws, run_id)
        client.terminate_run(run_id)
        assert wait_for_run(client, run_id) == "CANCELED"
        events = ws.graphql(RUN_EVENTS, runId=run_id)["logsForRun"]["events"]
        starts = [e["stepKey"] for e in events if e["__typename"] == "ExecutionStepStartEvent"]
    kept = [o.key for o in job.outcomes(0)]
    assert 0 < len(kept) < ROWS, "the finished rows were checkpointed, the rest not run"
    assert "cancelled by the user" in (job.stop_reason() or "")
    assert starts.count("generations") == 1, "the terminated step was not retried"


@pytest.mark.daemon
def test_a_submit_run_terminated_while_it_carries_its_shard_keeps_the_rows(tmp_path: Path) -> None:
    with serving(tmp_path, stepping_workspace(tmp_path), ANEX_FAKE_STEP_S="0.05") as ws:
        client, submitted = launch_submit(ws, tmp_path, "ui-carried")
        deadline = time.monotonic() + 120
        while not (shards := [r for r in carried_runs(ws) if r["jobName"] == "shard_job"]):
            assert time.monotonic() < deadline, "the submit run did not carry the shard on"
            assert client.get_run_status(submitted).value not in ("SUCCESS", "FAILURE", "CANCELED")
            time.sleep(0.2)
        wait_for_progress(ws, shards[0]["runId"])
        client.terminate_run(submitted)
        ended = wait_for_run(client, submitted)
        carried = {r["jobName"]: r["status"] for r in carried_runs(ws)}
        submit_log = messages(ws, submitted)
    job = JobDir(tmp_path / "work", "ui-carried")
    kept = [o.key for o in job.outcomes(0)]
    assert 0 < len(kept) < ROWS, "the finished rows were checkpointed, the rest not run"
    assert "cancelled by the user" in (job.stop_reason() or "")
    assert ended == "CANCELED", submit_log
    assert carried == {"shard_job": "FAILURE"}, "no finish was carried after the stop: the driver publishes"
    assert any(
        "failed: stopped: cancelled by the user" in m and "job_driver takes the job on" in m for m in submit_log
    ), submit_log
