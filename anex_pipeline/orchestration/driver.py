"""``job_driver``: the sensor that moves every submitted job through its steps without the command
line: the length estimate after the submit, every shard after the estimate, the merge and publish
after the last shard. It leaves alone a job that an ``anex-pipeline`` process is driving (one that
holds the job's lease). Off until started in the UI (Automation) or with ``dagster sensor start``.
"""

# No "from __future__ import annotations" here: Dagster reads the sensors' resource annotations.

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg

from anex_pipeline import settings
from anex_pipeline.orchestration.names import FINISH_JOB, SHARD_JOB
from anex_pipeline.orchestration.partitions import CHUNK, shard_partitions
from anex_pipeline.orchestration.plan import Step, next_steps
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.orchestration.runs import job_progress, job_state, shard_failures
from anex_pipeline.workdir.lease import lease_held
from anex_pipeline.workdir.manifest import JobDir

if TYPE_CHECKING:
    from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition


@lru_cache(maxsize=1 << 16)  # more than the jobs one instance keeps (docs/scale.md): a tick reads each once
def _shard_count(work_root: str, job_id: str, submitted: int) -> int | None:
    """Shards the job uses; ``submitted`` is in the cache key because a resubmission may change it."""
    job = JobDir(Path(work_root).expanduser(), job_id)
    return len(job.manifest().shards) if job.exists() else None


def run_request(step: Step) -> dg.RunRequest:
    return dg.RunRequest(
        job_name=step.job_name, partition_key=step.partition_key, run_key=step.run_key, tags=dict(step.tags)
    )


def job_driver(jobs: "Sequence[UnresolvedAssetJobDefinition]") -> dg.SensorDefinition:
    """The sensor, ticking every ANEX_DRIVER_INTERVAL_S seconds as it is when the definitions load;
    ``jobs``: the estimate, shard and finish jobs it asks runs of."""
    return dg.sensor(
        name="job_driver",
        jobs=list(jobs),
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
        state = job_state(p, count, {})
        if state.estimated >= state.submitted and state.pending_shards():
            state = job_state(p, count, shard_failures(context.instance, p.job_id, count))
        steps = next_steps(state)
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
        failed = state.given_up()
        if steps[0].job_name == FINISH_JOB and failed and not job.stop_path.exists():
            job.record_stop("; ".join(f"shard {s}: {f.reason}" for s, f in failed.items()))
        requests.extend(map(run_request, steps))
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
    keys = [str(r.partition_key) for r in requests if r.job_name == SHARD_JOB]
    adds = [shard_partitions.build_add_request(keys[n : n + CHUNK]) for n in range(0, len(keys), CHUNK)]
    return dg.SensorResult(run_requests=requests, dynamic_partitions_requests=adds)
