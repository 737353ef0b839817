"""Processes racing on one Batch API store, as replicas of the service would: on SQLite (one
machine) and on a real PostgreSQL server on loopback (every replica's database).

Each race runs real processes (harness/store_racer.py) that go through their rounds together:
creates with one idempotency key, a cancel against a finalize, two expiries of one batch, a file's
delete against a batch made from it, claims of webhook events, stores opened at once on records of
the key-value store, and the take-over of a lease whose holder is SIGKILLed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster._core.instance.ref import InstanceRef

from anex_pipeline.batches.store import Store
from anex_pipeline_tests.harness.batch_records import (
    OWNER_A,
    assert_moved,
    batch_of,
    old_records,
    upload,
    write_old_records,
)
from anex_pipeline_tests.harness.postgres_server import Server, create_database, required_postgres
from anex_pipeline_tests.harness.store_racer import Racer


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[Server]:
    with required_postgres() as server:
        yield server


@pytest.fixture(
    params=[
        pytest.param("sqlite", marks=pytest.mark.subprocess),
        pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.subprocess]),
    ]
)
def home(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A Dagster home whose instance keeps its runs in SQLite, or in a fresh PostgreSQL database."""
    home = tmp_path / "home"
    home.mkdir()
    settings = "telemetry:\n  enabled: false\n"
    if request.param == "postgres":
        server: Server = request.getfixturevalue("postgres_server")
        url = f"postgresql+psycopg2://{server.user}:{server.password}@{server.host}:{server.port}/"
        settings += f'storage:\n  postgres:\n    postgres_url: "{url}{create_database(server)}"\n'
    (home / "dagster.yaml").write_text(settings)
    return home


@pytest.fixture
def store(home: Path) -> Iterator[Store]:
    """The store of the home's instance in this process (its tables made)."""
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        yield Store(instance, home.parent / "work")


def race(home: Path, *racers: tuple[str, dict[str, Any]]) -> list[Any]:
    """Runs each (action, arguments) in a process of its own, all released together and going
    through their rounds together; what each did."""
    folder = home.parent
    barrier = folder / f"barrier-{len(list(folder.glob('barrier-*')))}"
    barrier.mkdir()
    started = [
        Racer(
            home,
            folder / "work",
            action,
            folder / f"{barrier.name}-{n}.log",
            barrier=str(barrier),
            name=f"r{n}",
            parties=len(racers),
            **args,
        )
        for n, (action, args) in enumerate(racers)
    ]
    try:
        for racer in started:
            assert racer.line() == {"ready": True}
        for racer in started:
            racer.go()
        return [racer.result() for racer in started]
    finally:
        for racer in started:
            racer.kill()


def test_processes_creating_with_one_idempotency_key_make_one_batch(home: Path, store: Store) -> None:
    file = upload(store)
    keys = [f"order-{n}" for n in range(25)]
    args = {"owner": OWNER_A, "file_id": file.id, "keys": keys}
    first, second = race(home, ("create", args), ("create", args))
    for a, b in zip(first, second, strict=True):
        assert a["id"] == b["id"] and a["mine"] != b["mine"], (a, b)
    overlapped = sum(a["began"] < b["ended"] and b["began"] < a["ended"] for a, b in zip(first, second, strict=True))
    assert overlapped > 0, "no two creates ran at the same time: nothing raced"
    made = {a["id"] for a in first}
    assert {b.id for b in store.batches(OWNER_A, None, 100)[0]} == made
    assert {store.batch_for_key(OWNER_A, key).id for key in keys} == made  # type: ignore[union-attr]
    copies = {p.name for p in (store.root / "batches").iterdir()}
    assert copies == {f"{i}.jsonl" for i in made}  # the losers' copies are gone


def test_a_cancel_and_a_finalize_in_two_processes_lose_neither_change(home: Path, store: Store) -> None:
    file = upload(store)
    made = [store.add_batch(batch_of(file, in_progress_at=1), None).id for _ in range(25)]
    cancelled, saw_cancel = race(home, ("cancel", {"batch_ids": made}), ("finalize", {"batch_ids": made}))
    for batch_id in made:
        end = store.batch(batch_id)
        assert end is not None and end.finished and end.finalizing_at is not None
        if not cancelled[batch_id]:  # the cancel came before the end: it is kept
            assert end.cancelling_at is not None
        assert end.status == ("cancelled" if saw_cancel[batch_id] else "completed")
    events = {p["event"]["data"]["id"]: p["event"]["type"] for p in store.pending_events()}
    assert len(store.pending_events()) == len(made)  # one event a batch
    assert events == {i: f"batch.{store.batch(i).status}" for i in made}  # type: ignore[union-attr]


def test_a_batch_that_two_processes_expire_at_once_ends_once(home: Path, store: Store) -> None:
    file = upload(store)
    made = [store.add_batch(batch_of(file, in_progress_at=1), None).id for _ in range(25)]
    first, second = race(home, ("expire", {"batch_ids": made}), ("expire", {"batch_ids": made}))
    assert set(first.values()) == set(second.values()) == {"expired"}
    events = [p["event"] for p in store.pending_events()]
    assert sorted(e["data"]["id"] for e in events) == sorted(made)  # one event each
    assert {e["type"] for e in events} == {"batch.expired"}


def test_a_file_delete_and_a_batch_made_from_it_in_two_processes_never_both_succeed(home: Path, store: Store) -> None:
    files = [upload(store).id for _ in range(20)]
    args = {"owner": OWNER_A, "file_ids": files}
    made, deleted = race(home, ("make_from", args), ("delete", args))
    for file_id in files:
        (outcome, batch_id), gone = made[file_id], deleted[file_id]
        assert (outcome, gone) in {("created", 400), (404, "deleted")}, (outcome, gone)
        if outcome == "created":
            assert store.file(OWNER_A, file_id) is not None and store.input_path(batch_id).exists()
            assert store.in_use(file_id).id == batch_id  # type: ignore[union-attr]
        else:
            assert store.in_use(file_id) is None and not store.content_path(file_id).exists()


def test_each_event_is_claimed_by_one_process(home: Path, store: Store) -> None:
    store.keep_events = True
    file = upload(store)
    for _ in range(30):
        store.update_batch(store.add_batch(batch_of(file), None).id, completed_at=1)
    events = [p["event"]["id"] for p in store.pending_events()]
    first, second = race(home, ("claim", {"event_ids": events}), ("claim", {"event_ids": events}))
    assert not set(first) & set(second) and sorted(first + second) == sorted(events)


def test_processes_opening_old_records_at_once_move_them_once(home: Path) -> None:
    old = old_records()
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        write_old_records(instance, home.parent / "work", old)
    assert race(home, ("open_store", {}), ("open_store", {}), ("open_store", {})) == [True] * 3
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        assert_moved(Store(instance, home.parent / "work"), old)


def test_a_lease_is_taken_over_once_after_its_holder_is_killed(home: Path, store: Store) -> None:
    """The holder renews a 2 s lease until it is SIGKILLed; two processes trying to take the batch
    over meanwhile get it only once the lease has run out, and only one of them does."""
    batch = store.add_batch(batch_of(upload(store)), None)
    folder, ttl_s, dead = home.parent, 2.0, "holder-to-kill"
    holder = Racer(
        home,
        folder / "work",
        "hold",
        folder / "holder.log",
        barrier=str(folder),
        name="holder",
        parties=1,
        batch_id=batch.id,
        holder=dead,
        ttl_s=ttl_s,
    )
    barrier = folder / "takers"
    barrier.mkdir()
    args = {"batch_id": batch.id, "dead": dead, "within_s": 60, "barrier": str(barrier), "parties": 2}
    takers = [
        Racer(home, folder / "work", "take_over", folder / f"taker-{n}.log", name=f"t{n}", **args) for n in (0, 1)
    ]
    try:
        assert holder.line() == {"ready": True}
        holder.go()
        assert holder.line() == {"held": True}
        first_end = store.lease(batch.id)[1]  # type: ignore[index]
        while (held := store.lease(batch.id)) is not None and held[1] <= first_end:  # renewed, alive
            assert holder.process.poll() is None, holder.log.read_text()
            time.sleep(0.02)
        assert held is not None and held[0] == dead and not store.take_up(batch.id, "test", 60)
        for taker in takers:
            assert taker.line() == {"ready": True}
        holder.kill()
        ended = store.lease(batch.id)[1]  # type: ignore[index]  # the end of its last renewal
        for taker in takers:
            taker.go()
        outcomes = [taker.result() for taker in takers]
    finally:
        for racer in (holder, *takers):
            racer.kill()
    assert [o["won"] for o in outcomes].count(True) == 1, outcomes
    winner = next(o for o in outcomes if o["won"])
    assert winner["at"] >= ended  # not before the dead holder's lease ran out
    assert store.lease(batch.id)[0] == winner["holder"]  # type: ignore[index]
