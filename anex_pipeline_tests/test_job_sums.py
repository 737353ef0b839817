"""The figures a job adds up over its shards (stage seconds, rows per server) lose nothing when
shard steps in separate processes add to them at once, as on Ray nodes sharing the work folder."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from anex_pipeline.workdir.manifest import JobDir
from anex_pipeline.workdir.timing import read_served, record_served

ADDS = 60


def _add(root: str, host: str) -> None:
    job = JobDir(Path(root), "j")
    for _ in range(ADDS):
        record_served(job, {host: 1})


def test_steps_in_other_processes_adding_at_once_lose_no_row(tmp_path: Path) -> None:
    job = JobDir(tmp_path, "j")
    job.root.mkdir(parents=True)
    hosts = [f"node-{i}" for i in range(4)]
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_add, args=(str(tmp_path), host)) for host in hosts]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    assert read_served(job) == {host: ADDS for host in hosts}
