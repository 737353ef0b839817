"""Two ``serve`` processes over one Dagster instance (SQLite, or a real PostgreSQL server on
loopback) and one work folder, as replicas of the Batch
API: either answers for every batch, a batch is worked on by the one replica that holds its lease,
and when that replica is SIGKILLed the other takes the batch over once the lease has run out and
finishes it, every row once."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.instance.ref import InstanceRef

from anex_pipeline.batches.store import Store
from anex_pipeline_tests.harness.batch_api import (
    KEY_A,
    KEY_B,
    client,
    content,
    rows,
    serve_process,
    submit,
    wait,
    wait_for_rows,
)
from anex_pipeline_tests.harness.jobs import write_jsonl
from anex_pipeline_tests.harness.postgres_server import Server, create_database, required_postgres
from anex_pipeline_tests.harness.webhooks import SECRET, receiving

LEASE_S = "2"


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[Server]:
    with required_postgres() as server:
        yield server


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def home(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The replicas' Dagster home (serve_process's), keeping runs and batches in SQLite or in a
    fresh database of a real PostgreSQL server on loopback."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    if request.param == "postgres":
        server: Server = request.getfixturevalue("postgres_server")
        url = f"postgresql+psycopg2://{server.user}:{server.password}@{server.host}:{server.port}/"
        storage = f'storage:\n  postgres:\n    postgres_url: "{url}{create_database(server)}"\n'
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n" + storage)
    monkeypatch.setenv("DAGSTER_HOME", str(home))  # for this process's look at the store
    return home


def holder(store: Store, batch_id: str) -> str:
    deadline = time.monotonic() + 30
    while (lease := store.lease(batch_id)) is None:
        assert time.monotonic() < deadline, "no replica took the batch up"
        time.sleep(0.05)
    return lease[0]


@pytest.mark.subprocess
def test_a_replica_takes_over_the_batch_of_a_sigkilled_one(tmp_path: Path, home: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(80))
    env = {"ANEX_BATCH_LEASE_S": LEASE_S}
    with serve_process(tmp_path, env=env) as (first, url_a), serve_process(tmp_path, env=env) as (second, url_b):
        by_port = {url.split(":")[2].split("/")[0]: process for process, url in ((first, url_a), (second, url_b))}
        alice_a, alice_b = client(url_a), client(url_b)
        with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
            store = Store(instance, tmp_path / "work")
            batch = submit(alice_a, src, {"max_tokens": 8, "checkpoint_rows": 2})
            wait_for_rows(alice_b, batch.id, 4)  # the other replica shows the batch's progress too
            first_holder = holder(store, batch.id)
            dead = by_port[first_holder.rsplit(":", 1)[1]]
            os.killpg(dead.pid, signal.SIGKILL)
            dead.wait(timeout=30)
            survivor = alice_b if dead is first else alice_a
            assert survivor.batches.retrieve(batch.id).status == "in_progress"
            done = wait(survivor, batch.id, timeout=90)
            assert done.status == "completed", done.errors
        answered = [r["custom_id"] for r in content(survivor, done.output_file_id)]
        assert answered == [f"r{i}" for i in range(80)]  # every row once, in order
        assert done.request_counts is not None and done.request_counts.completed == 80
        later = wait(survivor, submit(survivor, src, {"max_tokens": 4}).id)  # the survivor takes new work
        assert later.status == "completed"


@pytest.mark.subprocess
def test_two_replicas_serve_two_keys_as_one_service(tmp_path: Path, home: Path) -> None:
    """Creates, an idempotent retry, listings and a cancel spread over both replicas: every batch
    ends once, as it should, and each one's webhook event arrives once."""
    src = write_jsonl(tmp_path / "in.jsonl", rows(6))
    long = write_jsonl(tmp_path / "long.jsonl", rows(200))
    with receiving() as receiver:
        flags = ("--webhook-allowed-host", "127.0.0.1")
        env = {"ANEX_BATCH_LEASE_S": LEASE_S, "ANEX_WEBHOOK_URL": receiver.url, "ANEX_WEBHOOK_SECRET": SECRET}
        with (
            serve_process(tmp_path, *flags, env=env) as (_, url_a),
            serve_process(tmp_path, *flags, env=env) as (
                _,
                url_b,
            ),
        ):
            alice = {"a": client(url_a, KEY_A), "b": client(url_b, KEY_A)}
            bob = {"a": client(url_a, KEY_B), "b": client(url_b, KEY_B)}
            first = submit(alice["a"], src, {"max_tokens": 4})
            cancelled = submit(alice["b"], long, {"max_tokens": 8, "checkpoint_rows": 2})
            with src.open("rb") as f:
                uploaded = bob["b"].files.create(file=f, purpose="batch")
            once = [
                bob[side].batches.create(
                    input_file_id=uploaded.id,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                    extra_headers={"Idempotency-Key": "order-1"},
                )
                for side in ("b", "a")
            ]
            assert once[0].id == once[1].id  # the retry through the other replica gets the same batch
            wait_for_rows(alice["a"], cancelled.id, 2)
            alice["a"].batches.cancel(cancelled.id)  # through the replica that may not run it
            ended = {b.id: wait(alice[side], b.id) for side, b in (("b", first), ("a", cancelled))}
            ended[once[0].id] = wait(bob["a"], once[0].id)
            assert [ended[b.id].status for b in (first, cancelled, once[0])] == ["completed", "cancelled", "completed"]
            for side in ("a", "b"):  # both replicas list the same batches, each key its own
                assert [b.id for b in alice[side].batches.list().data] == [cancelled.id, first.id]
                assert [b.id for b in bob[side].batches.list().data] == [once[0].id]
            assert len(content(alice["b"], ended[first.id].output_file_id)) == 6
            unrun = ended[cancelled.id].request_counts
            assert unrun is not None and unrun.total == 200 and 0 < unrun.completed < 200
            receiver.wait_for(3)
        events = sorted((e["data"]["id"], e["type"]) for e in receiver.delivered())
        assert events == sorted(
            [(first.id, "batch.completed"), (cancelled.id, "batch.cancelled"), (once[0].id, "batch.completed")]
        )
