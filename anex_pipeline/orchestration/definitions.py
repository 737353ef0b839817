"""The Dagster definitions that `dagster dev` loads through workspace.yaml.

``defs`` is lazy (``@dg.definitions``): importing this module builds no resource and reads no
environment variable; Dagster calls it when it loads the code location, and the resources whose
fields the environment sets get them as ``dg.EnvVar``."""

from __future__ import annotations

import dagster as dg

from anex_pipeline import settings
from anex_pipeline.orchestration import inboxes
from anex_pipeline.orchestration.assets import all_assets
from anex_pipeline.orchestration.carry_on import carry_on
from anex_pipeline.orchestration.driver import job_driver
from anex_pipeline.orchestration.inboxes import LocalInboxSettings, S3InboxSettings
from anex_pipeline.orchestration.jobs import asset_jobs
from anex_pipeline.orchestration.prune_schedule import RetentionSettings, prune_job, prune_old_jobs
from anex_pipeline.orchestration.resources import EngineResource, StorageResource
from anex_pipeline.orchestration.retries import RetrySettings, retry_failed_rows


def build_definitions(
    storage: StorageResource | None = None,
    engine: EngineResource | None = None,
    *,
    automation: bool = True,
    s3_inbox: S3InboxSettings | None = None,
    local_inbox: LocalInboxSettings | None = None,
    retry: RetrySettings | None = None,
    retention: RetentionSettings | None = None,
) -> dg.Definitions:
    """Everything a code location holds; the sensors' S3 client talks to the storage's endpoint.

    ``automation=False`` leaves out the sensors and schedules (and the inboxes' resources):
    the command's runner drives its jobs itself, and so starts without importing ``dagster_aws``."""
    storage = storage or StorageResource.from_environment()
    resources: dict[str, object] = {
        "storage": storage,
        "engine": engine or EngineResource(),
        "retry_settings": retry or RetrySettings.from_environment(),
        "retention_settings": retention or RetentionSettings.from_environment(),
    }
    jobs = asset_jobs(
        submit_hooks=[carry_on(lambda storage, engine: build_definitions(storage, engine, automation=False))]
    )
    sensors: list[dg.SensorDefinition] = []
    schedules: list[dg.ScheduleDefinition] = []
    if automation:
        from anex_pipeline.orchestration import s3_inbox as s3

        sensors = [job_driver(jobs[1:]), s3.s3_inbox, inboxes.local_inbox]
        schedules = [retry_failed_rows(), prune_old_jobs()]
        resources |= {
            "s3": s3.s3_resource(storage),
            "s3_inbox_settings": s3_inbox or S3InboxSettings.from_environment(),
            "local_inbox_settings": local_inbox or LocalInboxSettings.from_environment(),
        }
    return dg.Definitions(
        executor=_executor(),
        assets=all_assets,
        jobs=[*jobs, prune_job],
        sensors=sensors,
        schedules=schedules,
        resources=resources,
    )


def _executor() -> dg.ExecutorDefinition | None:
    """Every step of a run in the run's own process by default: a job's runs have one or two
    steps each, which follow one another, and the engine lives in the machine's shared model
    server rather than in a step, so a process per step would only add its start (seconds each).
    ``ANEX_EXECUTOR=multiprocess`` gives each step a process of its own again; ``ANEX_EXECUTOR=k8s``
    runs each step in its own Kubernetes pod (see deploy/README.md), ``ANEX_EXECUTOR=ray`` as a
    Ray job on the cluster at ``ANEX_RAY_ADDRESS`` (see docs/scale.md)."""
    choice = settings.EXECUTOR.get()
    if choice == "multiprocess":
        return dg.multiprocess_executor
    if choice == "ray":
        from anex_pipeline.orchestration.ray_executor import ray_executor

        return ray_executor
    if choice != "k8s":
        return dg.in_process_executor
    from dagster_k8s import k8s_job_executor

    return k8s_job_executor


@dg.definitions
def defs() -> dg.Definitions:
    """The code location of workspace.yaml, built when Dagster loads it."""
    return build_definitions()
