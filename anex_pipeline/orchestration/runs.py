"""Where each job stands, read from the Dagster instance: its runs, the latest materialization per
partition, and why a shard's last run failed. The driver, the retry schedule, the runner and
retention all read the instance through here."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from anex_pipeline.orchestration.names import (
    CARRIED_RUN,
    CLI_RUN,
    GENERATIONS,
    LAUNCHED_BY_TAG,
    LENGTH_ESTIMATE,
    PARTITION_TAG,
    RESULT_FILE,
    SHARD_JOB,
    VALIDATED_INPUT,
)
from anex_pipeline.orchestration.partitions import CHUNK, job_of_key, shard_keys, split_shard_key
from anex_pipeline.orchestration.plan import JobState, ShardFailure

IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]


@dataclass
class JobProgress:
    """Storage ids of the latest materialization of each step of one job (0 = never; larger = later)."""

    job_id: str
    submitted: int
    estimated: int = 0
    shards: dict[int, int] = field(default_factory=dict)
    finished: int = 0
    busy: bool = False  # a run for this job is queued or running (not counting CLI runs)
    leased_runs: list[str] = field(default_factory=list)  # ids of its runs held by a lease, not marked ended


def job_progress(instance: dg.DagsterInstance) -> list[JobProgress]:
    """Every submitted job with the state of its steps: a few indexed queries, no row data."""

    def latest(key: dg.AssetKey) -> Mapping[str, int]:
        return instance.get_latest_storage_id_by_partition(key, dg.DagsterEventType.ASSET_MATERIALIZATION)

    jobs = {job_id: JobProgress(job_id, sid) for job_id, sid in latest(VALIDATED_INPUT).items()}
    for job_id, sid in latest(LENGTH_ESTIMATE).items():
        if job_id in jobs:
            jobs[job_id].estimated = sid
    for job_id, sid in latest(RESULT_FILE).items():
        if job_id in jobs:
            jobs[job_id].finished = sid
    for key, sid in latest(GENERATIONS).items():
        job_id, shard = split_shard_key(key)
        if job_id in jobs:
            jobs[job_id].shards[shard] = sid
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=IN_FLIGHT)):
        job_id = job_of_run(run)
        if job_id not in jobs:
            continue
        if held_by_lease(run):
            jobs[job_id].leased_runs.append(run.run_id)
        else:
            jobs[job_id].busy = True
    return list(jobs.values())


def job_state(progress: JobProgress, shard_count: int, failures: Mapping[int, ShardFailure]) -> JobState:
    """What :func:`~anex_pipeline.orchestration.plan.next_steps` needs of a job the instance knows."""
    p = progress
    return JobState(p.job_id, p.submitted, shard_count, p.estimated, dict(p.shards), p.finished, failures)


def held_by_lease(run: dg.DagsterRun) -> bool:
    """Whether a run is live only while its process holds its job's lease: its process executes
    it in-process, and a process that dies leaves it "started" in the instance for good."""
    return run.tags.get(LAUNCHED_BY_TAG) in (CLI_RUN, CARRIED_RUN)


def job_of_run(run: dg.DagsterRun) -> str | None:
    """The job a run works on, from its partition key (a shard's key starts with its job's)."""
    key = run.tags.get(PARTITION_TAG)
    return job_of_key(key) if key else None


def runs_of_partitions(
    instance: dg.DagsterInstance, keys: Sequence[str], job_name: str | None = None, statuses: Sequence[Any] = ()
) -> list[dg.DagsterRun]:
    """The runs of any of these partition keys, newest first (asked in chunks: a job may have
    thousands of shards)."""
    return [r.dagster_run for r in _run_records_of_partitions(instance, keys, job_name, statuses)]


def _run_records_of_partitions(
    instance: dg.DagsterInstance, keys: Sequence[str], job_name: str | None, statuses: Sequence[Any]
) -> list[dg.RunRecord]:
    records = []
    for n in range(0, len(keys), CHUNK):
        tags = {PARTITION_TAG: list(keys[n : n + CHUNK])}
        records += instance.get_run_records(dg.RunsFilter(job_name=job_name, statuses=list(statuses), tags=tags))
    return sorted(records, key=lambda r: r.create_timestamp, reverse=True)


def runs_of_job(instance: dg.DagsterInstance, job_id: str, shard_count: int) -> list[dg.DagsterRun]:
    """Every run of one job: its job-level steps and its shards."""
    return runs_of_partitions(instance, [job_id, *shard_keys(job_id, shard_count)])


def shard_failures(instance: dg.DagsterInstance, job_id: str, shard_count: int) -> dict[int, ShardFailure]:
    """The latest failed ``shard_job`` run of each shard of a job; its step retries are spent."""
    records = _run_records_of_partitions(
        instance, shard_keys(job_id, shard_count), SHARD_JOB, [dg.DagsterRunStatus.FAILURE]
    )
    latest: dict[int, dg.RunRecord] = {}
    for record in records:  # newest first
        latest.setdefault(split_shard_key(record.dagster_run.tags[PARTITION_TAG])[1], record)
    ended = _run_failure_ids(instance, latest.values())
    failures: dict[int, ShardFailure] = {}
    for shard, record in latest.items():
        run_id = record.dagster_run.run_id
        events = instance.get_records_for_run(
            run_id, of_type={dg.DagsterEventType.STEP_FAILURE, dg.DagsterEventType.RUN_FAILURE}
        ).records
        if run_id in ended and events:
            failures[shard] = ShardFailure(ended[run_id], _failure_reason(events))
    return failures


def _run_failure_ids(instance: dg.DagsterInstance, records: Collection[dg.RunRecord]) -> dict[str, int]:
    """The storage id of each of these failed runs' RUN_FAILURE event, as the instance's index
    numbers it. A run's own events are numbered apart on SQLite (one database per run), so those
    ids cannot be set against a materialization's; the index holds both run ends and
    materializations, and numbers them in one sequence (on PostgreSQL all events are in one table)."""
    wanted = {r.dagster_run.run_id for r in records}
    if not wanted:
        return {}
    since = min(r.create_timestamp for r in records).timestamp()
    event_filter = dg.RunStatusChangeRecordsFilter(
        event_type=dg.DagsterEventType.RUN_FAILURE, job_names=[SHARD_JOB], after_timestamp=since - 1
    )
    found: dict[str, int] = {}
    cursor = None
    while True:
        page = instance.fetch_run_status_changes(event_filter, limit=1000, cursor=cursor, ascending=True)
        found |= {r.run_id: r.storage_id for r in page.records if r.run_id in wanted}
        if not page.has_more:
            return found
        cursor = page.cursor


def _failure_reason(records: Sequence[dg.EventLogRecord]) -> str:
    """The step's own error when there is one (not Dagster's wrapper around it), else the run's."""
    for record in records:
        event = record.event_log_entry.dagster_event
        if event and event.is_step_failure and event.step_failure_data.error:
            return step_error_message(event.step_failure_data.error)
    event = records[-1].event_log_entry.dagster_event
    return event.message if event and event.message else "the run failed"


def first_step_error(result: dg.ExecuteInProcessResult) -> Any:
    """The error of the first step that failed in an in-process run, or None."""
    for event in result.all_events:
        if event.is_step_failure and event.step_failure_data and event.step_failure_data.error:
            return event.step_failure_data.error
    return None


def step_error_message(error: Any) -> str:
    """The first error in a chain that is not Dagster's own wrapper: a step error
    (``dagster._core.errors...``) or, once a step's retries are spent, "Exceeded max_retries".
    An error of this package, or a ``dg.Failure`` a step raised, is told by its message alone: its
    messages are written for users."""
    while error.cause is not None and (
        error.message.startswith("dagster.") or error.cls_name == "RetryRequestedFromPolicy"
    ):
        error = error.cause
    message = error.message.strip()
    own = re.match(
        rf"(anex_pipeline(\.\w+)*|dagster\._core\.definitions\.events)\.{re.escape(error.cls_name or '')}: ", message
    )
    return message[own.end() :] if own else message
