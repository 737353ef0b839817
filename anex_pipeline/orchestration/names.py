"""The names a job's Dagster objects go by: asset keys, job names and the run tags this package
sets. Sensors, schedules and readers of the instance use these, so none of them imports the assets
or the jobs just to read a name."""

from __future__ import annotations

import dagster as dg

# The assets of one job's steps, in the order a job makes them.
VALIDATED_INPUT = dg.AssetKey("validated_input")
LENGTH_ESTIMATE = dg.AssetKey("length_estimate")
FETCHED_MEDIA = dg.AssetKey("fetched_media")
GENERATIONS = dg.AssetKey("generations")
MERGED_RESULT = dg.AssetKey("merged_result")
RESULT_FILE = dg.AssetKey("result_file")

# The asset jobs, one per step.
SUBMIT_JOB = "submit_job"
ESTIMATE_JOB = "estimate_job"
SHARD_JOB = "shard_job"
FINISH_JOB = "finish_job"

PARTITION_TAG = "dagster/partition"
LAUNCHED_BY_TAG = "anex/launched_by"  # on the runs a process executes itself while it holds the job's lease:
CLI_RUN = "cli"  # the runs of `anex-pipeline run`, `backfill` and the Batch API
CARRIED_RUN = "submit_run"  # the later steps of a small job, run by its submit run (orchestration/carry_on.py)
RETRY_TAG = "anex/retry_of_submission"  # on retry runs: the storage id of the submission they retry
FAILED_SHARDS_TAG = "anex/failed_shards"  # on a finish run: the shards the job was published without
