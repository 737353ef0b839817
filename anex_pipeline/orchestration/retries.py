"""``retry_failed_rows``, a schedule that reruns the shards of finished jobs that have failed rows, a
limited number of times per shard. Off until started in the UI or with ``dagster schedule start``."""

from __future__ import annotations

import dagster as dg
from pydantic import Field

from anex_pipeline import settings
from anex_pipeline.orchestration.names import PARTITION_TAG, RETRY_TAG, SHARD_JOB
from anex_pipeline.orchestration.partitions import job_shard_key
from anex_pipeline.orchestration.resources import StorageResource, from_environment
from anex_pipeline.orchestration.runs import JobProgress, job_progress
from anex_pipeline.workdir.lease import lease_held
from anex_pipeline.workdir.manifest import unfinished_shards


class RetrySettings(dg.ConfigurableResource):
    """How often the retry schedule reruns one shard of one job."""

    max_attempts: int = Field(
        default=int(settings.RETRY_LIMIT.default),
        ge=0,
        description="Reruns per shard and submission; a shard still failing after them is left as it is "
        "(its failed rows stay in the report). Counted from the runs the schedule started.",
    )

    @classmethod
    def from_environment(cls) -> RetrySettings:
        """The settings the environment gives (ANEX_RETRY_LIMIT), as ``dg.EnvVar``."""
        return cls(**from_environment(cls, {"max_attempts": settings.RETRY_LIMIT}))


def retry_attempts(instance: dg.DagsterInstance, p: JobProgress, shard: int) -> int:
    """Retry runs the schedule has started for this shard since the job's latest submission."""
    tags = {PARTITION_TAG: str(job_shard_key(p.job_id, shard)), RETRY_TAG: str(p.submitted)}
    return instance.get_runs_count(dg.RunsFilter(job_name=SHARD_JOB, tags=tags))


def retry_failed_rows() -> dg.ScheduleDefinition:
    """The schedule, on the cron of ANEX_RETRY_CRON as it is when the definitions load."""
    return dg.schedule(
        name="retry_failed_rows",
        job_name=SHARD_JOB,
        cron_schedule=settings.RETRY_CRON.get(),
        default_status=dg.DefaultScheduleStatus.STOPPED,
        description=(
            "Reruns the shards of finished jobs that have failed or missing rows, up to max_attempts times per "
            "shard (ANEX_RETRY_LIMIT, default 3); a rerun generates only those rows. job_driver then publishes "
            "the new result. Hourly by default (ANEX_RETRY_CRON)."
        ),
    )(retry_requests)


def retry_requests(
    context: dg.ScheduleEvaluationContext, storage: StorageResource, retry_settings: RetrySettings
) -> list[dg.RunRequest] | dg.SkipReason:
    requests = []
    spent = []
    for p in job_progress(context.instance):
        job = storage.job(p.job_id)
        report = None if p.busy or not p.finished else job.report()
        if report is None:
            continue
        counts = report.request_counts
        if counts.completed >= counts.total or lease_held(job):
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
