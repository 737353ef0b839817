"""Each step of a run as a Ray job on an existing Ray cluster (``ANEX_EXECUTOR=ray``).

The steps are handed to the cluster by dagster-ray's step handler (one Ray job per step, its
driver is the step process), with these differences from dagster-ray's own ``ray_executor``:

- Resources come from each step's op tag only (:data:`ENGINE_STEP` one GPU, :data:`OTHER_STEP`
  one CPU), never from the executor: dagster-ray lets an executor-level ``num_gpus`` win over
  every tag, and adds each step's tagged ``resources`` into the executor's own dict. A step that
  asked for nothing would run its driver on the head node.
- A Ray job stopped outside Dagster (``ray job stop``, the dashboard) fails its step, as a failed
  one does; dagster-ray counts only FAILED.
- The step health check (which is how a lost node is noticed: its Ray job fails) runs every
  ``ANEX_RAY_HEALTH_CHECK_S`` seconds (default 5) instead of Dagster's 20.
- The ``gpu`` pool's limit is set to the GPUs of the cluster's live nodes when a run starts, so
  as many engine steps run at once as there are GPUs.
- Ray's usage statistics are off, in this process and in every step.
- The head keeps every Ray job it ever ran in its job table; the prune schedule deletes the steps'
  finished Ray jobs (:func:`prune_finished_steps`) once they are as old as the jobs it removes.

The cluster is ``ANEX_RAY_ADDRESS``: its dashboard's address (``http://head:8265``), as for
``ray job submit``. Each step's process gets the ``ANEX_*`` settings of the run's process.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

import dagster as dg

from anex_pipeline import settings
from anex_pipeline.errors import RejectedError

if TYPE_CHECKING:
    from dagster._core.executor.base import Executor
    from dagster._core.executor.init import InitExecutorContext

RAY_CONFIG_TAG = "dagster-ray/config"  # the op tag dagster-ray reads a step's Ray resources from
ENGINE_STEP = {RAY_CONFIG_TAG: json.dumps({"num_gpus": 1})}
"""Op tags of the steps that hold an engine: one GPU of the cluster."""
OTHER_STEP = {RAY_CONFIG_TAG: json.dumps({"num_cpus": 1})}
"""Op tags of every other step: one CPU, so that it runs on a worker node, not on the head."""

GPU_POOL = "gpu"
USAGE_STATS_OFF = {"RAY_USAGE_STATS_ENABLED": "0"}


class RayExecutorMisconfigured(RejectedError):
    """The Ray executor's settings cannot work (a bad number, no cluster at the address)."""


def cluster_gpus(address: str) -> int:
    """The GPUs of the cluster's live nodes, read from its dashboard."""
    from ray.util.state import list_nodes

    # (A state filter on list_nodes still returned dead nodes here.)
    nodes = list_nodes(address=address, detail=True, raise_on_missing_output=False)
    return int(sum(node.resources_total.get("GPU", 0) for node in nodes if node.state == "ALIVE"))


def prune_finished_steps(address: str, older_than_s: float) -> list[str]:
    """Deletes the Ray jobs of Dagster steps (dagster-ray labels them with their run's id) that
    ended more than ``older_than_s`` ago from the head's job table (Ray leaves their log files on
    the nodes); returns their submission ids. Other Ray jobs on the cluster, and steps still
    running, are left alone."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(address)
    cutoff_ms = (time.time() - older_than_s) * 1000
    removed = []
    for job in client.list_jobs():
        step = "dagster/run-id" in (job.metadata or {}) and job.submission_id is not None
        old = job.status.is_terminal() and job.end_time is not None and job.end_time <= cutoff_ms
        if step and old and client.delete_job(job.submission_id):
            removed.append(job.submission_id)
    return removed


def step_environment() -> dict[str, str]:
    """The variables a step's process gets beside what its Ray node has: this process's
    ``ANEX_*`` settings, and Ray's usage statistics off."""
    return {**settings.pipeline_environment(), **USAGE_STATS_OFF}


def _health_check_s() -> int:
    raw = settings.RAY_HEALTH_CHECK_S.get()
    if not (raw.isascii() and raw.isdigit() and int(raw) > 0):
        name = settings.RAY_HEALTH_CHECK_S.name
        raise RayExecutorMisconfigured(f"{name}={raw!r}: give a whole number of seconds above 0")
    return int(raw)


def _step_handler_class() -> type:
    from dagster._core.executor.step_delegating import CheckStepHealthResult
    from dagster_ray.core.executor import RayStepHandler
    from ray.job_submission import JobStatus

    class StepHandler(RayStepHandler):
        """dagster-ray's step handler, with a Ray job stopped outside Dagster counted as failed."""

        def check_step_health(self, step_handler_context: Any) -> Any:
            result = super().check_step_health(step_handler_context)
            if not result.is_healthy:
                return result
            submission_id = self._get_ray_job_submission_id(step_handler_context)
            if self.client.get_job_status(submission_id) == JobStatus.STOPPED:
                return CheckStepHealthResult.unhealthy(
                    reason=f"Ray job {submission_id} was stopped outside Dagster (ray job stop, or the dashboard)"
                )
            return result

    return StepHandler


def _executor_config_schema() -> dict[str, Any]:
    from dagster._core.execution.retries import get_retries_config

    return {"retries": get_retries_config()}


def _requirements() -> Any:
    from dagster._core.definitions.executor_definition import multiple_process_executor_requirements

    return multiple_process_executor_requirements()


@dg.executor(name="ray", config_schema=_executor_config_schema(), requirements=_requirements())
def ray_executor(init_context: InitExecutorContext) -> Executor:
    """Runs each step as a Ray job on the cluster at ``ANEX_RAY_ADDRESS`` (see the module)."""
    from dagster._core.execution.retries import RetryMode
    from dagster._core.executor.step_delegating import StepDelegatingExecutor
    from ray.job_submission import JobSubmissionClient

    os.environ.update(USAGE_STATS_OFF)
    address = settings.RAY_ADDRESS.get()
    if not address:
        raise RayExecutorMisconfigured(
            f"ANEX_EXECUTOR=ray needs {settings.RAY_ADDRESS.name}: the Ray dashboard's address, e.g. http://ray-head:8265"
        )
    health_check_s = _health_check_s()
    client = JobSubmissionClient(address)
    gpus = cluster_gpus(address)
    init_context.instance.event_log_storage.set_concurrency_slots(GPU_POOL, max(gpus, 1))
    handler = _step_handler_class()(
        client=client,
        env_vars=[f"{k}={v}" for k, v in step_environment().items()],
        runtime_env=None,
        num_cpus=None,
        num_gpus=None,
        memory=None,
        resources=None,
    )
    return StepDelegatingExecutor(
        handler,
        retries=RetryMode.from_config(init_context.executor_config["retries"]),  # type: ignore[arg-type]
        check_step_health_interval_seconds=health_check_s,
        should_verify_step=True,
    )
