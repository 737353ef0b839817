"""A schedule that prunes old jobs and expired Batch API files, as ``anex-pipeline prune`` does."""

# No "from __future__ import annotations" here: Dagster reads the op's resource annotations.

from pathlib import Path

import dagster as dg
from pydantic import Field

from anex_pipeline import settings
from anex_pipeline.orchestration.job_admin import parse_age, prune
from anex_pipeline.orchestration.ray_executor import OTHER_STEP, prune_finished_steps
from anex_pipeline.orchestration.resources import StorageResource, from_environment


class RetentionSettings(dg.ConfigurableResource):
    """How long a job's work is kept after its last activity."""

    max_age: str = Field(
        default=settings.RETENTION_MAX_AGE.default,
        description="Jobs not active for longer than this are removed (work folder and Dagster history; "
        "results stay), e.g. 7d, 12h.",
    )

    @classmethod
    def from_environment(cls) -> "RetentionSettings":
        """The settings the environment gives (ANEX_RETENTION_MAX_AGE), as ``dg.EnvVar``."""
        return cls(**from_environment(cls, {"max_age": settings.RETENTION_MAX_AGE}))


@dg.op(
    description="Removes jobs older than the retention age (never a running one) and expired Batch API files.",
    tags=OTHER_STEP,  # its resources under ANEX_EXECUTOR=ray
)
def prune_jobs(context: dg.OpExecutionContext, storage: StorageResource, retention_settings: RetentionSettings) -> None:
    try:
        older_than = parse_age(retention_settings.max_age)
    except ValueError as exc:
        raise dg.Failure(f"retention_settings.max_age (ANEX_RETENTION_MAX_AGE): {exc}") from None
    work_root = Path(storage.work_root).expanduser()
    removed = prune(context.instance, work_root, older_than, on_skip=lambda s: context.log.warning(str(s)))
    for r in removed:
        context.log.info(f"removed {r.kind} {r.id}: {r.reason}")
    if not removed:
        context.log.info(f"nothing to remove: no job is older than {retention_settings.max_age}, no file has expired")
    if settings.EXECUTOR.get() == "ray" and settings.RAY_ADDRESS.get():
        steps = prune_finished_steps(settings.RAY_ADDRESS.get(), older_than)
        context.log.info(f"deleted {len(steps)} finished step(s) from the Ray head's job table")


@dg.job(description="Prunes old jobs and expired Batch API files once.")
def prune_job() -> None:
    prune_jobs()


def prune_old_jobs() -> dg.ScheduleDefinition:
    """The schedule, on the cron of ANEX_RETENTION_CRON as it is when the definitions load."""
    return dg.ScheduleDefinition(
        name="prune_old_jobs",
        job=prune_job,
        cron_schedule=settings.RETENTION_CRON.get(),
        default_status=dg.DefaultScheduleStatus.STOPPED,
        description=(
            "Removes jobs not active for longer than max_age (ANEX_RETENTION_MAX_AGE, default 30d) that are not "
            "running, with their Dagster runs and partition keys, the Batch API's expired files and, under "
            "ANEX_EXECUTOR=ray, the steps' finished Ray jobs of that age; result files stay. Daily by default "
            "(ANEX_RETENTION_CRON)."
        ),
    )
