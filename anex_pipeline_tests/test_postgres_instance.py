"""The production instance config (deploy/dagster.yaml) against a real PostgreSQL server.

A PostgreSQL server from the machine's own binaries (Debian's ``postgresql`` package, which
scripts/ensure_postgres.sh installs) is started on loopback in a temporary folder, deploy/dagster.yaml
is loaded as the Dagster instance with its connection details in the environment, and a job runs
through :class:`~anex_pipeline.runner.JobRunner` on the fake engine. The runs, the materializations
and the "gpu" pool then have to be in PostgreSQL itself, read back with plain SQL.

Without the binaries the test is skipped on a developer machine, and fails under CI (``CI`` set),
where the setup must have installed them.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage

from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.testing import fake_engine
from anex_pipeline_tests.harness.jobs import REPO, chat_row, read_jsonl, run_job, write_jsonl
from anex_pipeline_tests.harness.postgres_server import Server, create_database, required_postgres

DEPLOY_DAGSTER_YAML = REPO / "deploy" / "dagster.yaml"


@pytest.fixture(scope="module")
def postgres() -> Iterator[Server]:
    with required_postgres() as server:
        yield server


@pytest.fixture
def database(postgres: Server) -> str:
    """A fresh database for one test, created over TCP with the password, as Dagster connects."""
    return create_database(postgres)


@pytest.fixture
def dagster_home(tmp_path: Path, postgres: Server, database: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A DAGSTER_HOME holding deploy/dagster.yaml as it is, with its settings in the environment."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copyfile(DEPLOY_DAGSTER_YAML, home / "dagster.yaml")
    settings = {
        "DAGSTER_PG_HOST": postgres.host,
        "DAGSTER_PG_PORT": str(postgres.port),
        "DAGSTER_PG_USER": postgres.user,
        "DAGSTER_PG_PASSWORD": postgres.password,
        "DAGSTER_PG_DB": database,
        "DAGSTER_K8S_NAMESPACE": "anex",
    }
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    return home


@pytest.mark.postgres
def test_a_job_runs_on_the_production_instance_and_lands_in_postgres(
    tmp_path: Path, dagster_home: Path, postgres: Server, database: str
) -> None:
    rows = [chat_row(f"r-{i}", f"question number {i}") for i in range(12)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"

    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        assert isinstance(instance.run_storage, PostgresRunStorage)
        assert isinstance(instance.event_log_storage, PostgresEventLogStorage)
        runner = JobRunner(instance, StorageResource(work_root=str(tmp_path / "work")), fake_engine())
        report = run_job(runner, src, out, {"shards": 2})
        job_id = report.job_id

    assert report.status == "completed"
    assert [line["custom_id"] for line in read_jsonl(out)] == [f"r-{i}" for i in range(12)]

    # What Dagster wrote is in PostgreSQL: submit, estimate, one run per shard, finish.
    conn = postgres.connect(database)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pipeline_name, status, partition FROM runs ORDER BY create_timestamp")
            runs = cur.fetchall()
            cur.execute("SELECT DISTINCT asset_key FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION'")
            materialized = {row[0] for row in cur.fetchall()}
            cur.execute("SELECT partition FROM dynamic_partitions WHERE partitions_def_name = 'jobs'")
            partitions = [row[0] for row in cur.fetchall()]
            cur.execute("SELECT concurrency_key, count(*) FROM concurrency_slots GROUP BY concurrency_key")
            pool_slots = dict(cur.fetchall())
    finally:
        conn.close()

    assert [(name, status) for name, status, _ in runs] == [
        ("submit_job", "SUCCESS"),
        ("estimate_job", "SUCCESS"),
        ("shard_job", "SUCCESS"),
        ("shard_job", "SUCCESS"),
        ("finish_job", "SUCCESS"),
    ]
    assert [partition for name, _, partition in runs if name == "shard_job"] == [f"{job_id}|00", f"{job_id}|01"]
    assert materialized >= {
        '["validated_input"]',
        '["length_estimate"]',
        '["generations"]',
        '["merged_result"]',
        '["result_file"]',
    }
    assert partitions == [job_id]
    # The "gpu" pool that generation steps run in has the limit deploy/dagster.yaml gives it.
    assert pool_slots == {"gpu": 1}

    # A second process loading the same config sees it all through Dagster as well.
    with dg.DagsterInstance.from_config(str(dagster_home)) as again:
        result = again.get_latest_materialization_event(dg.AssetKey("result_file"))
        assert result is not None and result.run_id in {r.run_id for r in again.get_runs()}
        assert again.get_runs_count() == 5
