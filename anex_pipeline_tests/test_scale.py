"""Shards without a ceiling: how many a job gets, and that the instance holds exactly its keys.

A job's shards are keys ``<job>|<shard>`` of the ``shards`` dynamic partition, added when the job
is prepared: a 40-shard job has 40 keys of each per-shard asset and one of each job-level asset,
and deleting it removes every one of them. Jobs whose shards have no keys yet (prepared before
shards had keys of their own) get them when they are run or driven.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
from dagster_graphql import DagsterGraphQLClient

from anex_pipeline.options import job_options
from anex_pipeline.orchestration.definitions import build_definitions
from anex_pipeline.orchestration.partitions import JOBS, SHARDS, job_shard_key, register_job, shard_keys, shard_keys_on
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobOptions, JobRejected
from anex_pipeline.stages.submit import ROWS_PER_SHARD, TOKENS_PER_SHARD, shard_count
from anex_pipeline.testing import fake_engine
from anex_pipeline_tests.harness.cli_jobs import anex
from anex_pipeline_tests.harness.deployment import Deployment
from anex_pipeline_tests.harness.jobs import REPO, chat_row, local_instance, read_jsonl, run_job, write_jsonl
from anex_pipeline_tests.harness.webserver import ADD_PARTITION, LOCATION_QUERY, serving, step_errors, wait_for_run

PER_SHARD = ["fetched_media", "generations"]
PER_JOB = ["validated_input", "length_estimate", "merged_result", "result_file"]


def materialized(instance: dg.DagsterInstance, asset: str, job_id: str) -> list[str]:
    keys = instance.get_latest_storage_id_by_partition(dg.AssetKey(asset), dg.DagsterEventType.ASSET_MATERIALIZATION)
    return sorted(k for k in keys if k == job_id or k.startswith(f"{job_id}|"))


def test_shard_count_follows_the_rows_the_tokens_and_the_options() -> None:
    plain = JobOptions()
    assert shard_count(100, 10_000, plain) == 1
    assert shard_count(10_000_000, 500_000_000, plain) == -(-10_000_000 // ROWS_PER_SHARD)  # no ceiling: 2,442
    # Long prompts: 1,000 rows of 40 kB each are ~10M prompt tokens, so tokens decide.
    assert shard_count(1000, 40_000_000, plain) == -(-(10_000_000 + 1000 * 256) // TOKENS_PER_SHARD)
    assert shard_count(1000, 40_000_000, JobOptions(max_tokens=4000)) == -(-14_000_000 // TOKENS_PER_SHARD)
    assert shard_count(400, 1, JobOptions(shards=40)) == 40
    assert shard_count(400, 1, JobOptions(shards=5000)) == 400  # never more shards than rows
    assert shard_count(400, 1, JobOptions(shard_rows=7)) == 58
    with pytest.raises(JobRejected) as both:
        job_options({"shards": 4, "shard_rows": 10})
    assert both.value.render().splitlines()[1] == "  field 'shards': set shards or shard_rows, not both (options)"
    with pytest.raises(JobRejected) as zero:
        job_options({"shard_rows": 0})
    assert "shard_rows" in zero.value.render()


@pytest.mark.slow
def test_forty_shards_complete_once_in_order_with_exactly_their_keys_and_delete_removes_them(
    tmp_path: Path,
    home: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = write_jsonl(tmp_path / "big.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(400)])
    out = tmp_path / "big.results.jsonl"
    code, report, err = anex(capsys, "run", str(src), "-o", str(out), "--shards", "40", "--quiet")
    assert code == 0, err
    job_id = json.loads(report)["job_id"]
    assert [line["custom_id"] for line in read_jsonl(out)] == [f"r{i}" for i in range(400)]  # once each, in order

    with dg.DagsterInstance.get() as instance:
        assert shard_keys_on(instance, job_id) == shard_keys(job_id, 40)
        assert instance.get_dynamic_partitions(JOBS) == [job_id]
        for asset in PER_SHARD:
            assert materialized(instance, asset, job_id) == sorted(shard_keys(job_id, 40)), asset
        for asset in PER_JOB:
            assert materialized(instance, asset, job_id) == [job_id], asset
        shard_runs = instance.get_runs(filters=dg.RunsFilter(job_name="shard_job"))
        assert sorted(r.tags["dagster/partition"] for r in shard_runs) == sorted(shard_keys(job_id, 40))  # once each
        assert {r.status for r in shard_runs} == {dg.DagsterRunStatus.SUCCESS}

    code, _, err = anex(capsys, "delete", job_id)
    assert code == 0, err
    assert out.is_file()
    with dg.DagsterInstance.get() as instance:
        assert instance.get_dynamic_partitions(SHARDS) == [] and instance.get_dynamic_partitions(JOBS) == []
        assert all(materialized(instance, asset, job_id) == [] for asset in PER_SHARD + PER_JOB)
        assert instance.get_runs() == []


def test_a_job_prepared_again_with_fewer_shards_keeps_only_those_keys(tmp_path: Path) -> None:
    with local_instance(set_dagster_home=True) as instance:
        register_job(instance, "j", 5)
        register_job(instance, "other", 2)
        register_job(instance, "j", 3)
        assert instance.get_dynamic_partitions(SHARDS) == [*shard_keys("j", 3), *shard_keys("other", 2)]
        register_job(instance, "j", 1200)  # more than one chunk of keys at a time
        assert shard_keys_on(instance, "j") == shard_keys("j", 1200)


@pytest.mark.slow
def test_a_job_whose_shards_have_no_keys_is_run_by_the_cli_and_by_the_driver(tmp_path: Path) -> None:
    """What an instance from before shards had keys holds: the job's key and its work folder."""
    rows = [chat_row(f"m{i}", f"question {i}") for i in range(9)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    storage_root = tmp_path / "work"
    with local_instance(set_dagster_home=True) as instance:
        storage = StorageResource(work_root=str(storage_root))
        deployment = Deployment(build_definitions(storage, fake_engine()), instance)
        config = {"input": str(src), "output": str(tmp_path / "ui.jsonl"), "options": {"shards": 3}}
        deployment.submit("ui-old", config)
        for key in shard_keys("ui-old", 3):  # as if prepared before the upgrade
            instance.delete_dynamic_partition(SHARDS, key)
        assert deployment.drive() == [
            ["estimate_job:ui-old"],
            [f"shard_job:{job_shard_key('ui-old', s)}" for s in range(3)],
            ["finish_job:ui-old"],
        ]
        assert shard_keys_on(instance, "ui-old") == shard_keys("ui-old", 3)
        assert [r["custom_id"] for r in read_jsonl(tmp_path / "ui.jsonl")] == [f"m{i}" for i in range(9)]

        runner = JobRunner(instance, storage, fake_engine())
        job = runner.submit(str(src), str(tmp_path / "cli.jsonl"), {"shards": 2})
        for key in shard_keys(job.job_id, 2):
            instance.delete_dynamic_partition(SHARDS, key)
        report = runner.run(job)
        runner.close()
        assert report.status == "completed"
        assert shard_keys_on(instance, job.job_id) == shard_keys(job.job_id, 2)


@pytest.mark.engine
def test_real_engine_job_with_four_shards_has_four_keys(tmp_path: Path, real_runner: JobRunner) -> None:
    rows = [chat_row(f"e{i}", f"Name a colour, number {i}.") for i in range(8)]
    out = tmp_path / "out.jsonl"
    report = run_job(real_runner, write_jsonl(tmp_path / "in.jsonl", rows), out, {"shards": 4, "max_tokens": 6})
    assert report.status == "completed" and report.request_counts.completed == 8
    assert [line["custom_id"] for line in read_jsonl(out)] == [f"e{i}" for i in range(8)]
    instance = real_runner.instance
    assert shard_keys_on(instance, report.job_id) == shard_keys(report.job_id, 4)
    assert materialized(instance, "generations", report.job_id) == sorted(shard_keys(report.job_id, 4))
    assert materialized(instance, "merged_result", report.job_id) == [report.job_id]


@pytest.mark.slow
def test_three_thousand_shards_get_their_keys_and_the_driver_asks_for_each_once(tmp_path: Path) -> None:
    """Thousands of shards: prepared, keyed and requested by the driver in one tick (not run)."""
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"t{i}", f"q{i}") for i in range(3000)])
    with local_instance(set_dagster_home=True) as instance:
        storage = StorageResource(work_root=str(tmp_path / "work"))
        deployment = Deployment(build_definitions(storage, fake_engine()), instance)
        config = {"input": str(src), "output": str(tmp_path / "out.jsonl"), "options": {"shard_rows": 1}}
        deployment.submit("wide", config)
        assert shard_keys_on(instance, "wide") == shard_keys("wide", 3000)
        estimate = deployment.tick("job_driver").run_requests
        assert [r.job_name for r in estimate] == ["estimate_job"]
        deployment.execute(estimate[0])
        shards = deployment.tick("job_driver").run_requests
        assert [r.partition_key for r in shards] == shard_keys("wide", 3000)
        assert len({r.run_key for r in shards}) == 3000


ASSET_PARTITIONS = """
query ($path: [String!]!) {
  assetNodeOrError(assetKey: {path: $path}) {
    ... on AssetNode {
      partitionKeysByDimension { partitionKeys }
      partitionStats { numMaterialized numPartitions }
    }
  }
}
"""


@pytest.mark.daemon
def test_the_ui_shows_exactly_the_shards_a_job_has(tmp_path: Path) -> None:
    """Through a real webserver: a 3-shard job submitted from the launchpad shows 3 partitions of
    each per-shard asset and 1 of each job-level asset, with nothing counted missing beyond them."""
    with serving(tmp_path, REPO / "workspace.yaml") as ws:
        location = ws.graphql(LOCATION_QUERY)["workspaceOrError"]["locationEntries"][0]
        selector = {
            "repositoryLocationName": location["name"],
            "repositoryName": location["locationOrLoadError"]["repositories"][0]["name"],
        }
        src = write_jsonl(ws.files / "in.jsonl", [chat_row(f"u{i}", f"question {i}") for i in range(7)])
        ws.graphql(ADD_PARTITION, selector=selector, key="ui-three")
        client = DagsterGraphQLClient("127.0.0.1", port_number=ws.port)
        config = {"input": str(src), "output": str(ws.files / "out.jsonl"), "options": {"shards": 3}}
        run_id = client.submit_job_execution(
            "submit_job",
            run_config={"ops": {"validated_input": {"config": config}}},
            tags={"dagster/partition": "ui-three"},
        )
        assert wait_for_run(client, run_id) == "SUCCESS", step_errors(ws, run_id)

        def partitions(asset: str) -> tuple[list[str], dict[str, int]]:
            node = ws.graphql(ASSET_PARTITIONS, path=[asset])["assetNodeOrError"]
            return node["partitionKeysByDimension"][0]["partitionKeys"], node["partitionStats"]

        for asset in PER_SHARD:
            assert partitions(asset) == (shard_keys("ui-three", 3), {"numMaterialized": 0, "numPartitions": 3})
        assert partitions("validated_input") == (["ui-three"], {"numMaterialized": 1, "numPartitions": 1})
        assert partitions("merged_result") == (["ui-three"], {"numMaterialized": 0, "numPartitions": 1})
