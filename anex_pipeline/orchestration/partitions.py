"""A job is a key of the ``jobs`` dynamic partition; each of its shards is a key ``<job_id>|<shard>``
of the ``shards`` dynamic partition, added when the job is prepared. So the instance holds exactly
the shards each job has, however many that is, and deleting a job removes exactly its keys.

Between the two sets the assets depend through Dagster's built-in all-partitions mapping: a merge
follows the shards of its own job, but Dagster has no built-in mapping from ``<job>|<shard>`` keys to
``<job>``, and a mapping of our own would be dropped by the webserver and the daemon, which would
then read the edge as key-to-same-key (a backfill would merge before its shards ran). Which shards a
merge reads is the job's manifest; the driver starts it once exactly those have run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import dagster as dg

from anex_pipeline.workdir.manifest import shard_key

JOBS = "jobs"
SHARDS = "shards"
SEPARATOR = "|"  # never in a job id (see workdir.manifest.JOB_ID)
CHUNK = 500  # keys per statement: SQLite refuses a statement with more than 32,766 values

job_partitions = dg.DynamicPartitionsDefinition(name=JOBS)
shard_partitions = dg.DynamicPartitionsDefinition(name=SHARDS)
across_jobs_and_shards = dg.AllPartitionMapping()


def job_shard_key(job_id: str, shard: int) -> str:
    return f"{job_id}{SEPARATOR}{shard_key(shard)}"


def shard_keys(job_id: str, count: int) -> list[str]:
    return [job_shard_key(job_id, s) for s in range(count)]


def split_shard_key(key: str) -> tuple[str, int]:
    """``"<job>|<shard>"`` -> (job, shard number)."""
    job_id, _, shard = key.rpartition(SEPARATOR)
    return job_id, int(shard)


def job_of_key(key: str) -> str:
    """The job a partition key belongs to: a job key is its job, a shard key names it first."""
    return key.split(SEPARATOR, 1)[0]


def _chunks(keys: Sequence[str]) -> Iterable[Sequence[str]]:
    return (keys[n : n + CHUNK] for n in range(0, len(keys), CHUNK))


def shard_keys_on(instance: dg.DagsterInstance, job_id: str) -> list[str]:
    """Every ``shards`` key of the job on the instance (a scan of the whole set: for a job whose
    manifest is gone, or to find keys that an earlier submission of the job left)."""
    prefix = job_id + SEPARATOR
    return [k for k in instance.get_dynamic_partitions(SHARDS) if k.startswith(prefix)]


def register_job(instance: dg.DagsterInstance, job_id: str, shard_count: int) -> None:
    """Makes the instance hold the job's key and exactly its ``shard_count`` shard keys: missing
    ones are added (jobs prepared before shards had keys of their own get theirs here), keys of
    shards the job no longer has (it was prepared again with fewer) are removed."""
    if not instance.has_dynamic_partition(JOBS, job_id):
        instance.add_dynamic_partitions(JOBS, [job_id])
    wanted = shard_keys(job_id, shard_count)
    for chunk in _chunks(wanted):  # the instance adds only the keys it lacks
        instance.add_dynamic_partitions(SHARDS, list(chunk))
    beyond = job_shard_key(job_id, shard_count)
    if instance.has_dynamic_partition(SHARDS, beyond):  # a longer earlier submission
        keep = set(wanted)
        for key in shard_keys_on(instance, job_id):
            if key not in keep:
                instance.delete_dynamic_partition(SHARDS, key)


def forget_job(instance: dg.DagsterInstance, job_id: str, shard_count: int | None) -> None:
    """Removes the job's key and its shard keys (``shard_count`` from its manifest; None when the
    manifest is gone, and the keys are looked up instead)."""
    keys = shard_keys_on(instance, job_id) if shard_count is None else shard_keys(job_id, shard_count)
    for chunk in _chunks(keys):
        for key in instance.get_existing_dynamic_partitions(SHARDS, list(chunk)):
            instance.delete_dynamic_partition(SHARDS, key)
    instance.delete_dynamic_partition(JOBS, job_id)
