"""``job_driver``: the sensor that moves every submitted job through its steps without the command
line: the length estimate after the submit, every shard after the estimate, the merge and publish
after the last shard. It leaves alone a job that an ``anex-pipeline`` process is driving (one that
holds the job's lease). Off until started in the UI (Automation) or with ``dagster sensor start``.
"""

# No "from __future__ import annotations" here: Dagster reads the sensors' resource annotations.

from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

import dagster as dg

from anex_pipeline import settings
from anex_pipeline.orchestration.jobs import estimate_job, finish_job, shard_job
from anex_pipeline.orchestration.partitions import CHUNK, job_shard_key, shard_partitions
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.orchestration.runs import JobProgress, ShardFailure, job_progress, shard_failures
from anex_pipeline.workdir.lease import lease_held
from anex_pipeline.workdir.manifest import JobDir


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


def job_driver() -> dg.SensorDefinition:
    """The sensor, ticking every ANEX_DRIVER_INTERVAL_S seconds as it is when the definitions load."""
    return dg.sensor(
        name="job_driver",
        jobs=[estimate_job, shard_job, finish_job],
        minimum_interval_seconds=settings.DRIVER_INTERVAL_S.get_int(),
        default_status=dg.DefaultSensorStatus.STOPPED,
        description=(
            "Moves every submitted job on: estimate after submit, each shard after the estimate, merge and "
            "publish after the last shard. Start it to run jobs launched from the UI or an inbox sensor."
        ),
    )(drive_jobs)


def drive_jobs(context: dg.SensorEvaluationContext, storage: StorageResource) -> dg.SensorResult | dg.SkipReason:
    requests: list[dg.RunRequest] = []
    unknown, held = [], []
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
        if lease_held(job):
            held.append(p.job_id)
            continue
        if p.leased_runs:
            context.log.warning(
                f"job {p.job_id}: run(s) {', '.join(p.leased_runs)} of a process that has ended (anex-pipeline, "
                "or a submit run carrying its job on) are not running any more; the driver carries on"
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
        busy = f"; {len(held)} job(s) are run by anex-pipeline or their submit run (e.g. {held[0]})" if held else ""
        return dg.SkipReason(f"nothing to start: every job is finished or running{busy}")
    # A job prepared before its shards had keys of their own gets them with its shard runs (the
    # instance adds only the keys it lacks).
    keys = [str(r.partition_key) for r in requests if r.job_name == shard_job.name]
    adds = [shard_partitions.build_add_request(keys[n : n + CHUNK]) for n in range(0, len(keys), CHUNK)]
    return dg.SensorResult(run_requests=requests, dynamic_partitions_requests=adds)
