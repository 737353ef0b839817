"""No Dagster run that does nothing: an estimate that needs no sample is recorded by the submit
step, and a run of the command does not start runs for shards that have nothing left to do.
The runs are counted on a real on-disk instance."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg

from anex_pipeline.orchestration.assets import length_estimate
from anex_pipeline.orchestration.names import PARTITION_TAG
from anex_pipeline.orchestration.runs import job_progress
from anex_pipeline.runner import JobRunner
from anex_pipeline.testing import shared_fake_engine
from anex_pipeline_tests.harness.jobs import chat_row, read_jsonl, write_jsonl


def run_names(instance: dg.DagsterInstance) -> list[str]:
    """Every run of the instance, oldest first, as ``job_name:partition``."""
    runs = sorted(instance.get_run_records(), key=lambda r: r.create_timestamp)
    return [f"{r.dagster_run.job_name}:{r.dagster_run.tags.get(PARTITION_TAG)}" for r in runs]


def test_rows_that_set_their_own_max_tokens_make_no_estimate_run(
    tmp_path: Path, instance: dg.DagsterInstance, fake_runner: JobRunner
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"q {i}", max_tokens=8) for i in range(6)])
    job = fake_runner.submit(str(src), str(tmp_path / "out.jsonl"), {"shards": 2})
    report = fake_runner.run(job)

    assert report.status == "completed" and len(read_jsonl(tmp_path / "out.jsonl")) == 6
    assert report.estimate.method == "not needed: every row sets its own max_tokens"
    key = job.job_id
    shards = [f"shard_job:{key}|00", f"shard_job:{key}|01"]
    assert run_names(instance) == [f"submit_job:{key}", *shards, f"finish_job:{key}"]
    # The estimate is in all the same: the asset has a materialization, made by the submit run.
    latest = instance.get_latest_materialization_event(length_estimate.key)
    runs = {r.dagster_run.run_id: r.dagster_run.job_name for r in instance.get_run_records()}
    assert latest is not None and runs[latest.run_id] == "submit_job"
    (progress,) = job_progress(instance)
    assert progress.estimated > progress.submitted


def test_a_job_that_needs_a_sample_still_makes_its_estimate_run(
    tmp_path: Path, instance: dg.DagsterInstance, fake_runner: JobRunner
) -> None:
    rows = [chat_row(f"s{i}", f"q {i}") for i in range(5)] + [chat_row("capped", "q", max_tokens=4)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    job = fake_runner.submit(str(src), str(tmp_path / "out.jsonl"), {})
    report = fake_runner.run(job)

    assert report.estimate.sample_size == 5
    assert [n.split(":")[0] for n in run_names(instance)] == ["submit_job", "estimate_job", "shard_job", "finish_job"]


def test_a_rerun_of_a_finished_job_starts_no_estimate_or_shard_run(
    tmp_path: Path, instance: dg.DagsterInstance, fake_runner: JobRunner
) -> None:
    """The job's estimate came from a sample the first time; the second run reuses it and every
    shard is finished, so only the submit and the publish run again, and nothing is generated."""
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"t{i}", f"q {i}") for i in range(4)])
    out = tmp_path / "out.jsonl"
    first = fake_runner.run(fake_runner.submit(str(src), str(out), {"shards": 2}))
    assert first.status == "completed"
    before = len(run_names(instance))
    engine = shared_fake_engine("HuggingFaceTB/SmolLM2-135M-Instruct")
    generated = len(engine.seen)

    again = fake_runner.run(fake_runner.submit(str(src), str(out), {"shards": 2}))
    assert again.status == "completed" and len(engine.seen) == generated
    assert [n.split(":")[0] for n in run_names(instance)[before:]] == ["submit_job", "finish_job"]


def test_a_backfill_of_one_shard_starts_no_estimate_run(
    tmp_path: Path, instance: dg.DagsterInstance, fake_runner: JobRunner
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"b{i}", f"q {i}") for i in range(6)])
    job = fake_runner.submit(str(src), str(tmp_path / "out.jsonl"), {"shards": 3})
    fake_runner.run(job, shards=[0])
    assert json.loads(job.estimate_path.read_text())["sample_size"] == 6
    before = len(run_names(instance))

    report = fake_runner.run(job, shards=[1, 2])
    assert report.status == "completed"
    key = job.job_id
    assert run_names(instance)[before:] == [f"shard_job:{key}|01", f"shard_job:{key}|02", f"finish_job:{key}"]
