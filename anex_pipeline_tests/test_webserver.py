"""The Dagster webserver on loopback, driven through its GraphQL API the way the UI drives it: add a
`jobs` partition, launch `submit_job` with a launchpad config, wait for the run, and read the
materializations back. The server loads the project's own workspace.yaml (submitting a job needs
no engine) and launches runs in their own processes, as `dagster dev` does."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from dagster_graphql import DagsterGraphQLClient

from anex_pipeline_tests.harness.jobs import REPO, chat_row, write_jsonl
from anex_pipeline_tests.harness.webserver import (
    ADD_PARTITION,
    LOCATION_QUERY,
    Webserver,
    serving,
    step_errors,
    wait_for_run,
)

MATERIALIZATIONS = """
query ($path: [String!]!, $partition: String!) {
  assetOrError(assetKey: {path: $path}) {
    __typename
    ... on Asset {
      key { path }
      assetMaterializations(partitions: [$partition]) {
        partition runId
        metadataEntries {
          label
          ... on IntMetadataEntry { intValue }
          ... on TextMetadataEntry { text }
        }
      }
    }
  }
}
"""


@pytest.fixture(scope="module")
def webserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Webserver]:
    with serving(tmp_path_factory.mktemp("webserver"), REPO / "workspace.yaml") as ws:
        yield ws


def materializations(ws: Webserver, asset: str, partition: str) -> list[dict[str, Any]]:
    found = ws.graphql(MATERIALIZATIONS, path=[asset], partition=partition)["assetOrError"]
    assert found["__typename"] == "Asset" and found["key"]["path"] == [asset]
    return found["assetMaterializations"]


@pytest.mark.daemon
def test_launch_a_job_from_the_launchpad_and_read_its_materializations(webserver: Webserver) -> None:
    location = webserver.graphql(LOCATION_QUERY)["workspaceOrError"]["locationEntries"][0]
    selector = {
        "repositoryLocationName": location["name"],
        "repositoryName": location["locationOrLoadError"]["repositories"][0]["name"],
    }
    src = write_jsonl(webserver.files / "batch.jsonl", [chat_row(f"w{i}", f"question {i}") for i in range(5)])
    out = webserver.files / "batch.results.jsonl"

    added = webserver.graphql(ADD_PARTITION, selector=selector, key="ui-batch")["addDynamicPartition"]
    assert added == {"__typename": "AddDynamicPartitionSuccess", "partitionKey": "ui-batch"}

    client = DagsterGraphQLClient("127.0.0.1", port_number=webserver.port)
    config = {"input": str(src), "output": str(out), "options": {"shards": 2, "max_tokens": 16}}
    run_id = client.submit_job_execution(
        "submit_job",
        run_config={"ops": {"validated_input": {"config": config}}},
        tags={"dagster/partition": "ui-batch"},
    )
    assert wait_for_run(client, run_id) == "SUCCESS", step_errors(webserver, run_id)

    [mat] = materializations(webserver, "validated_input", "ui-batch")
    assert mat["partition"] == "ui-batch" and mat["runId"] == run_id
    meta = {e["label"]: e.get("intValue", e.get("text")) for e in mat["metadataEntries"]}
    assert meta["rows"] == 5 and meta["shards"] == 2 and meta["format"] == "jsonl" and meta["output"] == str(out)
    assert (webserver.work / "ui-batch" / "job.json").exists()  # the run wrote the job's work folder

    # A wrong option fails the run with the submit check's message, and materializes nothing.
    webserver.graphql(ADD_PARTITION, selector=selector, key="ui-bad")
    bad = client.submit_job_execution(
        "submit_job",
        run_config={"ops": {"validated_input": {"config": {**config, "options": {"max_tokens": -3}}}}},
        tags={"dagster/partition": "ui-bad"},
    )
    assert wait_for_run(client, bad) == "FAILURE"
    assert any("max_tokens" in message for message in step_errors(webserver, bad)), step_errors(webserver, bad)
    assert materializations(webserver, "validated_input", "ui-bad") == []
