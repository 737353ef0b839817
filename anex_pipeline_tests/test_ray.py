"""Jobs whose steps run on a real Ray cluster (``ANEX_EXECUTOR=ray``), driven by a real
``dagster-daemon`` on a PostgreSQL-backed instance (deploy/ray/dagster.yaml as it is).

The cluster (``harness/ray_cluster.py``) is a head with no CPUs and three worker nodes, each a
``ray start`` in its own PID and UTS namespace with its own hostname and one logical GPU, so that
one SIGKILL takes a node down and SIGSTOP freezes all of it. Every job is a file dropped into the
local inbox: ``local_inbox`` submits it, ``job_driver`` runs its steps, each one a Ray job. The
engine is the slow recording stand-in of ``harness/ray_location.py`` (0.2 s a row, each generated row
logged with the host that generated it).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import dagster as dg
import pyarrow.parquet as pq
import pytest

from anex_pipeline.orchestration.ray_executor import prune_finished_steps
from anex_pipeline.workdir import layout
from anex_pipeline.workdir.manifest import JobDir
from anex_pipeline_tests.harness.jobs import REPO, chat_row, read_jsonl, write_jsonl
from anex_pipeline_tests.harness.postgres_server import create_database, required_postgres
from anex_pipeline_tests.harness.ray_cluster import RayCluster, ray_cluster, wait_for
from anex_pipeline_tests.harness.ray_location import read_log

pytestmark = [pytest.mark.ray, pytest.mark.postgres, pytest.mark.daemon, pytest.mark.subprocess]
JOB_TIMEOUT_S = 600.0  # a busy 2-core machine; a quiet one takes a fraction
CHECKPOINT_ROWS = 5


@dataclass
class Deployment:
    root: Path
    cluster: RayCluster
    daemon: subprocess.Popen[bytes]
    env: dict[str, str]

    @property
    def inbox(self) -> Path:
        return self.root / "inbox"

    @property
    def outbox(self) -> Path:
        return self.root / "outbox"

    @property
    def work(self) -> Path:
        return self.root / "work"

    def instance(self) -> dg.DagsterInstance:
        return dg.DagsterInstance.from_config(self.env["DAGSTER_HOME"])

    def drop(self, name: str, rows: int, options: dict[str, Any]) -> Path:
        """Writes an input beside the inbox and moves it in (a sidecar first); returns its result path."""
        staged = self.root / name
        if name.endswith(".parquet"):
            import pyarrow as pa

            table = pa.table({"id": [f"{name}-{i}" for i in range(rows)], "prompt": [f"q {i}" for i in range(rows)]})
            pq.write_table(table, staged)
        else:
            write_jsonl(staged, [chat_row(f"{name}-{i}", f"question {i} of {name}") for i in range(rows)])
        (self.inbox / f"{name}.job.json").write_text(json.dumps({"checkpoint_rows": CHECKPOINT_ROWS, **options}))
        staged.rename(self.inbox / name)
        stem, ext = name.rsplit(".", 1)
        return self.outbox / f"{stem}.results.{ext}"

    def job_of(self, name: str, timeout: float = JOB_TIMEOUT_S) -> JobDir:
        """The work folder of the job the inbox made of ``name``."""

        def found() -> JobDir | None:
            for manifest in self.work.glob(f"*/{layout.MANIFEST}"):
                if json.loads(manifest.read_text()).get("input", "").endswith(name):
                    return JobDir(self.work, manifest.parent.name)
            return None

        return wait_for(found, timeout, f"the job of {name}")  # type: ignore[return-value]

    def wait_published(self, result: Path, job: JobDir) -> None:
        def published() -> bool:
            if self.daemon.poll() is not None:
                raise RuntimeError(f"dagster-daemon exited with {self.daemon.returncode}; see {self.root}/daemon.log")
            return result.exists() and self.materializations("result_file", job.job_id) > 0

        wait_for(published, JOB_TIMEOUT_S, f"{result.name} to be published", every=0.5)

    def materializations(self, asset: str, partition: str | None = None) -> int:
        with self.instance() as instance:
            records = instance.fetch_materializations(dg.AssetKey(asset), limit=1000).records
            return sum(1 for r in records if partition is None or (r.partition_key or "").startswith(partition))

    def generation_metadata(self, job_id: str) -> list[dict[str, Any]]:
        with self.instance() as instance:
            records = instance.fetch_materializations(dg.AssetKey("generations"), limit=1000).records
            found = []
            for r in records:
                if (r.partition_key or "").startswith(job_id):
                    m = r.asset_materialization
                    assert m is not None
                    found.append({k: v.value for k, v in m.metadata.items()} | {"partition": r.partition_key})
            return found

    def ray_jobs(self, run_ids: set[str]) -> list[Any]:
        from ray.job_submission import JobSubmissionClient

        jobs = JobSubmissionClient(self.cluster.dashboard).list_jobs()
        return [j for j in jobs if (j.metadata or {}).get("dagster/run-id") in run_ids]

    def run_ids(self, job_id: str) -> set[str]:
        with self.instance() as instance:
            return {
                r.run_id
                for r in instance.get_runs()
                if (r.tags.get("dagster/partition", "")).startswith(job_id) or r.tags.get("anex/job_id") == job_id
            }


def _dagster(env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    command = [str(Path(sys.executable).with_name("dagster")), *args, "-w", env["ANEX_TEST_WORKSPACE"]]
    return subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("ray")
    home = root / "home"
    home.mkdir()
    (root / "inbox").mkdir()
    shutil.copyfile(REPO / "deploy" / "ray" / "dagster.yaml", home / "dagster.yaml")
    workspace = root / "workspace.yaml"
    workspace.write_text(
        "load_from:\n  - python_module:\n      module_name: anex_pipeline_tests.harness.ray_location\n"
        f"      attribute: defs\n      working_directory: {REPO}\n      executable_path: {sys.executable}\n"
    )
    with required_postgres() as postgres:
        database = {
            "DAGSTER_PG_HOST": postgres.host,
            "DAGSTER_PG_PORT": str(postgres.port),
            "DAGSTER_PG_USER": postgres.user,
            "DAGSTER_PG_PASSWORD": postgres.password,
            "DAGSTER_PG_DB": create_database(postgres),
        }
        patch = pytest.MonkeyPatch()
        for name, value in database.items():  # this process reads the instance too
            patch.setenv(name, value)
        env = {
            **os.environ,
            **database,
            "DAGSTER_HOME": str(home),
            "ANEX_WORK_DIR": str(root / "work"),
            "ANEX_INBOX_DIR": str(root / "inbox"),
            "ANEX_OUTBOX_DIR": str(root / "outbox"),
            "ANEX_DRIVER_INTERVAL_S": "1",
            "ANEX_TEST_WORKSPACE": str(workspace),
        }
        try:
            with ray_cluster(["node-1", "node-2", "node-3"], env) as cluster:
                env |= {"ANEX_EXECUTOR": "ray", "ANEX_RAY_ADDRESS": cluster.dashboard}
                starts = [_dagster(env, "sensor", "start", name) for name in ("local_inbox", "job_driver")]
                for start in starts:
                    _, err = start.communicate(timeout=180)
                    assert start.returncode == 0, err.decode()[-2000:]
                with (root / "daemon.log").open("wb") as log:
                    daemon = subprocess.Popen(
                        [str(Path(sys.executable).with_name("dagster-daemon")), "run", "-w", str(workspace)],
                        env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    )  # fmt: skip
                try:
                    yield Deployment(root, cluster, daemon, env)
                finally:
                    os.killpg(daemon.pid, signal.SIGTERM)
                    try:
                        daemon.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        os.killpg(daemon.pid, signal.SIGKILL)
                        daemon.wait(timeout=30)
        finally:
            patch.undo()


def _result_ids(result: Path) -> list[str]:
    if result.suffix == ".parquet":
        return [str(v) for v in pq.read_table(result).column("id").to_pylist()]
    return [line["custom_id"] for line in read_jsonl(result)]


def test_a_job_from_the_inbox_spreads_its_shards_over_the_nodes(deployment: Deployment) -> None:
    rows = 40
    result = deployment.drop("spread.jsonl", rows, {"shards": 4, "max_tokens": 16})
    job = deployment.job_of("spread.jsonl")
    deployment.wait_published(result, job)

    assert _result_ids(result) == [f"spread.jsonl-{i}" for i in range(rows)]
    assert deployment.materializations("merged_result", job.job_id) == 1
    assert deployment.materializations("result_file", job.job_id) == 1

    # Every step was a Ray job, none of them on the head.
    runs = deployment.run_ids(job.job_id)
    ray_jobs = deployment.ray_jobs(runs)
    steps = {(j.metadata["dagster/run-id"], j.metadata["dagster/op"]) for j in ray_jobs}
    # The job sets max_tokens, so its estimate takes no sample: the submit step records it, and no
    # length_estimate step runs.
    assert {op for _, op in steps} == {
        "validated_input", "fetched_media", "generations", "merged_result", "result_file",
    }  # fmt: skip
    assert len(steps) == 1 + 4 * 2 + 2
    head = {n["node_id"] for n in _nodes(deployment) if n["is_head_node"]}
    assert all(j.driver_node_id and j.driver_node_id not in head for j in ray_jobs)

    # The 4 generation steps ran on at least 3 hosts, one at a time per node, each with a GPU of its own.
    generated = read_log(job.root)
    assert sorted(e["custom_id"] for e in generated) == sorted(f"spread.jsonl-{i}" for i in range(rows))
    steps_seen: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for e in generated:
        steps_seen.setdefault((e["host"], e["pid"]), []).append(e)
    hosts = {m["host"] for m in deployment.generation_metadata(job.job_id)}
    assert len(hosts) >= 3 and hosts <= {n.hostname for n in deployment.cluster.nodes}
    spans: dict[str, list[tuple[float, float]]] = {}
    for entries in steps_seen.values():
        assert all(e["cuda"] not in (None, "") for e in entries)
        spans.setdefault(entries[0]["host"], []).append((min(e["t"] for e in entries), max(e["t"] for e in entries)))
    for host, intervals in spans.items():
        intervals.sort()
        assert all(a[1] < b[0] for a, b in itertools.pairwise(intervals)), (host, intervals)
    report = json.loads(result.with_name("spread.results.report.json").read_text())
    assert set(report["served_by"]) == hosts and sum(report["served_by"].values()) == rows
    # The runs set the gpu pool to the cluster's GPUs (deploy/ray/dagster.yaml starts it at 1).
    with deployment.instance() as instance:
        assert instance.event_log_storage.get_concurrency_info("gpu").slot_count == 3

    # Pruning removes the steps' finished Ray jobs from the head's job table once they are old enough
    # (the last step's driver may still be ending when its result is published).
    wait_for(lambda: all(j.status.is_terminal() for j in deployment.ray_jobs(runs)), 60, "the step jobs to end")
    assert prune_finished_steps(deployment.cluster.dashboard, older_than_s=3600) == []
    removed = prune_finished_steps(deployment.cluster.dashboard, older_than_s=0)
    assert {j.submission_id for j in ray_jobs} <= set(removed) and deployment.ray_jobs(runs) == []


def _nodes(deployment: Deployment) -> list[dict[str, Any]]:
    from ray.util.state import list_nodes

    return [n.__dict__ for n in list_nodes(address=deployment.cluster.dashboard, detail=True)]


def _node_generating(deployment: Deployment, job: JobDir, rows: int) -> str:
    """Waits until the job's only shard has ``rows`` rows in its checkpoint; returns the host generating it."""
    wait_for(lambda: len(job.finished_rows(0)) >= rows, JOB_TIMEOUT_S, f"{rows} rows in the checkpoint", every=0.1)
    return str(read_log(job.root)[-1]["host"])


def test_a_node_killed_mid_shard_loses_no_row_and_the_shard_finishes_elsewhere(deployment: Deployment) -> None:
    rows = 60
    result = deployment.drop("killed.jsonl", rows, {"shards": 1, "max_tokens": 16})
    job = deployment.job_of("killed.jsonl")
    host = _node_generating(deployment, job, 10)
    node = next(n for n in deployment.cluster.nodes if n.hostname == host)
    checkpointed = job.finished_rows(0)
    node.kill()
    checkpointed |= job.finished_rows(0)  # a chunk the node wrote as it went down counts too
    deployment.cluster.add_node("node-4")  # the lost machine is replaced, as a cluster's autoscaler would
    deployment.wait_published(result, job)

    assert _result_ids(result) == [f"killed.jsonl-{i}" for i in range(rows)]
    assert deployment.materializations("merged_result", job.job_id) == 1
    assert deployment.materializations("result_file", job.job_id) == 1
    # The step was retried on another live node.
    [generated] = deployment.generation_metadata(job.job_id)
    assert generated["host"] != host and generated["completed"] == rows
    # Rows checkpointed before the kill were not generated again; at most the rows in flight were.
    log = read_log(job.root)
    retry = {e["custom_id"] for e in log if e["host"] != host}
    assert not retry & {f"killed.jsonl-{i}" for i in checkpointed}
    twice = [cid for cid in retry if any(e["custom_id"] == cid and e["host"] == host for e in log)]
    assert len(twice) <= CHECKPOINT_ROWS
    assert len(retry) + len(checkpointed) >= rows


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_node_frozen_mid_shard_that_comes_back_changes_nothing(deployment: Deployment, kind: str) -> None:
    rows, name = 60, f"frozen.{kind}"
    result = deployment.drop(name, rows, {"shards": 1, "max_tokens": 16})
    job = deployment.job_of(name)
    host = _node_generating(deployment, job, 10)
    node = next(n for n in deployment.cluster.nodes if n.hostname == host and n.alive)
    frozen = node.freeze()
    deployment.cluster.add_node(f"node-{len(deployment.cluster.nodes) + 1}")
    deployment.wait_published(result, job)
    published = result.read_bytes()
    counts = {a: deployment.materializations(a, job.job_id) for a in ("generations", "merged_result", "result_file")}
    assert counts == {"generations": 1, "merged_result": 1, "result_file": 1}
    [generated] = deployment.generation_metadata(job.job_id)
    assert generated["host"] != host

    node.thaw(frozen)
    # Back, the node learns that the cluster gave it up and ends, with every process of it.
    wait_for(lambda: not node.alive, 120, f"{host} to end after it was thawed")
    assert result.read_bytes() == published
    assert job.finished_rows(0) == set(range(rows))
    assert _result_ids(result) == [f"{name}-{i}" for i in range(rows)]
    after = {a: deployment.materializations(a, job.job_id) for a in ("generations", "merged_result", "result_file")}
    assert after == counts


def test_a_ray_job_stopped_outside_dagster_fails_its_step(deployment: Deployment) -> None:
    from dagster_ray.kuberay.utils import get_k8s_object_name
    from ray.job_submission import JobStatus, JobSubmissionClient

    from anex_pipeline.orchestration.ray_executor import _step_handler_class

    client = JobSubmissionClient(deployment.cluster.dashboard)
    args = SimpleNamespace(step_keys_to_execute=["generations"], run_id="0123abcd-run", known_state=None)
    context = SimpleNamespace(execute_step_args=args)
    submission = f"dagster-step-{get_k8s_object_name(args.run_id, 'generations')}"
    client.submit_job(entrypoint="sleep 600", submission_id=submission)
    handler = _step_handler_class()(client, None, None, None, None, None, None)
    wait_for(lambda: client.get_job_status(submission) == JobStatus.RUNNING, JOB_TIMEOUT_S, "the Ray job to run")
    assert handler.check_step_health(context).is_healthy

    client.stop_job(submission)
    wait_for(lambda: client.get_job_status(submission) == JobStatus.STOPPED, 60, "the Ray job to stop")
    health = handler.check_step_health(context)
    assert not health.is_healthy and "stopped outside Dagster" in health.unhealthy_reason
