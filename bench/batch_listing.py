"""Listing a tenant's batches when it has many: the Batch API's store with ``--batches`` batches of
one key, finished (and a tenth as many of another key, unfinished, made in between), on SQLite and/or PostgreSQL (a
throwaway loopback server with fsync on).

Times, each the median of ``--repeat`` tries:

- ``first page``: ``store.batches(owner, None, 100)``, what ``GET /v1/batches?limit=100`` reads,
  right after the fill (``no stats``: PostgreSQL's planner has no statistics of the table yet, as
  until its autovacuum analyzes it) and after ``ANALYZE`` (as every later page);
- ``deep page``: the page after the 100th-oldest batch (the SDK's pager near the end);
- ``every page``: walking all the key's batches 100 at a time, as the SDK's pager does;
- ``unfinished``: every unfinished batch (what a start takes up: the other key's);
- ``http first page`` and ``http every page`` (SQLite only): the same through the service's
  ``GET /v1/batches`` and the ``openai`` SDK, each batch shown as the route shows it.

    .venv/bin/python -m bench.batch_listing                          # 10,000 batches, both backends
    .venv/bin/python -m bench.batch_listing --batches 1000 --backend sqlite
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dagster as dg
from dagster._core.instance.ref import InstanceRef

from anex_pipeline.batches.store import Store, key_hash
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.testing import fake_engine
from anex_pipeline_tests.harness.batch_api import client, serving
from anex_pipeline_tests.harness.batch_records import OWNER_B, batch_of, insert_batches, upload

KEY = "sk-bench-listing-0123456789"


def timed(repeat: int, work: Callable[[], Any]) -> float:
    took = []
    for _ in range(repeat):
        began = time.perf_counter()
        work()
        took.append(time.perf_counter() - began)
    return statistics.median(took)


def walk(store: Store, owner: str) -> int:
    seen, after = 0, None
    while True:
        page, more = store.batches(owner, after, 100)
        seen += len(page)
        if not more:
            return seen
        after = page[-1].id


@contextlib.contextmanager
def home(backend: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="anex-bench-listing-") as folder:
        path = Path(folder) / "home"
        path.mkdir()
        settings = "telemetry:\n  enabled: false\n"
        if backend == "sqlite":
            (path / "dagster.yaml").write_text(settings)
            yield path
            return
        from anex_pipeline_tests.harness.postgres_server import create_database, postgres_bin_dir, running_postgres

        bin_dir = postgres_bin_dir()
        assert bin_dir is not None, "no PostgreSQL binaries: scripts/ensure_postgres.sh installs them"
        with running_postgres(bin_dir, fsync=True) as server:
            url = f"postgresql+psycopg2://{server.user}:{server.password}@{server.host}:{server.port}/"
            settings += f'storage:\n  postgres:\n    postgres_url: "{url}{create_database(server)}"\n'
            (path / "dagster.yaml").write_text(settings)
            yield path


def measure(backend: str, count: int, repeat: int) -> dict[str, float]:
    owner = key_hash(KEY)
    with home(backend) as path, dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(path))) as instance:
        work = path.parent / "work"
        store = Store(instance, work)
        store.set_keys([KEY])
        mine, theirs = upload(store, owner), upload(store, OWNER_B)
        made = [batch_of(mine, completed_at=1) for _ in range(count)]
        others = [batch_of(theirs) for _ in range(count // 10)]  # unfinished
        began = time.perf_counter()
        insert_batches(store, [*made[: count // 2], *others, *made[count // 2 :]])
        results = {"fill (one transaction)": time.perf_counter() - began}
        results["first page, no stats"] = timed(repeat, lambda: store.batches(owner, None, 100))
        with store.db.writing() as conn:  # what PostgreSQL's autovacuum does soon after such a fill
            conn.exec_driver_sql("ANALYZE")
        results["first page"] = timed(repeat, lambda: store.batches(owner, None, 100))
        results["deep page"] = timed(repeat, lambda: store.batches(owner, made[100].id, 100))
        assert walk(store, owner) == count
        results["every page"] = timed(max(1, repeat // 5), lambda: walk(store, owner))
        results["unfinished"] = timed(repeat, store.unfinished)
        if backend == "sqlite":
            for other in others:  # ended, so that the service takes none of them up
                store.update_batch(other.id, cancelled_at=1)
            runner = JobRunner(instance, StorageResource(work_root=str(work)), fake_engine())
            with serving(runner, keys=[KEY], warm_up=False) as url:
                sdk = client(url, KEY)
                results["http first page"] = timed(repeat, lambda: sdk.batches.list(limit=100))
                every = timed(1, lambda: sum(1 for _ in sdk.batches.list(limit=100)))
                results["http every page"] = every
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    args = parser.parse_args()
    for backend in ("sqlite", "postgres") if args.backend == "both" else (args.backend,):
        for name, seconds in measure(backend, args.batches, args.repeat).items():
            print(f"{backend:9} {name:24} {seconds * 1000:9.1f} ms")


if __name__ == "__main__":
    main()
