"""A throwaway PostgreSQL server on loopback, from the machine's own binaries (Debian's
``postgresql`` package, which scripts/ensure_postgres.sh installs), for the PostgreSQL instance
test and the instance scale benchmark."""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg2
import pytest

from anex_pipeline_tests.harness.ports import free_port

# The OS user that runs the server when we run as root (initdb and postgres refuse root);
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


@contextmanager
def running_postgres(bin_dir: Path, *, fsync: bool = False) -> Iterator[Server]:
    """A server in a temporary folder for as long as the block runs (``fsync`` off by default:
    tests need no durability; a benchmark of what production does turns it on)."""
    # initdb and postgres refuse to run as root: as root, the server runs as the postgres user,
    # in a folder that user owns (pytest's own temp folders are private to root).
    as_user: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="anex-pg-"))
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam(SERVER_USER)
        except KeyError:
            raise RuntimeError(
                f"running as root needs the OS user {SERVER_USER!r} (Debian's postgresql package creates it)"
            ) from None
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
    server_options = f"-h {server.host} -p {server.port} -k {base} -c fsync={'on' if fsync else 'off'}"
    run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(base / "server.log"), "-o", server_options, "-w", "start")
    try:
        yield server
    finally:
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)


@contextmanager
def required_postgres() -> Iterator[Server]:
    """A running server from the machine's binaries. Without them the test is skipped, except
    under CI, where it must run and so fails."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        message = "no PostgreSQL server binaries (initdb) found; scripts/ensure_postgres.sh installs them"
        if os.environ.get("CI"):
            pytest.fail(f"{message}, and under CI this test must run, not be skipped")
        pytest.skip(message)
    with running_postgres(bin_dir) as server:
        yield server


def create_database(server: Server) -> str:
    """A fresh database, created over TCP with the password, as Dagster connects; returns its name."""
    name = f"anex_{secrets.token_hex(4)}"
    conn = server.connect("postgres")
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name}")
    finally:
        conn.close()
    return name
