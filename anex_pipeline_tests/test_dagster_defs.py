"""The Dagster layer: the code location loads, and materializing a job's partitions straight from
Dagster (as the UI or a backfill does) gives the same result file as the CLI's runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    keys = {k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys()}
    assert keys == {
        "validated_input",
        "fetched_media",
        "length_estimate",
        "generations",
        "merged_result",
        "result_file",
    }
    assert {j.name for j in defs.jobs or []} >= {"submit_job", "estimate_job", "shard_job", "finish_job"}


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
