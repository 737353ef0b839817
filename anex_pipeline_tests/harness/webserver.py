"""A real dagster-webserver on loopback and the GraphQL queries the tests send it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from dagster_graphql import DagsterGraphQLClient

from anex_pipeline.engine.orphans import signal_child_group
from anex_pipeline_tests.harness.jobs import DAEMONLESS_INSTANCE_YAML, REPO
from anex_pipeline_tests.harness.ports import free_port

LOCATION_QUERY = """
{ workspaceOrError { ... on Workspace { locationEntries {
    name loadStatus
    locationOrLoadError {
        __typename ... on RepositoryLocation { repositories { name } } ... on PythonError { message }
    }
} } } }
"""

ADD_PARTITION = """
mutation ($selector: RepositorySelector!, $key: String!) {
  addDynamicPartition(repositorySelector: $selector, partitionsDefName: "jobs", partitionKey: $key) {
    __typename ... on AddDynamicPartitionSuccess { partitionKey } ... on PythonError { message }
  }
}
"""

STEP_ERRORS = """
query ($runId: ID!) {
  logsForRun(runId: $runId) {
    ... on EventConnection { events { __typename ... on ExecutionStepFailureEvent { error { message } } } }
  }
}
"""


@dataclass
class Webserver:
    url: str
    port: int
    work: Path
    files: Path

    def graphql(self, query: str, **variables: Any) -> dict[str, Any]:
        reply = httpx.post(f"{self.url}/graphql", json={"query": query, "variables": variables}, timeout=60)
        reply.raise_for_status()
        body = reply.json()
        assert "errors" not in body, body["errors"]
        return body["data"]


@contextmanager
def serving(root: Path, workspace: Path, **extra_env: str) -> Iterator[Webserver]:
    """A real `dagster-webserver` on loopback for the workspace, with a daemonless instance under
    ``root``; stopped (with its code server) on the way out."""
    home = root / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(DAEMONLESS_INSTANCE_YAML)
    port = free_port()
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "ANEX_WORK_DIR": str(root / "work"),
        "NO_PROXY": "127.0.0.1,localhost",
        **extra_env,
    }
    command = [sys.executable, "-m", "dagster_webserver", "-h", "127.0.0.1", "-p", str(port), "-w", str(workspace)]
    with (root / "webserver.log").open("wb") as log:
        server = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    ws = Webserver(f"http://127.0.0.1:{port}", port, root / "work", root)
    try:
        wait_until_loaded(ws, server, root / "webserver.log")
        yield ws
    finally:
        server.send_signal(signal.SIGINT)  # the server stops its code server on the way out
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            signal_child_group(server, signal.SIGKILL)  # the session it was started in, and nothing else
            server.wait(timeout=30)


def wait_until_loaded(ws: Webserver, server: subprocess.Popen[bytes], log: Path) -> None:
    """Waits for the server to answer and for the code location to be loaded."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the webserver exited:\n{log.read_text()[-3000:]}"
        try:
            entries = ws.graphql(LOCATION_QUERY)["workspaceOrError"]["locationEntries"]
        except httpx.HTTPError:
            entries = []
        loaded = [e for e in entries if e["loadStatus"] == "LOADED"]
        if loaded:
            location = loaded[0]["locationOrLoadError"]
            assert location["__typename"] == "RepositoryLocation", location
            return
        time.sleep(1)
    raise AssertionError(f"the code location did not load within 240 s:\n{log.read_text()[-3000:]}")


def wait_for_run(client: DagsterGraphQLClient, run_id: str) -> str:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status = client.get_run_status(run_id).value
        if status in ("SUCCESS", "FAILURE", "CANCELED"):
            return status
        time.sleep(1)
    raise AssertionError(f"run {run_id} did not finish within 300 s")


def step_errors(ws: Webserver, run_id: str) -> list[str]:
    """The error messages of the run's failed steps, as the run's page shows them."""
    events = ws.graphql(STEP_ERRORS, runId=run_id)["logsForRun"]["events"]
    return [e["error"]["message"] for e in events if e["__typename"] == "ExecutionStepFailureEvent"]
