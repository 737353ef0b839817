"""What one Dagster instance holds: many finished jobs, and how long the driver, the UI's partition
pages and a prune take on it.

Fills a fresh instance (SQLite under a temporary DAGSTER_HOME, and/or PostgreSQL on a throwaway
loopback server with fsync on) with ``--jobs`` jobs of ``--shards`` shards each, as a deployment
that ran them would hold them: a ``jobs`` key per job and a ``shards`` key per shard, a run per
shard and one per job, the materializations of every stage, and a work folder per job (manifest,
report, a request and a checkpoint file per shard). A share of the jobs (``--pending``) still has
its last shard and its publish to run. Then it times:

- ``tick``: one evaluation of the ``job_driver`` sensor (cold: the first, which reads every job's
  manifest; warm: the next);
- the partition pages: every key of ``shards`` and ``jobs`` (what the partitions view lists),
  the first page of 100 keys, and the materialization status of ``generations`` and
  ``merged_result`` (the status cache the UI's partition bar reads, first built, then brought up
  to date);
- ``prune``: ``anex-pipeline prune`` with ``--prune`` of the jobs older than its limit (their runs,
  keys and folders removed; the listing walks every job folder);
- one job of ``--job-shards`` shards run through the CLI's runner on the fake engine: what a
  Dagster run per shard costs, per shard, on an instance this full.

    .venv/bin/python -m bench.scale_instance --jobs 20                         # quick check, both backends
    .venv/bin/python -m bench.scale_instance --jobs 10000 --backend sqlite     # the full size
    .venv/bin/python -m bench.scale_instance --jobs 10000 --backend postgres
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dagster as dg
from dagster._core.events import DagsterEvent, DagsterEventType, StepMaterializationData
from dagster._core.events.log import EventLogEntry
from dagster._core.storage.partition_status_cache import get_and_update_asset_status_cache_value

from anex_pipeline.instance import NEW_HOME_SETTINGS
from anex_pipeline.orchestration.definitions import build_definitions
from anex_pipeline.orchestration.job_admin import prune
from anex_pipeline.orchestration.names import PARTITION_TAG
from anex_pipeline.orchestration.partitions import JOBS, SHARDS, job_partitions, shard_keys, shard_partitions
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobReport, RequestCounts
from anex_pipeline.testing import fake_engine
from anex_pipeline.workdir.manifest import JobManifest, ShardRange
from anex_pipeline_tests.harness.jobs import chat_row

ROWS_PER_SHARD = 10
STAGES = ["validated_input", "length_estimate", "fetched_media", "generations", "merged_result", "result_file"]
DAY = 86400.0
POSTGRES_YAML = """telemetry:
  enabled: false
storage:
  postgres:
    postgres_db:
      hostname: {host}
      port: {port}
      username: {user}
      password: {password}
      db_name: {db}
      scheme: postgresql+psycopg2
"""


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - started, value


def materialization(run_id: str, job_name: str, asset: str, key: str) -> EventLogEntry:
    """The event a step writes when it materializes ``asset`` for partition ``key``."""
    event = DagsterEvent(
        event_type_value=DagsterEventType.ASSET_MATERIALIZATION.value,
        job_name=job_name,
        event_specific_data=StepMaterializationData(dg.AssetMaterialization(asset_key=asset, partition=key)),
    )
    return EventLogEntry(
        user_message="",
        level=logging.INFO,
        job_name=job_name,
        run_id=run_id,
        error_info=None,
        timestamp=time.time(),
        dagster_event=event,
    )


def add_run(instance: dg.DagsterInstance, job_name: str, key: str) -> str:
    run = dg.DagsterRun(
        job_name=job_name, run_id=str(uuid.uuid4()), status=dg.DagsterRunStatus.SUCCESS, tags={PARTITION_TAG: key}
    )
    instance.add_run(run)
    return run.run_id


def write_job_folder(work: Path, job_id: str, shards: int, age_s: float) -> None:
    root = work / job_id
    total = shards * ROWS_PER_SHARD
    manifest = JobManifest(
        job_id=job_id,
        input=f"/data/{job_id}.jsonl",
        input_sha256="0" * 64,
        output=f"/data/{job_id}.results.jsonl",
        report=f"/data/{job_id}.results.report.json",
        format="jsonl",
        endpoint="chat",
        model="model",
        model_name="model",
        options={},
        total_rows=total,
        shards=[ShardRange(start=s * ROWS_PER_SHARD, stop=(s + 1) * ROWS_PER_SHARD) for s in range(shards)],
        submitted_at=time.time() - age_s,
    )
    for s in range(shards):
        shard = root / "shards" / f"{s:02d}"
        shard.mkdir(parents=True)
        (shard / "requests.jsonl").write_text("{}\n" * ROWS_PER_SHARD)
        (shard / "results.jsonl").write_text("{}\n" * ROWS_PER_SHARD)
    (root / "job.json").write_text(manifest.model_dump_json())
    report = JobReport(job_id=job_id, status="completed", request_counts=RequestCounts(total=total, completed=total))
    (root / "report.json").write_text(report.model_dump_json())
    stamp = time.time() - age_s
    for dirpath, _, filenames in os.walk(root):
        for name in [*filenames, "."]:
            os.utime(os.path.join(dirpath, name), (stamp, stamp))


def populate(instance: dg.DagsterInstance, work: Path, jobs: int, shards: int, pending: float, old: float) -> None:
    """Jobs bench-00000... ; the first ``old`` share are 10 days idle, the last ``pending`` share
    have their last shard and their publish still to run."""
    ids = [f"bench-{n:05d}" for n in range(jobs)]
    waiting = set(ids[jobs - round(jobs * pending) :]) if pending else set()
    aged = set(ids[: round(jobs * old)])
    for n in range(0, jobs, 500):
        chunk = ids[n : n + 500]
        instance.add_dynamic_partitions(JOBS, chunk)
        instance.add_dynamic_partitions(SHARDS, [k for j in chunk for k in shard_keys(j, shards)])
    steps = {"submit_job": STAGES[:2], "shard_job": STAGES[2:4], "finish_job": STAGES[4:]}
    for n in range(0, jobs, 100):
        # Stored a batch per asset (PostgreSQL writes a batch of one asset's materializations at once).
        events: dict[str, list[EventLogEntry]] = {asset: [] for asset in STAGES}
        for job_id in ids[n : n + 100]:
            write_job_folder(work, job_id, shards, 10 * DAY if job_id in aged else 60.0)
            keys = shard_keys(job_id, shards)
            runs = [("submit_job", job_id)] + [("shard_job", k) for k in (keys[:-1] if job_id in waiting else keys)]
            runs += [] if job_id in waiting else [("finish_job", job_id)]
            for job_name, key in runs:
                run_id = add_run(instance, job_name, key)
                for asset in steps[job_name]:
                    events[asset].append(materialization(run_id, job_name, asset, key))
        for batch in events.values():
            instance.event_log_storage.store_event_batch(batch)


def tick(defs: dg.Definitions, instance: dg.DagsterInstance) -> int:
    """One evaluation of the driver, as the daemon runs it; returns the runs it asks for."""
    with (
        dg.build_sensor_context(instance=instance, resources=dict(defs.resources), definitions=defs) as context,
        dg.partition_loading_context(dynamic_partitions_store=instance),
    ):
        data = defs.resolve_sensor_def("job_driver").evaluate_tick(context)
    return len(data.run_requests or [])


def status(instance: dg.DagsterInstance, asset: str, partitions: dg.PartitionsDefinition) -> int:
    value = get_and_update_asset_status_cache_value(instance, dg.AssetKey(asset), partitions)
    assert value is not None
    return value.deserialize_materialized_partition_subsets(partitions).get_partition_keys().__len__()


def run_one_job(instance: dg.DagsterInstance, work: Path, shards: int) -> float:
    """Seconds per shard of a job of 10 rows a shard run by ``anex-pipeline run``'s runner on the
    fake engine: what one Dagster run per shard costs on this instance (submit, estimate and the
    merge are spread over the shards)."""
    src = work.parent / "one-job.jsonl"
    src.write_text("".join(json.dumps(chat_row(f"r{n}", f"question {n}")) + "\n" for n in range(10 * shards)))
    runner = JobRunner(instance, StorageResource(work_root=str(work)), fake_engine())
    out = str(work.parent / "out.jsonl")
    try:
        seconds, report = timed(lambda: runner.run(runner.submit(str(src), out, {"shards": shards})))
    finally:
        runner.close()
    assert report.status == "completed", report.failure_reason
    return seconds / shards


def measure(instance: dg.DagsterInstance, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    figures["seed_s"], _ = timed(lambda: populate(instance, work, args.jobs, args.shards, args.pending, args.prune))
    defs = build_definitions(StorageResource(work_root=str(work)), fake_engine())
    figures["tick_cold_s"], requests = timed(lambda: tick(defs, instance))
    figures["tick_warm_s"], _ = timed(lambda: tick(defs, instance))
    figures["tick_requests"] = requests
    figures["all_shard_keys_s"], keys = timed(lambda: instance.get_dynamic_partitions(SHARDS))
    figures["shard_keys"] = len(keys)
    figures["all_job_keys_s"], _ = timed(lambda: instance.get_dynamic_partitions(JOBS))
    figures["first_page_s"], _ = timed(lambda: instance.get_paginated_dynamic_partitions(SHARDS, 100, False))
    for asset, partitions in (("generations", shard_partitions), ("merged_result", job_partitions)):
        figures[f"{asset}_status_cold_s"], count = timed(status, instance, asset, partitions)
        figures[f"{asset}_status_warm_s"], _ = timed(status, instance, asset, partitions)
        figures[f"{asset}_materialized"] = count
    figures["prune_s"], removed = timed(lambda: prune(instance, work, 7 * DAY))
    figures["pruned_jobs"] = len(removed)
    figures["prune_per_job_s"] = figures["prune_s"] / max(1, len(removed))
    figures["shard_keys_after_prune"] = len(instance.get_dynamic_partitions(SHARDS))
    if args.job_shards:
        figures["one_job_s_per_shard"] = run_one_job(instance, work, args.job_shards)
    return figures


@contextlib.contextmanager
def instance_on(backend: str, base: Path) -> Iterator[dg.DagsterInstance]:
    home = base / f"home-{backend}"
    home.mkdir()
    if backend == "sqlite":
        (home / "dagster.yaml").write_text(NEW_HOME_SETTINGS)  # as the command sets up a new home
        os.environ["DAGSTER_HOME"] = str(home)  # where those settings put the event log
        with dg.DagsterInstance.from_config(str(home)) as instance:
            yield instance
        return
    from anex_pipeline_tests.harness.postgres_server import create_database, postgres_bin_dir, running_postgres

    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        raise SystemExit("no PostgreSQL server binaries: run scripts/ensure_postgres.sh first")
    with running_postgres(bin_dir, fsync=True) as server:
        config = POSTGRES_YAML.format(
            host=server.host, port=server.port, user=server.user, password=server.password, db=create_database(server)
        )
        (home / "dagster.yaml").write_text(config)
        with dg.DagsterInstance.from_config(str(home)) as instance:
            yield instance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--shards", type=int, default=5, help="shards per job (default 5)")
    parser.add_argument("--pending", type=float, default=0.01, help="share of jobs still running (default 0.01)")
    parser.add_argument("--prune", type=float, default=0.1, help="share of jobs old enough to prune (default 0.1)")
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--job-shards", type=int, default=20, help="then run one job of this many shards (0: none)")
    parser.add_argument("--dir", default=None, help="where the SQLite home and work folders go (default: the temp dir)")
    args = parser.parse_args()
    for backend in ["sqlite", "postgres"] if args.backend == "both" else [args.backend]:
        base = Path(tempfile.mkdtemp(prefix="anex-scale-", dir=args.dir))
        try:
            with instance_on(backend, base) as instance:
                figures = measure(instance, base / "work", args)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        head = f"{backend}: {args.jobs} jobs x {args.shards} shards"
        print(head, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main()
