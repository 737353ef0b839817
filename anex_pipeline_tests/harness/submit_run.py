"""A Dagster submit run in a process of its own, as the daemon's run launcher starts one (no
``anex/launched_by`` tag), with the slow fake engine behind it: a test can kill the process while
the run carries its job on.

    python -m anex_pipeline_tests.harness.submit_run WORK_ROOT JOB_ID INPUT OUTPUT

DAGSTER_HOME names the instance; ANEX_FAKE_ROW_DELAY_S slows each row down."""

from __future__ import annotations

import sys

import dagster as dg

from anex_pipeline.orchestration.definitions import build_definitions
from anex_pipeline.orchestration.partitions import JOBS
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.testing import fake_engine
from anex_pipeline_tests.harness.fake_cli import SLOW_FAKE


def main(work_root: str, job_id: str, source: str, output: str) -> int:
    defs = build_definitions(StorageResource(work_root=work_root), fake_engine(SLOW_FAKE), automation=False)
    with dg.DagsterInstance.get() as instance:
        instance.add_dynamic_partitions(JOBS, [job_id])
        config = {"input": source, "output": output, "options": {}}
        result = defs.resolve_job_def("submit_job").execute_in_process(
            instance=instance, partition_key=job_id, run_config={"ops": {"validated_input": {"config": config}}}
        )
    return 0 if result.success else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
