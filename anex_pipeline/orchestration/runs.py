"""Where each job stands, read from the Dagster instance: its runs, the latest materialization per
partition, and why a shard's last run failed. The driver, the retry schedule, the runner and
retention all read the instance through here."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from anex_pipeline.orchestration.assets import generations, length_estimate, result_file, validated_input
from anex_pipeline.orchestration.jobs import shard_job
from anex_pipeline.orchestration.partitions import job_shard_partitions

IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]


PARTITION_TAG = "dagster/partition"


JOB_DIMENSION_TAG = "dagster/partition/job"


SHARD_DIMENSION_TAG = "dagster/partition/shard"


LAUNCHED_BY_TAG = "anex/launched_by"  # "cli" on the runs of `anex-pipeline run` and `backfill`


RETRY_TAG = "anex/retry_of_submission"  # on retry runs: the storage id of the submission they retry


@dataclass
class JobProgress:
    """Storage ids of the latest materialization of each step of one job (0 = never; larger = later)."""

    job_id: str
    submitted: int
    estimated: int = 0
    shards: dict[int, int] = field(default_factory=dict)
    finished: int = 0
    busy: bool = False  # a run for this job is queued or running (not counting CLI runs)
    cli_runs: list[str] = field(default_factory=list)  # ids of CLI runs of this job not marked ended


def job_progress(instance: dg.DagsterInstance) -> list[JobProgress]:
    """Every submitted job with the state of its steps: a few indexed queries, no row data."""

    def latest(asset: dg.AssetsDefinition) -> Mapping[str, int]:
        return instance.get_latest_storage_id_by_partition(asset.key, dg.DagsterEventType.ASSET_MATERIALIZATION)

    jobs = {job_id: JobProgress(job_id, sid) for job_id, sid in latest(validated_input).items()}
    for job_id, sid in latest(length_estimate).items():
        if job_id in jobs:
            jobs[job_id].estimated = sid
    for job_id, sid in latest(result_file).items():
        if job_id in jobs:
            jobs[job_id].finished = sid
    for key, sid in latest(generations).items():
        dims = job_shard_partitions.get_partition_key_from_str(key).keys_by_dimension
        if dims["job"] in jobs:
            jobs[dims["job"]].shards[int(dims["shard"])] = sid
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=IN_FLIGHT)):
        job_id = job_of_run(run)
        if job_id not in jobs:
            continue
        if run.tags.get(LAUNCHED_BY_TAG) == "cli":  # live only while its process holds the lease
            jobs[job_id].cli_runs.append(run.run_id)
        else:
            jobs[job_id].busy = True
    return list(jobs.values())


def job_of_run(run: dg.DagsterRun) -> str | None:
    """The job a run works on, from its partition tags (a shard run names it in its job dimension)."""
    return run.tags.get(JOB_DIMENSION_TAG, run.tags.get(PARTITION_TAG))


def runs_of_job(instance: dg.DagsterInstance, job_id: str) -> list[dg.DagsterRun]:
    """Every run of one job: its job-level steps and its shards."""
    runs = {}
    for tags in ({PARTITION_TAG: job_id}, {JOB_DIMENSION_TAG: job_id}):
        runs.update({run.run_id: run for run in instance.get_runs(filters=dg.RunsFilter(tags=tags))})
    return list(runs.values())


@dataclass(frozen=True)
class ShardFailure:
    """The last failed run of a shard: when it failed (a storage id) and why."""

    storage_id: int
    reason: str


def shard_failures(instance: dg.DagsterInstance, job_id: str) -> dict[int, ShardFailure]:
    """The latest failed ``shard_job`` run of each shard of a job; its step retries are spent."""
    runs = instance.get_runs(
        filters=dg.RunsFilter(
            job_name=shard_job.name, statuses=[dg.DagsterRunStatus.FAILURE], tags={JOB_DIMENSION_TAG: job_id}
        )
    )
    failures: dict[int, ShardFailure] = {}
    for run in runs:  # newest first
        shard = int(run.tags.get(SHARD_DIMENSION_TAG, "-1"))
        if shard < 0 or shard in failures:
            continue
        records = instance.get_records_for_run(
            run.run_id, of_type={dg.DagsterEventType.STEP_FAILURE, dg.DagsterEventType.RUN_FAILURE}
        ).records
        if records:
            failures[shard] = ShardFailure(records[-1].storage_id, _failure_reason(records))
    return failures


def _failure_reason(records: Sequence[dg.EventLogRecord]) -> str:
    """The step's own error when there is one (not Dagster's wrapper around it), else the run's."""
    for record in records:
        event = record.event_log_entry.dagster_event
        if event and event.is_step_failure and event.step_failure_data.error:
            return step_error_message(event.step_failure_data.error)
    event = records[-1].event_log_entry.dagster_event
    return event.message if event and event.message else "the run failed"


def step_error_message(error: Any) -> str:
    """The first error in a chain that is not Dagster's own wrapper: a step error
    (``dagster._core.errors...``) or, once a step's retries are spent, "Exceeded max_retries".
    An error of this package is told by its message alone: its messages are written for users."""
    while error.cause is not None and (
        error.message.startswith("dagster.") or error.cls_name == "RetryRequestedFromPolicy"
    ):
        error = error.cause
    message = error.message.strip()
    own = re.match(rf"anex_pipeline(\.\w+)*\.{re.escape(error.cls_name or '')}: ", message)
    return message[own.end() :] if own else message
