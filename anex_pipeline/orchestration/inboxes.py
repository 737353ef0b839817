"""Inbox sensors that turn arriving files into jobs.

``local_inbox`` turns each new file of a folder into a job; ``s3_inbox`` (its own module, which
imports ``dagster_aws``) does the same for the objects under a bucket/prefix, with the arrivals and
settings this module holds. Results go to an output prefix (or an outbox folder). They only submit: the driver
does the rest. Both are off until started in the UI (Automation) or with ``dagster sensor start``."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import dagster as dg
from pydantic import Field

from anex_pipeline import settings
from anex_pipeline.formats.registry import FORMATS
from anex_pipeline.options import (
    SIDECAR_SUFFIX,
    OptionsError,
    options_from_json,
    read_text_file,
    sidecar_of,
)
from anex_pipeline.orchestration.names import SUBMIT_JOB, VALIDATED_INPUT
from anex_pipeline.orchestration.partitions import JOBS, job_partitions
from anex_pipeline.orchestration.resources import StorageResource, from_environment
from anex_pipeline.storage import unsafe_key
from anex_pipeline.workdir.manifest import make_job_id

INPUT_SUFFIXES = tuple(f.suffix for f in FORMATS.values())


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


def submit_request(arrival: Arrival, options: dict[str, Any]) -> dg.RunRequest:
    config = {"input": arrival.uri, "output": arrival.output, "options": options}
    return dg.RunRequest(
        job_name=SUBMIT_JOB,
        partition_key=arrival.job_id,
        run_key=arrival.job_id,
        run_config={"ops": {VALIDATED_INPUT.to_user_string(): {"config": config}}},
        tags={"anex/source": arrival.uri},
    )


class InboxSettings(dg.ConfigurableResource):
    """What the inbox sensors share: default job options and how much they take per tick."""

    options: str = Field(
        default=settings.INBOX_OPTIONS.default,
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
    read_sidecar: Callable[[Arrival], str | bytes | None],
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
        except OptionsError as exc:  # not JSON, not an object, not UTF-8, not a regular file
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

    bucket: str = Field(default=settings.S3_BUCKET.default, description="Bucket to watch (required).")
    prefix: str = Field(
        default=settings.S3_PREFIX.default,
        description="Only keys under this prefix are inputs; empty = the whole bucket.",
    )
    output_prefix: str = Field(
        default=settings.S3_OUTPUT_PREFIX.default,
        description="Results go to s3://<bucket>/<output_prefix>/<name>.results.<ext>; keys under it are never inputs.",
    )

    @classmethod
    def from_environment(cls) -> S3InboxSettings:
        """The settings the environment gives (ANEX_INBOX_OPTIONS, ANEX_S3_*), as ``dg.EnvVar``."""
        variables = {
            "options": settings.INBOX_OPTIONS,
            "bucket": settings.S3_BUCKET,
            "prefix": settings.S3_PREFIX,
            "output_prefix": settings.S3_OUTPUT_PREFIX,
        }
        return cls(**from_environment(cls, variables))

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


class LocalInboxSettings(InboxSettings):
    """The folder the local sensor watches and the folder results go to."""

    folder: str = Field(
        default=settings.INBOX_DIR.default,
        description="Folder to watch (with its subfolders); empty = 'inbox' beside the storage work_root.",
    )
    outbox: str = Field(
        default=settings.OUTBOX_DIR.default,
        description="Results go to <outbox>/<name>.results.<ext>; empty = 'outbox' beside the storage work_root.",
    )
    settle_seconds: float = Field(
        default=5.0, ge=0, description="A file is taken once it has not changed for this long (copies in progress)."
    )
    lookback_seconds: float = Field(default=60.0, ge=0, description="As for S3; file ctimes are precise.")

    @classmethod
    def from_environment(cls) -> LocalInboxSettings:
        """The settings the environment gives (ANEX_INBOX_OPTIONS, ANEX_INBOX_DIR, ANEX_OUTBOX_DIR)."""
        variables = {"options": settings.INBOX_OPTIONS, "folder": settings.INBOX_DIR, "outbox": settings.OUTBOX_DIR}
        return cls(**from_environment(cls, variables))

    def folders(self, storage: StorageResource) -> tuple[Path, Path]:
        beside = Path(storage.work_root).expanduser().resolve().parent
        inbox = Path(self.folder).expanduser().resolve() if self.folder else beside / "inbox"
        outbox = Path(self.outbox).expanduser().resolve() if self.outbox else beside / "outbox"
        if inbox == outbox:
            raise ValueError(f"the inbox and the outbox are both {inbox}: results would become new jobs")
        return inbox, outbox


MAX_SETTLE_WAIT_S = 10.0  # the longest a tick waits for new files to settle (Dagster gives a tick 60 s)


def folder_arrivals(
    inbox: Path, outbox: Path, settle_seconds: float, wait: Callable[[float], None] = time.sleep
) -> Iterator[Arrival]:
    """The input files of the inbox that have not changed for ``settle_seconds`` (a copy in
    progress is left for later). A file that arrived too recently is waited for in this tick, when
    its settle time ends within MAX_SETTLE_WAIT_S, and taken if it did not change meanwhile: the
    sensor's next tick comes 5 s or more later."""
    settling = []
    for path, st in _input_files(inbox, outbox):
        # ctime changes on every write and on a rename into the inbox, and cannot be set back.
        if time.time() - st.st_ctime >= settle_seconds:
            yield _arrival(inbox, outbox, path, st)
        else:
            settling.append((path, st))
    left = max((st.st_ctime + settle_seconds - time.time() for _, st in settling), default=0.0)
    if not settling or left > MAX_SETTLE_WAIT_S:
        return
    wait(max(left, 0.0))
    for path, st in settling:
        try:
            now = path.stat()
        except FileNotFoundError:
            continue
        if now.st_ctime == st.st_ctime and time.time() - now.st_ctime >= settle_seconds:
            yield _arrival(inbox, outbox, path, now)


def _input_files(inbox: Path, outbox: Path) -> Iterator[tuple[Path, os.stat_result]]:
    for dirpath, dirnames, filenames in os.walk(inbox):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and here / d != outbox]
        for filename in filenames:
            path = here / filename
            if not is_input_name(filename):
                continue
            try:
                yield path, path.stat()
            except FileNotFoundError:  # moved away while we looked
                continue


def _arrival(inbox: Path, outbox: Path, path: Path, st: os.stat_result) -> Arrival:
    name = path.relative_to(inbox).as_posix()
    return Arrival(
        name=name,
        arrived=st.st_ctime,
        version=f"{st.st_mtime_ns}-{st.st_size}",
        uri=str(path),
        output=str(outbox / results_name(name)),
    )


@dg.sensor(
    name="local_inbox",
    job_name=SUBMIT_JOB,
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description=(
        "Each new JSONL or Parquet file in the inbox folder becomes a job, with options from a sidecar "
        "<file>.job.json; results go to the outbox folder. Needs job_driver running (a one-shard job "
        "runs all its steps in its submit run)."
    ),
)
def local_inbox(
    context: dg.SensorEvaluationContext, storage: StorageResource, local_inbox_settings: LocalInboxSettings
) -> dg.SensorResult | dg.SkipReason:
    settings = local_inbox_settings
    inbox, outbox = settings.folders(storage)
    inbox.mkdir(parents=True, exist_ok=True)

    def read_sidecar(arrival: Arrival) -> str | None:
        sidecar = sidecar_of(arrival.uri)
        return read_text_file(sidecar, "sidecar") if sidecar.exists() else None

    return take_new(
        context, folder_arrivals(inbox, outbox, settings.settle_seconds), settings, read_sidecar, str(inbox)
    )
