"""The Batch API's store on SQLite: every record operation, its listings page exactly as the
key-value store's did, threads racing on one record leave it whole, leases and event claims have
one holder, and records written before the tables move in once.

The same races between processes, on SQLite and PostgreSQL, are in test_batch_store_processes.py.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster._core.instance.ref import InstanceRef

from anex_pipeline.batches.leases import LeaseLost
from anex_pipeline.batches.objects import ApiError, BatchError, BatchRecord, FileRecord, now
from anex_pipeline.batches.store import Store, key_hash
from anex_pipeline.errors import RejectedError
from anex_pipeline_tests.harness.batch_records import (
    OWNER_A,
    OWNER_B,
    OldRecords,
    assert_moved,
    batch_of,
    file_record,
    ids,
    insert_batches,
    insert_files,
    old_batches_page,
    old_files_page,
    old_records,
    upload,
    write_old_records,
)


@pytest.fixture
def store(tmp_path: Path, instance: dg.DagsterInstance) -> Store:
    return Store(instance, tmp_path / "work")


def test_file_pages_are_the_ones_the_key_value_store_gave(store: Store) -> None:
    """Every page for every ``after`` (the owner's files, expired ones, another owner's, unknown),
    order, purpose and limit, over files with creation times that tie and go backwards."""
    past = now() - 1000
    made = [
        file_record(OWNER_A, past + 10),
        file_record(OWNER_A, past + 10, "batch_output"),
        file_record(OWNER_A, past + 5),  # the clock went back
        file_record(OWNER_B, past + 10),
        file_record(OWNER_A, past + 10),
        file_record(OWNER_A, past + 20, expires_at=past + 30),  # expired
        file_record(OWNER_A, past + 20, "batch_output", expires_at=now() + 3600),
        file_record(OWNER_A, past + 30),
        file_record(OWNER_A, past + 10),
    ]
    insert_files(store, made)
    afters = [None, *ids(made), "file-unknown"]
    for purpose in (None, "batch", "batch_output", ""):
        for newest_first in (True, False):
            for after in afters:
                for limit in (1, 2, 3, 10):
                    got, more = store.files(OWNER_A, purpose, newest_first, after, limit)
                    assert (ids(got), more) == old_files_page(made, OWNER_A, purpose, newest_first, after, limit), (
                        purpose,
                        newest_first,
                        after,
                        limit,
                    )
    assert store.files(OWNER_A, None, True, None, 100)[0][0] == made[7]  # the record itself, whole


def test_batch_pages_are_the_ones_the_key_value_store_gave(store: Store) -> None:
    file = upload(store)
    made = [batch_of(file) if n % 3 else batch_of(upload(store, OWNER_B)) for n in range(10)]
    insert_batches(store, made)
    for after in [None, *ids(made), "batch_unknown"]:
        for limit in (1, 2, 3, 20):
            got, more = store.batches(OWNER_A, after, limit)
            assert (ids(got), more) == old_batches_page(made, OWNER_A, after, limit), (after, limit)
    assert store.batches(OWNER_B, None, 1)[0] == [made[-1]]


def test_files_are_fetched_only_by_their_owner_while_live_and_removed_whole(store: Store) -> None:
    mine = upload(store, text="abc\n")
    soon = upload(store, expires_after_s=1)
    theirs = upload(store, OWNER_B)
    assert store.file(OWNER_A, mine.id) == mine and mine.bytes == 4
    assert store.content_path(mine.id).read_bytes() == b"abc\n"
    assert store.file(OWNER_B, mine.id) is None and store.file(OWNER_A, theirs.id) is None
    assert store.file(OWNER_A, "file-none") is None
    assert store.expired_files(soon.created_at) == []
    assert store.expired_files(soon.created_at + 1) == [soon]  # what prune removes
    store.remove_file(mine)
    assert store.file(OWNER_A, mine.id) is None and not store.content_path(mine.id).exists()


def test_a_batch_is_made_from_a_live_batch_file_of_its_owner_only(store: Store) -> None:
    mine = upload(store)
    output = store.add_file(OWNER_A, "out.jsonl", "batch_output", Path(_scratch(store, "out")))
    theirs = upload(store, OWNER_B)
    for file_id, status in ((theirs.id, 404), ("file-none", 404), (output.id, 400)):
        record = batch_of(mine).model_copy(update={"input_file_id": file_id})
        with pytest.raises(ApiError) as refused:
            store.add_batch(record, None)
        assert refused.value.status == status
        assert not store.input_path(record.id).exists() and store.batch(record.id) is None
    batch = store.add_batch(batch_of(mine, metadata={"team": "x"}), None)
    assert store.input_path(batch.id).read_bytes() == store.content_path(mine.id).read_bytes()
    assert store.batch(batch.id) == batch and store.batch(batch.id, OWNER_B) is None
    assert store.in_use(mine.id) == batch
    with pytest.raises(ApiError, match=f"is the input of batch {batch.id}, which is validating") as refused:
        store.remove_unused_file(OWNER_A, mine.id)
    assert refused.value.status == 400 and store.file(OWNER_A, mine.id) == mine
    with pytest.raises(ApiError) as missing:
        store.remove_unused_file(OWNER_B, mine.id)
    assert missing.value.status == 404
    store.update_batch(batch.id, cancelled_at=now())
    assert store.in_use(mine.id) is None and store.unfinished() == []
    assert store.remove_unused_file(OWNER_A, mine.id) == mine
    assert not store.content_path(mine.id).exists() and store.file(OWNER_A, mine.id) is None


def _scratch(store: Store, name: str) -> Path:
    path = store.scratch(name)
    path.write_bytes(b"out\n")
    return path


def test_updates_keep_every_change_and_a_finished_batch_stays_as_it_ended(store: Store) -> None:
    store.keep_events = True
    batch = store.add_batch(batch_of(upload(store)), None)
    store.update_batch(batch.id, job_id="job-1", in_progress_at=1)
    store.update_batch(batch.id, model="m")
    errors = [BatchError(code="job_failed", message="no", line=3)]
    ended = store.update_batch(batch.id, errors=errors, failed_at=2)
    assert ended.status == "failed" and (ended.job_id, ended.model, ended.errors) == ("job-1", "m", errors)
    assert store.batch(batch.id) == ended
    again = store.update_batch(batch.id, completed_at=3, expired_at=4)
    assert again == ended and store.batch(batch.id) == ended  # ended once: no second status, no second event
    assert [p["event"]["type"] for p in store.pending_events()] == ["batch.failed"]
    assert store.event_added.is_set()
    with pytest.raises(LookupError):
        store.update_batch("batch_none", model="m")


def test_keys_replace_the_stored_ones(store: Store) -> None:
    assert store.key_hashes() == frozenset()
    store.set_keys(["sk-1", "sha256:" + "A" * 64])
    assert store.key_hashes() == {key_hash("sk-1"), "a" * 64}
    store.set_keys(["sk-2"])
    assert store.key_hashes() == {key_hash("sk-2")}


# -- races between threads ------------------------------------------------------------------------


def race(parties: int, work: Callable[[int], Any]) -> list[Any]:
    """Runs ``work(n)`` on ``parties`` threads released together; their results in order."""
    start = threading.Barrier(parties, timeout=60)
    results: list[Any] = [None] * parties

    def run(n: int) -> None:
        start.wait()
        try:
            results[n] = work(n)
        except Exception as exc:  # the test looks at it
            results[n] = exc

    threads = [threading.Thread(target=run, args=(n,)) for n in range(parties)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a racing thread never ended"
    return results


def race_calls(*calls: Callable[[], Any]) -> list[Any]:
    """Runs each call on a thread of its own, released together; their results in order."""
    return race(len(calls), lambda n: calls[n]())


def test_creates_racing_with_one_idempotency_key_make_one_batch(store: Store) -> None:
    file = upload(store)
    for key in (f"key-{n}" for n in range(5)):
        records = [batch_of(file) for _ in range(6)]
        got = race(6, lambda n, key=key, records=records: store.add_batch(records[n], key))
        assert all(isinstance(g, BatchRecord) for g in got), got
        assert len({g.id for g in got}) == 1 and store.batch_for_key(OWNER_A, key) == got[0]
        for record in records:  # the others' input copies are gone
            assert store.input_path(record.id).exists() == (record.id == got[0].id)
    assert len(store.batches(OWNER_A, None, 100)[0]) == 5
    assert store.batch_for_key(OWNER_B, "key-0") is None  # keys are per owner


def test_a_file_delete_and_a_batch_made_from_it_never_both_succeed(store: Store) -> None:
    for _ in range(15):
        file = upload(store)
        record = batch_of(file)
        made, deleted = race_calls(
            functools.partial(store.add_batch, record, None),
            functools.partial(store.remove_unused_file, OWNER_A, file.id),
        )
        pair = (
            "made" if isinstance(made, BatchRecord) else getattr(made, "status", made),
            "deleted" if isinstance(deleted, FileRecord) else getattr(deleted, "status", deleted),
        )
        assert pair in {("made", 400), (404, "deleted")}, (made, deleted)
        if isinstance(made, BatchRecord):
            assert store.file(OWNER_A, file.id) == file and store.input_path(record.id).exists()
            store.update_batch(record.id, cancelled_at=now())
        else:
            assert store.batch(record.id) is None and not store.input_path(record.id).exists()
            assert not store.content_path(file.id).exists()


def finalize(store: Store, batch_id: str) -> BatchRecord:
    """What the worker's finalize does to the record: finalizing, then cancelled if it saw a
    cancel, else completed. The record as it was when finalizing began."""
    record = store.update_batch(batch_id, finalizing_at=now())
    store.update_batch(batch_id, **{"cancelled_at" if record.cancelling_at is not None else "completed_at": now()})
    return record


def test_a_cancel_and_a_finalize_racing_lose_neither_change(store: Store) -> None:
    store.keep_events = True
    file = upload(store)
    made = [store.add_batch(batch_of(file, in_progress_at=1), None) for _ in range(20)]
    for batch in made:
        cancelled, finalizing = race_calls(
            functools.partial(store.update_batch, batch.id, cancelling_at=now()),
            functools.partial(finalize, store, batch.id),
        )
        end = store.batch(batch.id)
        assert end is not None and end.finished and end.finalizing_at is not None
        assert end.cancelling_at is not None or cancelled.finished  # a cancel before the end is kept
        assert end.status == ("cancelled" if finalizing.cancelling_at is not None else "completed")
    events = [p["event"] for p in store.pending_events()]
    assert sorted(e["data"]["id"] for e in events) == sorted(ids(made))  # one event each


def test_cancels_racing_keep_the_first_ones_time(store: Store) -> None:
    file = upload(store)
    for _ in range(10):
        batch = store.add_batch(batch_of(file, in_progress_at=1), None)
        got = race(4, lambda n, batch=batch: store.update_batch(batch.id, cancelling_at=100 + n, once=True))
        kept = store.batch(batch.id)
        assert kept is not None and all(g.cancelling_at == kept.cancelling_at for g in got), got
    ended = store.update_batch(batch.id, cancelled_at=200)
    assert store.update_batch(batch.id, cancelling_at=300, once=True) == ended


def test_each_event_is_claimed_by_one_sender(store: Store) -> None:
    store.keep_events = True
    file = upload(store)
    for _ in range(30):
        store.update_batch(store.add_batch(batch_of(file), None).id, completed_at=now())
    events = [p["event"] for p in store.pending_events()]
    assert len(events) == 30
    claimed = race(4, lambda n: [e["id"] for e in events if store.claim_event(e["id"], f"sender-{n}", 300)])
    assert sorted(i for got in claimed for i in got) == sorted(e["id"] for e in events)  # each once, by one of them
    first = events[0]["id"]
    pending = {p["event"]["id"]: p for p in store.pending_events()}
    assert pending[first]["next_at"] > time.time() + 200  # claimed: not due for the others
    assert not store.claim_event(first, "sender-x", 300)
    assert store.retry_event(first, 1, 0.0) == {"event": events[0], "attempts": 1, "next_at": 0.0}
    assert store.claim_event(first, "sender-x", 300)  # the retry ended the claim
    for holder in [f"sender-{n}" for n in range(4)] + ["sender-x"]:
        store.release_claims(holder)
    assert all(p["next_at"] <= time.time() for p in store.pending_events())
    assert store.claim_event(first, "sender-y", 0.05)
    deadline = time.monotonic() + 10
    while not store.claim_event(first, "sender-z", 300):  # a claim nobody ends runs out
        assert time.monotonic() < deadline, "the claim never ran out"
        time.sleep(0.01)
    store.forget_event(first)
    assert store.retry_event(first, 2, 0.0) is None and first not in {p["event"]["id"] for p in store.pending_events()}
    later = events[1]["id"]
    store.retry_event(later, 1, time.time() + 3600)
    assert not store.claim_event(later, "sender-x", 300)  # not due yet


def test_a_lease_has_one_holder_and_is_taken_over_once_it_runs_out(store: Store) -> None:
    file = upload(store)
    batch = store.add_batch(batch_of(file), None)
    other = store.add_batch(batch_of(file), None)
    assert ids(store.unclaimed_batches()) == [batch.id, other.id]
    won = race(6, lambda n: store.take_up(batch.id, f"replica-{n}", 60))
    assert won.count(True) == 1
    holder = f"replica-{won.index(True)}"
    assert store.lease(batch.id) is not None and store.lease(batch.id)[0] == holder  # type: ignore[index]
    assert ids(store.unclaimed_batches()) == [other.id] and ids(store.unclaimed_batches(limit=1)) == [other.id]
    assert store.take_up(batch.id, holder, 60) and not store.take_up(batch.id, "replica-x", 60)
    assert store.renew(batch.id, holder, 60) and not store.renew(batch.id, "replica-x", 60)
    store.update_batch(batch.id, held_by=holder, model="m")
    with pytest.raises(LeaseLost):
        store.update_batch(batch.id, held_by="replica-x", model="n")
    store.release(batch.id, "replica-x")  # not its lease: nothing changes
    assert store.lease(batch.id)[0] == holder  # type: ignore[index]
    store.release(batch.id, holder)
    assert store.lease(batch.id) is None and store.take_up(batch.id, "replica-x", 0.2)

    until = store.lease(batch.id)[1]  # type: ignore[index]
    deadline = time.monotonic() + 10
    while not store.take_up(batch.id, "replica-y", 60):  # replica-x stopped renewing
        assert time.monotonic() < deadline, "the lease never ran out"
        time.sleep(0.01)
    assert time.time() >= until and not store.renew(batch.id, "replica-x", 60)
    store.update_batch(batch.id, completed_at=now())
    assert not store.take_up(batch.id, "replica-z", 60) and ids(store.unclaimed_batches()) == [other.id]
    assert not store.take_up("batch_none", "replica-z", 60)


# -- records written before the tables ------------------------------------------------------------


@pytest.fixture
def old_home(tmp_path: Path) -> Iterator[tuple[Path, OldRecords]]:
    """A Dagster home and work root holding what a service before the tables stored."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    old = old_records()
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        write_old_records(instance, work, old)
    yield home, old


def test_records_of_the_key_value_store_move_into_the_tables_once(old_home: tuple[Path, OldRecords]) -> None:
    home, old = old_home
    work = home.parent / "work"
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        store = Store(instance, work)
        assert_moved(store, old)
        assert store.content_path(old.files[0].id).exists() and store.input_path(old.batches[0].id).exists()
        file = upload(store)  # the store goes on from there
        store.add_batch(batch_of(file), "order-18")
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as again:
        store = Store(again, work)  # a second start moves nothing again
        assert len(store.batches(OWNER_A, None, 10)[0]) == 4 and store.batch_for_key(OWNER_A, "order-18")
        assert len(store.files(OWNER_A, None, True, None, 100)[0]) == 4  # three moved and live, one new


def test_stores_opened_at_once_move_the_records_once(old_home: tuple[Path, OldRecords]) -> None:
    home, old = old_home
    instances = [dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) for _ in range(3)]
    try:
        opened = race(3, lambda n: Store(instances[n], home.parent / "work"))
        assert all(isinstance(s, Store) for s in opened), opened
        assert len({id(s.db) for s in opened}) == 3  # three databases, as three processes have
        assert_moved(opened[0], old)
    finally:
        for instance in instances:
            instance.dispose()


# -- size ------------------------------------------------------------------------------------------


def test_ten_thousand_batches_of_one_key_list_fast(store: Store) -> None:
    file = upload(store)
    made = [batch_of(file, completed_at=1) for _ in range(10_000)]
    their_file = upload(store, OWNER_B)
    theirs = [batch_of(their_file) for _ in range(100)]
    insert_batches(store, [*made[:5000], *theirs, *made[5000:]])
    took = {}
    for name, after in (("first page", None), ("middle", made[5000].id), ("last page", made[99].id)):
        began = time.perf_counter()
        page, more = store.batches(OWNER_A, after, 100)
        took[name] = time.perf_counter() - began
        assert len(page) == (99 if name == "last page" else 100) and more == (name != "last page")
    began = time.perf_counter()
    assert len(store.files(OWNER_A, None, True, None, 10_000)[0]) == 1
    assert ids(store.unfinished()) == ids(theirs)
    took["unfinished and files"] = time.perf_counter() - began
    assert max(took.values()) < 1.0, took  # each page reads its rows only (about 0.01 s here)


def test_an_instance_in_memory_is_refused_in_one_line(tmp_path: Path) -> None:
    with dg.DagsterInstance.ephemeral() as instance, pytest.raises(RejectedError, match="is in memory") as refused:
        Store(instance, tmp_path)
    assert "\n" not in refused.value.message
