"""Small jobs carried through by their submit run.

A job launched from Dagster (the UI, an inbox sensor) moves on through ``job_driver``: each
later step is a run of its own, which the run queue starts in a new process after the driver's
next tick. For a one-shard job that is two ticks and three process starts, seconds each, on a job
whose rows take seconds. So once the submit step of a job of at most ``ANEX_CARRY_ON_SHARDS``
shards has succeeded (its materialization is stored), its run goes on in its own process: it runs
the steps the driver would ask for (the estimate, the shard, the merge and publish), each as a
Dagster run of its own in the instance, as ``anex-pipeline run`` does. It holds the job's lease
meanwhile, so the driver leaves the job alone, and takes it over if the process dies. A step
that fails ends the carrying: the driver then does what it does for any failed step.

Only with the in-process executor (the default): under ``ANEX_EXECUTOR=multiprocess``, ``k8s`` or
``ray`` each step belongs in a process, pod or Ray job of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dagster as dg

from anex_pipeline import settings
from anex_pipeline.orchestration.in_process import drive
from anex_pipeline.orchestration.names import CARRIED_RUN, LAUNCHED_BY_TAG, PARTITION_TAG
from anex_pipeline.orchestration.partitions import job_of_key
from anex_pipeline.orchestration.plan import JobState, Step
from anex_pipeline.orchestration.runs import (
    first_step_error,
    job_progress,
    job_state,
    shard_failures,
    step_error_message,
)
from anex_pipeline.workdir.lease import try_lease


def carry_on(carried_definitions: Callable[[Any, Any], dg.Definitions]) -> dg.HookDefinition:
    """The success hook of ``submit_job``: runs the job's later steps when it is small enough.
    ``carried_definitions(storage, engine)`` builds, from the run's own resources, the definitions
    whose jobs run them (it is called only when a job is carried)."""

    @dg.success_hook(name="carry_on", required_resource_keys={"storage", "engine"})
    def hook(context: dg.HookContext) -> None:
        run = context.instance.get_run_by_id(context.run_id)
        if run is None or run.tags.get(LAUNCHED_BY_TAG) or settings.EXECUTOR.get():
            return  # a process that drives the job itself, or steps that belong elsewhere
        try:
            limit = settings.CARRY_ON_SHARDS.get_int()
        except ValueError:
            context.log.error(
                f"{settings.CARRY_ON_SHARDS.name}={settings.CARRY_ON_SHARDS.get()!r} is not a whole number of "
                "shards; the job's other steps wait for job_driver (set it to 1, the default, or 0 to turn this off)"
            )
            return
        if limit < 1:
            return
        storage, engine = context.resources.storage, context.resources.engine
        job = storage.job(job_of_key(run.tags[PARTITION_TAG]))
        count = len(job.manifest().shards)
        if count > limit:
            return
        lease = try_lease(job)
        if lease is None:
            context.log.info(f"job {job.job_id} is being run by another process; it carries the job on")
            return
        with lease:
            _carry(context, job.job_id, count, carried_definitions(storage, engine))

    return hook


def _carry(context: dg.HookContext, job_id: str, count: int, defs: dg.Definitions) -> None:
    """Runs the steps the plan asks for until there are none, or one fails (job_driver then does
    what it does for any failed step)."""

    def read() -> JobState:
        (progress,) = [p for p in job_progress(context.instance) if p.job_id == job_id]
        return job_state(progress, count, shard_failures(context.instance, job_id, count))

    def run(step: Step) -> bool:
        if _terminating(context):  # a Terminate that came while the step before succeeded
            raise dg.DagsterExecutionInterruptedError(f"the run was terminated before {step.job_name}")
        result = defs.resolve_job_def(step.job_name).execute_in_process(
            instance=context.instance,
            partition_key=step.partition_key,
            tags={**step.tags, LAUNCHED_BY_TAG: CARRIED_RUN},
            raise_on_error=False,
        )
        what = f"{step.job_name} for {step.partition_key} (run {result.run_id})"
        if not result.success:
            error = first_step_error(result)
            reason = step_error_message(error) if error else "the run failed"
            context.log.warning(f"{what} failed: {reason}; job_driver takes the job on from here")
            if _terminating(context):  # the step took the termination as a stop: pass it on
                raise dg.DagsterExecutionInterruptedError(f"{what} was stopped: the run was terminated")
            failed.append(step)
            return False
        context.log.info(f"{what} succeeded")
        return True

    failed: list[Step] = []
    # the estimate, each shard, the finish, and one look that finds none left
    if not drive(read, run, rounds=count + 3) and not failed:
        context.log.warning(f"job {job_id} still has steps to run after {count + 3} rounds; job_driver takes it on")


def _terminating(context: dg.HookContext) -> bool:
    """Whether this run was asked to end (Terminate in the UI): it then ends as cancelled, as a
    terminated run does, rather than as a success."""
    run = context.instance.get_run_by_id(context.run_id)
    return run is not None and run.status == dg.DagsterRunStatus.CANCELING
