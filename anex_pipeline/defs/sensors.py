"""Sensors and a schedule that start and drive jobs without the command line.

- ``job_driver`` moves every submitted job through its steps: the length estimate after the
  submit, every shard after the estimate, the merge and publish after the last shard.
- ``s3_inbox`` turns each new object under a bucket/prefix into a job; ``local_inbox`` does the
  same for a folder. Results go to an output prefix (or an outbox folder).
- ``retry_failed_rows`` (a schedule) reruns the shards of finished jobs that have failed rows,
  a limited number of times per shard.

All are off until started in the UI (Automation) or with ``dagster sensor start`` /
``dagster schedule start``. The inbox sensors only submit; ``job_driver`` does the rest, except
for a job that an ``anex-pipeline`` process is driving (it holds the job's lease file).
"""

# No "from __future__ import annotations" here: Dagster reads the sensors' resource annotations.

import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import IO, Any

import dagster as dg
from dagster_aws.s3 import S3Resource
from dagster_aws.s3.sensor import get_objects
from pydantic import Field

from anex_pipeline.defs.assets import generations, length_estimate, result_file, validated_input
from anex_pipeline.defs.jobs import estimate_job, finish_job, shard_job, submit_job
from anex_pipeline.defs.partitions import (
    CHUNK,
    JOBS,
    job_of_key,
    job_partitions,
    job_shard_key,
    shard_keys,
    shard_partitions,
    split_shard_key,
)
from anex_pipeline.defs.resources import StorageResource
from anex_pipeline.jobs import JobDir, make_job_id, unfinished_shards
from anex_pipeline.spec import JobReport
from anex_pipeline.storage import read_regular_file, unsafe_key

INPUT_SUFFIXES = (".jsonl", ".parquet")
SIDECAR_SUFFIX = ".job.json"
IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]
PARTITION_TAG = "dagster/partition"
LAUNCHED_BY_TAG = "anex/launched_by"  # "cli" on the runs of `anex-pipeline run` and `backfill`
RETRY_TAG = "anex/retry_of_submission"  # on retry runs: the storage id of the submission they retry
LEASE_NAME = "cli.lock"

progress_log = logging.getLogger("anex_pipeline.progress")


# ---------------------------------------------------------------------------------------------
# Who drives a job: an anex-pipeline process holds the job's lease while it runs the job's steps


def _lock(lease: IO[bytes], mode: int) -> bool:
    try:
        fcntl.flock(lease, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def take_lease(job: JobDir) -> IO[bytes]:
    """Marks the job as driven by this process until the returned file is closed.

    The mark is a kernel lock on ``<job>/cli.lock``: it goes away with the process however the
    process ends, so a crashed command never leaves the job blocked. A second process driving the
    same job waits here for the first.
    """
    job.root.mkdir(parents=True, exist_ok=True)
    lease = (job.root / LEASE_NAME).open("ab")
    if not _lock(lease, fcntl.LOCK_EX):
        time.sleep(0.2)  # job_driver only looks at the lock for a moment
        if not _lock(lease, fcntl.LOCK_EX):
            progress_log.warning("job %s is being run by another process; waiting for it to end", job.job_id)
            fcntl.flock(lease, fcntl.LOCK_EX)
    return lease


def try_lease(job: JobDir) -> IO[bytes] | None:
    """The job's lease if no live process holds it (kept until the returned file is closed), else None."""
    job.root.mkdir(parents=True, exist_ok=True)
    lease = (job.root / LEASE_NAME).open("ab")
    if _lock(lease, fcntl.LOCK_EX):
        return lease
    lease.close()
    return None


def driven_by_cli(job: JobDir) -> bool:
    """True while a live process holds the job's lease (a lease file left by a dead one is free)."""
    try:
        lease = (job.root / LEASE_NAME).open("rb")
    except FileNotFoundError:
        return False
    with lease:
        return not _lock(lease, fcntl.LOCK_SH)  # closing the file lets go of the lock at once


# ---------------------------------------------------------------------------------------------
# Where each job stands, from the instance's latest materialization per partition


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
        job_id, shard = split_shard_key(key)
        if job_id in jobs:
            jobs[job_id].shards[shard] = sid
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
    """The job a run works on, from its partition key (a shard's key starts with its job's)."""
    key = run.tags.get(PARTITION_TAG)
    return job_of_key(key) if key else None


def runs_of_partitions(
    instance: dg.DagsterInstance, keys: Sequence[str], job_name: str | None = None, statuses: Sequence[Any] = ()
) -> list[dg.DagsterRun]:
    """The runs of any of these partition keys, newest first (asked in chunks: a job may have
    thousands of shards)."""
    records = []
    for n in range(0, len(keys), CHUNK):
        tags = {PARTITION_TAG: list(keys[n : n + CHUNK])}
        records += instance.get_run_records(dg.RunsFilter(job_name=job_name, statuses=list(statuses), tags=tags))
    return [r.dagster_run for r in sorted(records, key=lambda r: r.create_timestamp, reverse=True)]


def runs_of_job(instance: dg.DagsterInstance, job_id: str, shard_count: int) -> list[dg.DagsterRun]:
    """Every run of one job: its job-level steps and its shards."""
    return runs_of_partitions(instance, [job_id, *shard_keys(job_id, shard_count)])


@dataclass(frozen=True)
class ShardFailure:
    """The last failed run of a shard: when it failed (a storage id) and why."""

    storage_id: int
    reason: str


def shard_failures(instance: dg.DagsterInstance, job_id: str, shard_count: int) -> dict[int, ShardFailure]:
    """The latest failed ``shard_job`` run of each shard of a job; its step retries are spent."""
    runs = runs_of_partitions(
        instance, shard_keys(job_id, shard_count), job_name=shard_job.name, statuses=[dg.DagsterRunStatus.FAILURE]
    )
    failures: dict[int, ShardFailure] = {}
    for run in runs:  # newest first
        shard = split_shard_key(run.tags[PARTITION_TAG])[1]
        if shard in failures:
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


@lru_cache(maxsize=1 << 16)  # more than the jobs one instance keeps (docs/scale.md): a tick reads each once
def _shard_count(work_root: str, job_id: str, submitted: int) -> int | None:
    """Shards the job uses; ``submitted`` is in the cache key because a resubmission may change it."""
    job = JobDir(Path(work_root).expanduser(), job_id)
    return len(job.manifest().shards) if job.exists() else None


def pending_shards(p: JobProgress, shard_count: int) -> list[int]:
    """Shards not materialized since the job's latest estimate."""
    return [s for s in range(shard_count) if p.shards.get(s, 0) < p.estimated]


def given_up(p: JobProgress, shard_count: int, failures: Mapping[int, ShardFailure]) -> dict[int, ShardFailure]:
    """Pending shards whose latest run failed after the estimate: the job finishes without them."""
    return {
        s: failures[s] for s in pending_shards(p, shard_count) if s in failures and failures[s].storage_id > p.estimated
    }


def next_steps(p: JobProgress, shard_count: int, failures: Mapping[int, ShardFailure]) -> list[dg.RunRequest]:
    """The runs that move a job on: each is keyed by the event it follows, so it is requested once
    per submission (and once more only after its input changed). A shard whose run failed for good
    is not requested again: the job is merged and published without its rows (rerun the shard,
    e.g. from the partitions view, and the job is published again)."""
    if p.estimated < p.submitted:
        return [
            dg.RunRequest(
                job_name=estimate_job.name, partition_key=p.job_id, run_key=f"estimate:{p.job_id}:{p.submitted}"
            )
        ]
    failed = given_up(p, shard_count, failures)
    waiting = [s for s in pending_shards(p, shard_count) if s not in failed]
    if waiting:
        return [
            dg.RunRequest(
                job_name=shard_job.name,
                partition_key=job_shard_key(p.job_id, s),
                run_key=f"shard:{p.job_id}:{s}:{p.estimated}",
            )
            for s in waiting
        ]
    last = max(failed[s].storage_id if s in failed else p.shards[s] for s in range(shard_count))
    if p.finished < last:
        tags = {"anex/failed_shards": ",".join(map(str, failed))} if failed else {}
        return [
            dg.RunRequest(
                job_name=finish_job.name, partition_key=p.job_id, run_key=f"finish:{p.job_id}:{last}", tags=tags
            )
        ]
    return []


@dg.sensor(
    name="job_driver",
    jobs=[estimate_job, shard_job, finish_job],
    minimum_interval_seconds=10,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description=(
        "Moves every submitted job on: estimate after submit, each shard after the estimate, merge and "
        "publish after the last shard. Start it to run jobs launched from the UI or an inbox sensor."
    ),
)
def job_driver(context: dg.SensorEvaluationContext, storage: StorageResource) -> dg.SensorResult | dg.SkipReason:
    requests: list[dg.RunRequest] = []
    unknown, by_cli = [], []
    for p in job_progress(context.instance):
        if p.busy:
            continue
        count = _shard_count(storage.work_root, p.job_id, p.submitted)
        if count is None:
            unknown.append(p.job_id)
            continue
        job = storage.job(p.job_id)
        pending = p.estimated >= p.submitted and pending_shards(p, count)
        failures = shard_failures(context.instance, p.job_id, count) if pending else {}
        steps = next_steps(p, count, failures)
        if not steps and not (p.finished and job.stop_path.exists()):
            continue
        if driven_by_cli(job):
            by_cli.append(p.job_id)
            continue
        if p.cli_runs:
            context.log.warning(
                f"job {p.job_id}: run(s) {', '.join(p.cli_runs)} of an anex-pipeline process that has ended "
                "are not running any more; the driver carries on"
            )
        if not steps:
            # The job is published and its report keeps the reason it stopped: later reruns of its
            # shards (the retry schedule, the partitions view) must not stop on that reason.
            job.stop_path.unlink(missing_ok=True)
            continue
        failed = given_up(p, count, failures)
        if steps[0].job_name == finish_job.name and failed and not job.stop_path.exists():
            job.record_stop("; ".join(f"shard {s}: {f.reason}" for s, f in failed.items()))
        requests.extend(steps)
    if unknown:
        context.log.warning(
            f"{len(unknown)} submitted job(s) have no work folder under {storage.work_root} and are left alone "
            f"(e.g. {unknown[0]}); they were submitted with another work_root"
        )
    if not requests:
        held = f"; {len(by_cli)} job(s) are being run by anex-pipeline (e.g. {by_cli[0]})" if by_cli else ""
        return dg.SkipReason(f"nothing to start: every job is finished or running{held}")
    # A job prepared before its shards had keys of their own gets them with its shard runs (the
    # instance adds only the keys it lacks).
    keys = [str(r.partition_key) for r in requests if r.job_name == shard_job.name]
    adds = [shard_partitions.build_add_request(keys[n : n + CHUNK]) for n in range(0, len(keys), CHUNK)]
    return dg.SensorResult(run_requests=requests, dynamic_partitions_requests=adds)


# ---------------------------------------------------------------------------------------------
# Inboxes: new files become jobs


@dataclass(frozen=True)
class Arrival:
    """An input file found in an inbox."""

    name: str  # path below the watched prefix or folder, e.g. "team/batch.jsonl"
    arrived: float  # seconds since the epoch: S3 LastModified, or the file's ctime
    version: str  # S3 ETag, or the file's mtime and size: a change makes a new job
    uri: str  # what validated_input reads
    output: str  # where the result file goes (the report goes beside it)
    refused: str | None = None  # why the file is not taken, told once in the sensor's log

    @property
    def job_id(self) -> str:
        return make_job_id(Path(self.name), self.version, self.output, {})


def results_name(name: str) -> str:
    """``team/batch.jsonl`` -> ``team/batch.results.jsonl``."""
    path = PurePosixPath(name)
    return str(path.with_name(f"{path.stem}.results{path.suffix}"))


def is_input_name(name: str) -> bool:
    base = PurePosixPath(name).name
    return not base.startswith(".") and base.lower().endswith(INPUT_SUFFIXES)


def options_from_json(text: str, where: str) -> dict[str, Any]:
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc}); write job options as one JSON object") from None
    if not isinstance(options, dict):
        raise ValueError(f"{where} holds a JSON {type(options).__name__}; job options must be one JSON object")
    return options


def submit_request(arrival: Arrival, options: dict[str, Any]) -> dg.RunRequest:
    config = {"input": arrival.uri, "output": arrival.output, "options": options}
    return dg.RunRequest(
        job_name=submit_job.name,
        partition_key=arrival.job_id,
        run_key=arrival.job_id,
        run_config={"ops": {validated_input.key.to_user_string(): {"config": config}}},
        tags={"anex/source": arrival.uri},
    )


class InboxSettings(dg.ConfigurableResource):
    """What the inbox sensors share: default job options and how much they take per tick."""

    options: str = Field(
        default_factory=lambda: os.environ.get("ANEX_INBOX_OPTIONS", "{}"),
        description="Default job options as a JSON object; a sidecar <input>.job.json overrides them key by key.",
    )
    page_limit: int = Field(default=50, ge=1, description="At most this many new jobs per tick; the rest wait.")
    lookback_seconds: float = Field(
        default=900.0,
        ge=0,
        description="Files that arrived up to this long before the newest one taken are checked again "
        "(S3 timestamps are per second and a multipart upload is stamped when it starts).",
    )


def take_new(
    context: dg.SensorEvaluationContext,
    arrivals: Iterable[Arrival],
    settings: InboxSettings,
    read_sidecar: Callable[[Arrival], str | None],
    where: str,
) -> dg.SensorResult | dg.SkipReason:
    """Requests a job for each arrival that is not a job yet, oldest first, at most page_limit.

    A job's id is made from the file's name and version, and a file is a job once its partition
    exists, so a file is taken exactly once however the ticks fall; the cursor (the arrival time
    of the newest file taken) only narrows which files are looked at again.
    """
    defaults = options_from_json(settings.options, "the sensor's default options")
    cursor = json.loads(context.cursor) if context.cursor else {}
    since = cursor.get("since", 0.0)
    window = sorted(
        (a for a in arrivals if a.arrived >= since - settings.lookback_seconds), key=lambda a: (a.arrived, a.name)
    )
    told = set(cursor.get("refused", []))
    refused = []  # refused files still in the window, each told once (and remembered while it is)
    for arrival in (a for a in window if a.refused):
        mark = hashlib.sha256(f"{arrival.uri}\0{arrival.version}".encode("utf-8", "surrogatepass")).hexdigest()[:16]
        if mark not in told:
            context.log.warning(f"{arrival.uri} is not taken: {arrival.refused}")
        refused.append(mark)
    requests = []
    for arrival in (a for a in window if not a.refused):
        if len(requests) == settings.page_limit:
            break
        if context.instance.has_dynamic_partition(JOBS, arrival.job_id):
            continue
        try:
            sidecar = read_sidecar(arrival)
            options = {**defaults, **(options_from_json(sidecar, arrival.uri + SIDECAR_SUFFIX) if sidecar else {})}
        except ValueError as exc:  # also a sidecar that is not UTF-8 or not a regular file
            context.log.error(f"{arrival.uri} is not submitted: {exc}. Fix the sidecar, then upload the input again.")
            continue
        requests.append(submit_request(arrival, options))
        since = max(since, arrival.arrived)
    new_cursor = json.dumps({"since": since, **({"refused": refused} if refused else {})})
    if not requests:
        skip = f"no new input files in {where}"
        return dg.SensorResult(skip_reason=skip, cursor=new_cursor) if set(refused) != told else dg.SkipReason(skip)
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[job_partitions.build_add_request([r.partition_key for r in requests])],
        cursor=new_cursor,
    )


class S3InboxSettings(InboxSettings):
    """The bucket and prefix the S3 sensor watches, and where results go in the same bucket."""

    bucket: str = Field(
        default_factory=lambda: os.environ.get("ANEX_S3_BUCKET", ""), description="Bucket to watch (required)."
    )
    prefix: str = Field(
        default_factory=lambda: os.environ.get("ANEX_S3_PREFIX", ""),
        description="Only keys under this prefix are inputs; empty = the whole bucket.",
    )
    output_prefix: str = Field(
        default_factory=lambda: os.environ.get("ANEX_S3_OUTPUT_PREFIX", "results/"),
        description="Results go to s3://<bucket>/<output_prefix>/<name>.results.<ext>; keys under it are never inputs.",
    )

    def output_root(self) -> str:
        root = self.output_prefix.strip("/")
        if not root:
            raise ValueError("set output_prefix (ANEX_S3_OUTPUT_PREFIX): results must not land among the inputs")
        return root + "/"


def bucket_arrivals(objects: Iterable[Mapping[str, Any]], settings: S3InboxSettings) -> Iterator[Arrival]:
    """The input objects of a bucket listing. Each result key is made from its input's key alone,
    one to one: a key whose name below the prefix has an empty, '.' or '..' segment (which a path
    would fold into another key's name) is refused, as is one whose result key would be unsafe."""
    output_root = settings.output_root()
    for obj in objects:
        key = obj["Key"]
        if key.startswith(output_root) or not is_input_name(key):
            continue
        name = key[len(settings.prefix) :]
        if settings.prefix and not settings.prefix.endswith("/"):
            name = name.removeprefix("/")  # the prefix names a folder: one separator after it
        result_key = f"{output_root}{results_name(name)}"
        refused = None
        if any(part in ("", ".", "..") for part in name.split("/")):
            refused = (
                f"its name below the prefix {settings.prefix!r} has an empty, '.' or '..' path segment, so its "
                "result could overwrite another file's; upload it under a plain name"
            )
        elif (why := unsafe_key(result_key)) is not None:  # found now, not after the whole job ran
            refused = f"its result key {result_key[:300]!r} {why}; upload it under a shorter, plain name"
        yield Arrival(
            name=name,
            arrived=obj["LastModified"].timestamp(),
            version=obj["ETag"].strip('"'),
            uri=f"s3://{settings.bucket}/{key}",
            output=f"s3://{settings.bucket}/{result_key}",
            refused=refused,
        )


@dg.sensor(
    name="s3_inbox",
    job=submit_job,
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description=(
        "Each new object (JSONL or Parquet) under the configured bucket/prefix becomes a job, with options "
        "from a sidecar <key>.job.json; results go under the output prefix. Needs job_driver running."
    ),
)
def s3_inbox(
    context: dg.SensorEvaluationContext, s3: S3Resource, s3_inbox_settings: S3InboxSettings
) -> dg.SensorResult | dg.SkipReason:
    settings = s3_inbox_settings
    if not settings.bucket:
        return dg.SkipReason("no bucket is configured: set ANEX_S3_BUCKET (or the s3_inbox_settings resource)")
    client = s3.get_client()
    objects = get_objects(settings.bucket, settings.prefix, client=client)
    keys = {obj["Key"] for obj in objects}

    def read_sidecar(arrival: Arrival) -> str | None:
        key = arrival.uri.removeprefix(f"s3://{settings.bucket}/") + SIDECAR_SUFFIX
        if key not in keys:
            return None
        return client.get_object(Bucket=settings.bucket, Key=key)["Body"].read().decode("utf-8")

    where = f"s3://{settings.bucket}/{settings.prefix}"
    return take_new(context, bucket_arrivals(objects, settings), settings, read_sidecar, where)


class LocalInboxSettings(InboxSettings):
    """The folder the local sensor watches and the folder results go to."""

    folder: str = Field(
        default_factory=lambda: os.environ.get("ANEX_INBOX_DIR", ""),
        description="Folder to watch (with its subfolders); empty = 'inbox' beside the storage work_root.",
    )
    outbox: str = Field(
        default_factory=lambda: os.environ.get("ANEX_OUTBOX_DIR", ""),
        description="Results go to <outbox>/<name>.results.<ext>; empty = 'outbox' beside the storage work_root.",
    )
    settle_seconds: float = Field(
        default=5.0, ge=0, description="A file is taken once it has not changed for this long (copies in progress)."
    )
    lookback_seconds: float = Field(default=60.0, ge=0, description="As for S3; file ctimes are precise.")

    def folders(self, storage: StorageResource) -> tuple[Path, Path]:
        beside = Path(storage.work_root).expanduser().resolve().parent
        inbox = Path(self.folder).expanduser().resolve() if self.folder else beside / "inbox"
        outbox = Path(self.outbox).expanduser().resolve() if self.outbox else beside / "outbox"
        if inbox == outbox:
            raise ValueError(f"the inbox and the outbox are both {inbox}: results would become new jobs")
        return inbox, outbox


def folder_arrivals(inbox: Path, outbox: Path, settle_seconds: float) -> Iterator[Arrival]:
    now = time.time()
    for dirpath, dirnames, filenames in os.walk(inbox):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and here / d != outbox]
        for filename in filenames:
            path = here / filename
            if not is_input_name(filename):
                continue
            try:
                st = path.stat()
            except FileNotFoundError:  # moved away while we looked
                continue
            # ctime changes on every write and on a rename into the inbox, and cannot be set back.
            if now - st.st_ctime < settle_seconds:
                continue
            name = path.relative_to(inbox).as_posix()
            yield Arrival(
                name=name,
                arrived=st.st_ctime,
                version=f"{st.st_mtime_ns}-{st.st_size}",
                uri=str(path),
                output=str(outbox / results_name(name)),
            )


@dg.sensor(
    name="local_inbox",
    job=submit_job,
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description=(
        "Each new JSONL or Parquet file in the inbox folder becomes a job, with options from a sidecar "
        "<file>.job.json; results go to the outbox folder. Needs job_driver running."
    ),
)
def local_inbox(
    context: dg.SensorEvaluationContext, storage: StorageResource, local_inbox_settings: LocalInboxSettings
) -> dg.SensorResult | dg.SkipReason:
    settings = local_inbox_settings
    inbox, outbox = settings.folders(storage)
    inbox.mkdir(parents=True, exist_ok=True)

    def read_sidecar(arrival: Arrival) -> str | None:
        sidecar = Path(arrival.uri + SIDECAR_SUFFIX)
        return read_regular_file(sidecar).decode("utf-8") if sidecar.exists() else None

    return take_new(
        context, folder_arrivals(inbox, outbox, settings.settle_seconds), settings, read_sidecar, str(inbox)
    )


# ---------------------------------------------------------------------------------------------
# Periodic retries


class RetrySettings(dg.ConfigurableResource):
    """How often the retry schedule reruns one shard of one job."""

    max_attempts: int = Field(
        default_factory=lambda: int(os.environ.get("ANEX_RETRY_LIMIT", "3")),
        ge=0,
        description="Reruns per shard and submission; a shard still failing after them is left as it is "
        "(its failed rows stay in the report). Counted from the runs the schedule started.",
    )


def retry_attempts(instance: dg.DagsterInstance, p: JobProgress, shard: int) -> int:
    """Retry runs the schedule has started for this shard since the job's latest submission."""
    tags = {PARTITION_TAG: str(job_shard_key(p.job_id, shard)), RETRY_TAG: str(p.submitted)}
    return instance.get_runs_count(dg.RunsFilter(job_name=shard_job.name, tags=tags))


@dg.schedule(
    name="retry_failed_rows",
    job=shard_job,
    cron_schedule=os.environ.get("ANEX_RETRY_CRON", "0 * * * *"),
    default_status=dg.DefaultScheduleStatus.STOPPED,
    description=(
        "Reruns the shards of finished jobs that have failed or missing rows, up to max_attempts times per "
        "shard (ANEX_RETRY_LIMIT, default 3); a rerun generates only those rows. job_driver then publishes "
        "the new result. Hourly by default (ANEX_RETRY_CRON)."
    ),
)
def retry_failed_rows(
    context: dg.ScheduleEvaluationContext, storage: StorageResource, retry_settings: RetrySettings
) -> list[dg.RunRequest] | dg.SkipReason:
    requests = []
    spent = []
    for p in job_progress(context.instance):
        job = storage.job(p.job_id)
        report = job.root / "report.json"
        if p.busy or not p.finished or not report.exists():
            continue
        counts = JobReport.model_validate_json(report.read_text()).request_counts
        if counts.completed >= counts.total or driven_by_cli(job):
            continue
        for shard in unfinished_shards(job):
            attempt = retry_attempts(context.instance, p, shard) + 1
            if attempt > retry_settings.max_attempts:
                spent.append(f"{p.job_id} shard {shard}")
                continue
            requests.append(
                dg.RunRequest(
                    partition_key=job_shard_key(p.job_id, shard),
                    run_key=f"retry:{p.job_id}:{shard}:{p.submitted}:{attempt}",
                    tags={RETRY_TAG: str(p.submitted)},
                )
            )
    if spent:
        context.log.info(
            f"not retried again, {retry_settings.max_attempts} attempts used: {', '.join(spent)} "
            "(raise ANEX_RETRY_LIMIT, or rerun the shard by hand)"
        )
    return requests or dg.SkipReason("no finished job has failed or missing rows left to retry")


all_sensors = [job_driver, s3_inbox, local_inbox]
all_schedules = [retry_failed_rows]
