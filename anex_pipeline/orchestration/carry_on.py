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

import dagster as dg

from anex_pipeline import settings
from anex_pipeline.orchestration.partitions import job_of_key
from anex_pipeline.workdir.lease import try_lease


@dg.success_hook(required_resource_keys={"storage", "engine"})
def carry_on(context: dg.HookContext) -> None:
    """The success hook of ``submit_job``: runs the job's later steps when it is small enough."""
    # Imported here: these modules import the jobs, and jobs.py imports this hook.
    from anex_pipeline.orchestration.definitions import build_definitions
    from anex_pipeline.orchestration.driver import next_steps
    from anex_pipeline.orchestration.runs import (
        CARRIED_RUN,
        LAUNCHED_BY_TAG,
        PARTITION_TAG,
        first_step_error,
        job_progress,
        shard_failures,
        step_error_message,
    )

    run = context.instance.get_run_by_id(context.run_id)
    if run is None or run.tags.get(LAUNCHED_BY_TAG) or settings.EXECUTOR.get():
        return  # a process that drives the job itself, or steps that belong elsewhere
    try:
        limit = settings.CARRY_ON_SHARDS.get_int()
    except ValueError:
        context.log.error(
            f"{settings.CARRY_ON_SHARDS.name}={settings.CARRY_ON_SHARDS.get()!r} is not a whole number of shards; "
            "the job's other steps wait for job_driver (set it to 1, the default, or 0 to turn this off)"
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
    defs = build_definitions(storage, engine, automation=False)
    with lease:
        for _ in range(count + 3):  # the estimate, each shard, the finish, and one look that finds none left
            (progress,) = [p for p in job_progress(context.instance) if p.job_id == job.job_id]
            steps = next_steps(progress, count, shard_failures(context.instance, job.job_id, count))
            if not steps:
                return
            for step in steps:
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
                    return
                context.log.info(f"{what} succeeded")
        context.log.warning(f"job {job.job_id} still has steps to run after {count + 3} rounds; job_driver takes it on")


def _terminating(context: dg.HookContext) -> bool:
    """Whether this run was asked to end (Terminate in the UI): it then ends as cancelled, as a
    terminated run does, rather than as a success."""
    run = context.instance.get_run_by_id(context.run_id)
    return run is not None and run.status == dg.DagsterRunStatus.CANCELING
