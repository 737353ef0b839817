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

import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import psycopg2
import pytest
from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage

from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.conftest import chat_row, read_jsonl, run_job, write_jsonl
from anex_pipeline_tests.fakes import FakeEngineResource

DEPLOY_DAGSTER_YAML = Path(__file__).resolve().parents[1] / "deploy" / "dagster.yaml"
# The OS user that runs the server when the tests run as root (initdb and postgres refuse root);
# Debian's postgresql package creates it.
SERVER_USER = "postgres"


@dataclass(frozen=True)
class Server:
    host: str
    port: int
    user: str
    password: str

    def connect(self, dbname: str) -> psycopg2.extensions.connection:
        return psycopg2.connect(host=self.host, port=self.port, user=self.user, password=self.password, dbname=dbname)


def postgres_bin_dir() -> Path | None:
    """Where initdb, pg_ctl and postgres are: on PATH, or the newest /usr/lib/postgresql/N/bin."""
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).resolve().parent
    found = [p.parent for p in Path("/usr/lib/postgresql").glob("*/bin/initdb")]
    found.sort(key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else -1)
    return found[-1] if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres() -> Iterator[Server]:
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        message = "no PostgreSQL server binaries (initdb) found; scripts/ensure_postgres.sh installs them"
        if os.environ.get("CI"):
            pytest.fail(f"{message}, and under CI this test must run, not be skipped")
        pytest.skip(message)

    # initdb and postgres refuse to run as root: as root, the server runs as the postgres user,
    # in a folder that user owns (pytest's own temp folders are private to root).
    as_user: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="anex-pg-"))
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam(SERVER_USER)
        except KeyError:
            pytest.fail(f"running as root needs the OS user {SERVER_USER!r} (Debian's postgresql package creates it)")
        os.chown(base, owner.pw_uid, owner.pw_gid)
        as_user = ["runuser", "-u", SERVER_USER, "--"]

    server = Server("127.0.0.1", free_port(), "anex", secrets.token_hex(12))
    password_file = base / "password"
    password_file.write_text(server.password)
    if as_user:
        os.chown(password_file, owner.pw_uid, owner.pw_gid)
    data = base / "data"

    def run(*args: str) -> None:
        done = subprocess.run([*as_user, *args], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            log = (base / "server.log").read_text() if (base / "server.log").exists() else ""
            raise RuntimeError(f"{args[0]} failed ({done.returncode}): {done.stdout}{done.stderr}{log}")

    run(
        str(bin_dir / "initdb"),
        "-D", str(data),
        "-U", server.user,
        f"--pwfile={password_file}",
        "--auth-host=scram-sha-256",
        "--auth-local=trust",
        "--locale=C",
        "-E", "UTF8",
        "--no-sync",
    )  # fmt: skip
    server_options = f"-h {server.host} -p {server.port} -k {base} -c fsync=off"
    run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(base / "server.log"), "-o", server_options, "-w", "start")
    try:
        yield server
    finally:
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def database(postgres: Server) -> str:
    """A fresh database for one test, created over TCP with the password, as Dagster connects."""
    name = f"anex_{secrets.token_hex(4)}"
    conn = postgres.connect("postgres")
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name}")
    finally:
        conn.close()
    return name


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


def test_a_job_runs_on_the_production_instance_and_lands_in_postgres(
    tmp_path: Path, dagster_home: Path, postgres: Server, database: str
) -> None:
    rows = [chat_row(f"r-{i}", f"question number {i}") for i in range(12)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"

    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        assert isinstance(instance.run_storage, PostgresRunStorage)
        assert isinstance(instance.event_log_storage, PostgresEventLogStorage)
        runner = JobRunner(instance, StorageResource(work_root=str(tmp_path / "work")), FakeEngineResource())
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
