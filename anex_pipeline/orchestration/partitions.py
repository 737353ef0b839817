"""A job is a dynamic partition (one per input file); a shard is a slice of its rows."""

from __future__ import annotations

import warnings

import dagster as dg

from anex_pipeline.spec import MAX_SHARDS
from anex_pipeline.workdir.manifest import shard_key

JOBS = "jobs"

job_partitions = dg.DynamicPartitionsDefinition(name=JOBS)
shard_partitions = dg.StaticPartitionsDefinition([shard_key(n) for n in range(MAX_SHARDS)])
job_shard_partitions = dg.MultiPartitionsDefinition({"job": job_partitions, "shard": shard_partitions})

# A job-level asset reads every shard partition of its own job. (The mapping is marked beta; its
# warning would print on every command, so it is silenced here, where it is chosen on purpose.)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", dg.BetaWarning)
    all_shards_of_job = dg.MultiToSingleDimensionPartitionMapping(partition_dimension_name="job")


def job_shard_key(job_id: str, shard: int) -> dg.MultiPartitionKey:
    return dg.MultiPartitionKey({"job": job_id, "shard": shard_key(shard)})
