"""The Dagster layer: the code location loads, and materializing a job's partitions straight from
Dagster (as the UI or a backfill does) gives the same result file as the CLI's runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from anex_pipeline.orchestration.definitions import build_definitions, defs
from anex_pipeline.orchestration.partitions import JOBS, job_shard_key
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.testing import fake_engine
from anex_pipeline_tests.harness.jobs import REPO, chat_row, local_instance, write_jsonl


@pytest.mark.subprocess
def test_workspace_loads_in_dagster(tmp_path: Path) -> None:
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "dagster", "definitions", "validate", "-w", str(REPO / "workspace.yaml")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_definitions_hold_every_stage() -> None:
    loaded = defs()
    keys = {k.to_user_string() for k in loaded.resolve_asset_graph().get_all_asset_keys()}
    assert keys == {
        "validated_input",
        "fetched_media",
        "length_estimate",
        "generations",
        "merged_result",
        "result_file",
    }
    assert {j.name for j in loaded.jobs or []} >= {"submit_job", "estimate_job", "shard_job", "finish_job"}


def test_importing_the_code_location_reads_no_setting(tmp_path: Path) -> None:
    """A setting Dagster could not take fails when the definitions load, not when the module is
    imported: the import builds nothing."""
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path), "ANEX_DRIVER_INTERVAL_S": "soon"}
    code = (
        "from anex_pipeline.orchestration import definitions\n"
        "try:\n    definitions.defs()\nexcept ValueError:\n    print('refused at load')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "refused at load"


def test_settings_are_read_when_the_definitions_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ANEX_DRIVER_INTERVAL_S", "17")
    monkeypatch.setenv("ANEX_RETRY_CRON", "5 * * * *")
    monkeypatch.setenv("ANEX_RETENTION_CRON", "0 4 * * *")
    monkeypatch.setenv("ANEX_RETRY_LIMIT", "7")
    monkeypatch.setenv("ANEX_S3_BUCKET", "inbox-bucket")
    monkeypatch.setenv("ANEX_WORK_DIR", str(tmp_path / "work"))
    loaded = defs()
    assert loaded.resolve_sensor_def("job_driver").minimum_interval_seconds == 17
    assert loaded.resolve_schedule_def("retry_failed_rows").cron_schedule == "5 * * * *"
    assert loaded.resolve_schedule_def("prune_old_jobs").cron_schedule == "0 4 * * *"
    # The resource fields the environment sets are Dagster environment variables, resolved when
    # a run or tick starts; the others keep their defaults.
    s3 = loaded.resources["s3_inbox_settings"]
    assert isinstance(s3.bucket, dg.EnvVar) and s3.bucket.env_var_name == "ANEX_S3_BUCKET"
    assert s3.output_prefix == "results/"
    monkeypatch.setenv("ANEX_RETRY_LIMIT", "8")
    monkeypatch.setenv("ANEX_WORK_DIR", str(tmp_path / "later"))
    resources = {name: loaded.resources[name] for name in ("retry_settings", "storage")}
    with dg.build_resources(resources) as built:
        assert built.retry_settings.max_attempts == 8
        assert built.storage.work_root == str(tmp_path / "later")


@pytest.mark.slow
def test_materializing_partitions_from_dagster_equals_the_cli_result(tmp_path: Path) -> None:
    rows = [chat_row(f"d{i}", f"question {i}", max_tokens=12) for i in range(30)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)

    with local_instance() as instance:
        runner = JobRunner(instance, StorageResource(work_root=str(tmp_path / "w1")), fake_engine())
        runner.run(runner.submit(str(src), str(tmp_path / "cli.jsonl"), {"shards": 3}))

    storage = StorageResource(work_root=str(tmp_path / "w2"))
    d = build_definitions(storage, fake_engine())
    with local_instance() as instance:
        instance.add_dynamic_partitions(JOBS, ["ui-job"])
        submit = {
            "ops": {
                "validated_input": {
                    "config": {"input": str(src), "output": str(tmp_path / "ui.jsonl"), "options": {"shards": 3}}
                }
            }
        }
        assert (
            d.resolve_job_def("submit_job")
            .execute_in_process(instance=instance, partition_key="ui-job", run_config=submit)
            .success
        )
        assert d.resolve_job_def("estimate_job").execute_in_process(instance=instance, partition_key="ui-job").success
        for shard in range(3):
            key = job_shard_key("ui-job", shard)
            assert d.resolve_job_def("shard_job").execute_in_process(instance=instance, partition_key=key).success
        finish = d.resolve_job_def("finish_job").execute_in_process(instance=instance, partition_key="ui-job")
        assert finish.success
        checks = finish.get_asset_check_evaluations()
        assert checks and all(c.passed for c in checks)
        mats = finish.asset_materializations_for_node("result_file")
        assert mats[0].metadata["status"].value == "completed"

    def answers(path: Path) -> list[str]:
        import json

        return [json.dumps(json.loads(line)["response"]["body"]["choices"]) for line in path.read_text().splitlines()]

    assert answers(tmp_path / "ui.jsonl") == answers(tmp_path / "cli.jsonl")
