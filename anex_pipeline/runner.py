"""Running a whole batch job through the Dagster asset jobs on one instance, step after step.

This is what ``anex-pipeline run`` does: submit (validated_input), estimate, every shard, then
merge and publish. Each step is an ordinary Dagster run, so the job shows in the UI afterwards,
and the in-process engine is loaded once and shared by all of them. The runs are tagged
``anex/launched_by=cli``, and the runner holds the job's lease while it drives the job, so the
``job_driver`` sensor leaves the job alone until the command ends (or dies).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import dagster as dg

from anex_pipeline.engine.config import EngineConfig
from anex_pipeline.engine.loader import release_engines, schedules_by_priority
from anex_pipeline.errors import AnexError
from anex_pipeline.options import job_options
from anex_pipeline.orchestration.definitions import build_definitions
from anex_pipeline.orchestration.in_process import FolderProgress, drive
from anex_pipeline.orchestration.names import CLI_RUN, ESTIMATE_JOB, FINISH_JOB, LAUNCHED_BY_TAG, SHARD_JOB
from anex_pipeline.orchestration.partitions import register_job, split_shard_key
from anex_pipeline.orchestration.plan import Step
from anex_pipeline.orchestration.resources import EngineResource, StorageResource
from anex_pipeline.orchestration.runs import first_step_error, step_error_message
from anex_pipeline.spec import JobReport
from anex_pipeline.stages.submit import prepare_job
from anex_pipeline.stopping import USER_STOP, StopCheck, clear_stop, request_stop
from anex_pipeline.storage import StorageConfig, is_s3
from anex_pipeline.workdir import layout
from anex_pipeline.workdir.lease import take_lease
from anex_pipeline.workdir.manifest import JobDir, JobManifest, unfinished_shards
from anex_pipeline.workdir.timing import record_timing

log = logging.getLogger("anex_pipeline.progress")

# Dagster's console log stays silent: a failed step (a stopped job's among them) would print its
# stack trace; the runner reports failures itself, in one line.
QUIET_LOGGERS: dict[str, Any] = {"console": {"config": {"log_level": "CRITICAL"}}}


# The rounds of a drive: the estimate, the shards, the finish, and one look that finds nothing left.
DRIVE_ROUNDS = 4


class StepFailed(AnexError):
    """A Dagster step of the job failed; its message is the step's error."""


class _Interrupted(Exception):
    """A stop signal reached Dagster's own handler (between two steps) rather than the job's."""


class JobRunner:
    """Runs jobs on one Dagster instance with one set of resources."""

    def __init__(
        self,
        instance: dg.DagsterInstance,
        storage: StorageConfig,
        engine: EngineConfig,
    ):
        """``storage`` and ``engine`` are plain settings (a Dagster resource is one too); the runner
        wraps them in the resources its Dagster runs use, the engine kept loaded between runs.
        The engine's ``warm_server`` and ``keep_warm`` send jobs to the machine's shared model server
        (see :mod:`anex_pipeline.engine.modes`)."""
        self.instance = _safe_for_threads(instance)
        self.storage = StorageResource.wrapping(storage)
        self.engine = EngineResource.wrapping(engine, keep_loaded=True)
        self.defs = build_definitions(storage, self.engine, automation=False)
        self._leases: dict[str, IO[bytes]] = {}  # job id -> lease file, from submit to the end of run
        self._early_loads: set[str] = set()  # jobs whose engine started loading ahead of time

    def submit(
        self,
        input_path: str,
        output: str,
        raw_options: dict[str, Any],
        report: str | None = None,
        options_file: str | None = None,
        results_in: Path | None = None,
        stop: Callable[[], None] | None = None,
        answer_scope: str = "",
    ) -> JobDir:
        """Checks the input (raising JobRejected) and registers the job's partition; ``options_file``
        is where ``raw_options`` were read from, if from a file; ``results_in``: a folder of the
        work root where the caller keeps the results itself; ``stop`` can end the check early;
        ``answer_scope``: whose stored answers the job may share (all three: see
        :func:`~anex_pipeline.stages.submit.prepare_job`).

        The job's lease is taken as soon as its id is known, before its folder is read: a prune or
        delete that started earlier either ends first or leaves the job alone."""
        options = job_options(raw_options)
        work_root = Path(self.storage.work_root).expanduser()
        claimed: list[str] = []  # the job whose lease this call took, if it was not held yet

        def claim(job: JobDir) -> None:
            if job.job_id not in self._leases:
                self._hold(job)
                claimed.append(job.job_id)

        try:
            job = prepare_job(
                self.storage.local_input(input_path, work_root / layout.INPUTS_DIR),
                output,
                options,
                work_root,
                report=report,
                local_model=not self.engine.base_url,
                adapters=self.engine.lora_modules,
                priority=schedules_by_priority(self.engine),
                s3_client=self.storage.s3_client(quick=True) if _uses_s3(output, report) else None,
                options_file=Path(options_file) if options_file else None,
                results_in=results_in,
                stop=stop,
                claim=claim,
                answer_scope=answer_scope,
            )
        except BaseException:  # a refused job is not driven by anyone: let go of a lease taken for it
            for job_id in claimed:
                self._leases.pop(job_id).close()
            raise
        self._load_engine_early(job, job.manifest())
        self._register(job)
        self._execute("submit_job", job.job_id)
        return job

    def run(
        self,
        job: JobDir,
        shards: Sequence[int] | None = None,
        *,
        clear_stop: bool = True,
        until: tuple[float, str] | None = None,
    ) -> JobReport:
        """Estimate, generate the chosen shards (by default every shard with rows left), merge and publish.

        Running a job again resumes it, so an earlier stop is cleared first; a caller that
        cleared it itself (and must not lose a stop asked since) passes ``clear_stop=False``.
        ``until``: a Unix time the run stops at, as at its time limit, and why (see
        :meth:`JobDir.start_clock`).
        """
        manifest = job.manifest()
        self._hold(job)
        try:
            return self._run(job, manifest, shards, clear_stop, until)
        finally:
            self._leases.pop(job.job_id).close()
            self._early_loads.discard(job.job_id)  # a later run of the job may load ahead again

    def _run(
        self,
        job: JobDir,
        manifest: JobManifest,
        shards: Sequence[int] | None,
        clear: bool,
        until: tuple[float, str] | None,
    ) -> JobReport:
        self._register(job)
        if clear:
            clear_stop(job)
        job.start_clock(manifest.job_options().time_limit_s, until)
        self._load_engine_early(job, manifest)
        progress = FolderProgress(job, shards)
        stop = StopCheck(job)

        def run_step(step: Step) -> bool:
            if step.job_name == SHARD_JOB and stop.asked() is not None:
                progress.stopped = True  # the shards left wait for a later run
                return True
            if step.job_name == SHARD_JOB:
                log.info("shard %d of %d", split_shard_key(step.partition_key)[1] + 1, len(manifest.shards))
            if step.job_name == FINISH_JOB:
                if progress.failed and not job.stop_path.exists():
                    job.record_stop("; ".join(f"shard {s}: {why}" for s, why in progress.failed.items()))
                self._finish(job)
                progress.ended(step, None)
                return True
            try:
                self._execute(step.job_name, step.partition_key)
            except StepFailed as exc:
                # a step that failed because the job was stopped keeps that reason
                if step.job_name == ESTIMATE_JOB and not job.stop_path.exists():
                    job.record_stop(str(exc))
                progress.ended(step, str(exc))
                return True
            progress.ended(step, None)
            return True

        try:
            drive(progress.state, run_step, DRIVE_ROUNDS)
        except (KeyboardInterrupt, dg.DagsterExecutionInterruptedError, _Interrupted):  # a signal outside generation
            request_stop(job, f"{USER_STOP} (interrupted)")
            progress.stopped = True
            drive(progress.state, run_step, DRIVE_ROUNDS)
        report = job.report()
        assert report is not None  # finish_job succeeded, so its merge wrote the report
        return report

    def _finish(self, job: JobDir) -> None:
        try:
            self._execute(FINISH_JOB, job.job_id)
        except _Interrupted:  # a Ctrl-C while the result was merged: merged again, as a stopped job's is
            request_stop(job, f"{USER_STOP} (interrupted)")
            self._execute(FINISH_JOB, job.job_id)

    def _hold(self, job: JobDir) -> None:
        if job.job_id not in self._leases:
            self._leases[job.job_id] = take_lease(job)

    def _load_engine_early(self, job: JobDir, manifest: JobManifest) -> None:
        """Starts loading the engine in the background while the first steps run (the steps that
        need it wait for it), once per job, when the job has rows left to generate."""
        if job.job_id in self._early_loads or not unfinished_shards(job):
            return
        self._early_loads.add(job.job_id)
        # ~0 s when the engine was loaded already
        self.engine.load_ahead(manifest, lambda took: record_timing(job, "engine_load", took), "anex-engine-load")

    def _register(self, job: JobDir) -> None:
        """Adds the job's partition keys to this instance (a job's folder may outlive an instance,
        and a job prepared before shards had keys of their own gets them here)."""
        register_job(self.instance, job.job_id, len(job.manifest().shards))

    def unfinished_shards(self, job: JobDir) -> list[int]:
        """Shards with rows that are missing from their checkpoint or failed."""
        return unfinished_shards(job)

    def close(self, exiting: bool = False) -> None:
        """Lets go of the job leases and the engines (see :func:`release_engines` for ``exiting``)."""
        while self._leases:
            self._leases.popitem()[1].close()
        release_engines(exiting)

    def _execute(self, job_name: str, partition_key: str) -> None:
        result = self.defs.resolve_job_def(job_name).execute_in_process(
            instance=self.instance,
            partition_key=partition_key,
            run_config={"loggers": QUIET_LOGGERS},
            tags={LAUNCHED_BY_TAG: CLI_RUN},
            raise_on_error=False,
        )
        if not result.success:
            error = first_step_error(result)
            if error is not None and error.cls_name in ("DagsterExecutionInterruptedError", "KeyboardInterrupt"):
                raise _Interrupted()
            raise StepFailed(step_error_message(error) if error else f"{job_name} failed for {partition_key}")


def _safe_for_threads(instance: dg.DagsterInstance) -> dg.DagsterInstance:
    """Lets runs of the instance start while other threads run (the Batch API runs several jobs).

    Dagster 1.13 calls ``logging.config.dictConfig`` as every run of an instance with settings
    starts, even when no ``python_logs`` handlers are configured. dictConfig closes every handler
    of the process: holding logging's lock, it waits for each handler's lock, while a run in
    another thread, writing an event under its handler's lock, waits for logging's lock to log:
    both wait for ever. With no handlers configured the call yields none, so it is skipped."""
    if not instance.get_python_log_dagster_handler_config():
        instance.get_yaml_python_handlers = list  # type: ignore[method-assign]
    return instance


def _uses_s3(*locations: str | None) -> bool:
    return any(is_s3(where) for where in locations if where)
