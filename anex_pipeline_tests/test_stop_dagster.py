"""Terminating a generating run from Dagster, as the UI's "Terminate" button does: a real webserver
launches ``shard_job`` in its own processes (the default run launcher, the multiprocess executor),
and the termination reaches the step as a signal. The step stops at its next engine step, keeps
its finished rows, and is not retried."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from dagster_graphql import DagsterGraphQLClient

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


def messages(ws: Webserver, run_id: str) -> list[str]:
    return [e.get("message") or "" for e in ws.graphql(RUN_EVENTS, runId=run_id)["logsForRun"]["events"]]


@pytest.mark.daemon
def test_a_run_terminated_from_dagster_keeps_its_rows_and_is_not_retried(tmp_path: Path) -> None:
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(
        "load_from:\n  - python_module:\n      module_name: anex_pipeline_tests.harness.stepping\n"
        f"      working_directory: {REPO}\n"
    )
    with serving(tmp_path, workspace, ANEX_FAKE_STEP_S="0.05") as ws:  # 400 rows take 20 s
        location = ws.graphql(LOCATION_QUERY)["workspaceOrError"]["locationEntries"][0]
        selector = {
            "repositoryLocationName": location["name"],
            "repositoryName": location["locationOrLoadError"]["repositories"][0]["name"],
        }
        client = DagsterGraphQLClient("127.0.0.1", port_number=ws.port)
        src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(ROWS)])
        ws.graphql(ADD_PARTITION, selector=selector, key="ui-stop")
        config = {"input": str(src), "output": str(tmp_path / "out.jsonl"), "options": {"max_tokens": 8}}
        submitted = client.submit_job_execution(
            "submit_job",
            run_config={"ops": {"validated_input": {"config": config}}},
            tags={"dagster/partition": "ui-stop"},
        )
        assert wait_for_run(client, submitted) == "SUCCESS", step_errors(ws, submitted)

        job = JobDir(tmp_path / "work", "ui-stop")
        key = job_shard_key("ui-stop", 0)
        run_id = client.submit_job_execution(
            "shard_job",
            tags={"dagster/partition": key},
        )
        deadline = time.monotonic() + 120
        while not any(re.match(r"[1-9]\d*/\d+ rows done", m) for m in messages(ws, run_id)):
            assert time.monotonic() < deadline, "the shard made no progress"
            time.sleep(0.2)
        client.terminate_run(run_id)
        assert wait_for_run(client, run_id) == "CANCELED"
        events = ws.graphql(RUN_EVENTS, runId=run_id)["logsForRun"]["events"]
        starts = [e["stepKey"] for e in events if e["__typename"] == "ExecutionStepStartEvent"]
    kept = [o.key for o in job.outcomes(0)]
    assert 0 < len(kept) < ROWS, "the finished rows were checkpointed, the rest not run"
    assert "cancelled by the user" in (job.stop_reason() or "")
    assert starts.count("generations") == 1, "the terminated step was not retried"
