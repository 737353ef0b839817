"""Batch API records for store tests: made directly (no service), written as the service before the
tables wrote them (into Dagster's key-value store), or put into the tables in bulk; the pages that
service's listings gave (its algorithm, kept as the specification the tables' listings must meet),
and the check that records it stored were all moved into the tables."""

from __future__ import annotations

import hashlib
import io
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
import sqlalchemy as sa

from anex_pipeline.batches import tables
from anex_pipeline.batches.objects import BatchError, BatchRecord, FileRecord, batch_event, new_id, now
from anex_pipeline.batches.store import Store, key_hash
from anex_pipeline.batches.tables import batch_row, batches, file_row, files

OWNER_A = key_hash("sk-store-alice")
OWNER_B = key_hash("sk-store-bob")
OWNER_C = "c" * 64  # an owner whose key is no longer configured
KEY_VALUE_PREFIX = "anex.batch_api."  # where the service before the tables kept its records


def upload(store: Store, owner: str = OWNER_A, text: str = '{"custom_id": "a"}\n', **more: Any) -> FileRecord:
    """A batch input file of ``owner``, stored through the store."""
    return store.add_file(owner, "in.jsonl", "batch", io.BytesIO(text.encode()), **more)


def batch_of(file: FileRecord, **fields: Any) -> BatchRecord:
    """A new batch record made from the file (not stored)."""
    return BatchRecord(
        id=new_id("batch_"),
        owner=file.owner,
        endpoint="/v1/chat/completions",
        input_file_id=file.id,
        completion_window="24h",
        created_at=now(),
        **fields,
    )


@dataclass
class OldRecords:
    """What a service before the tables had stored: every record, in the order it was made."""

    key_hashes: list[str] = field(default_factory=list)
    files: list[FileRecord] = field(default_factory=list)
    removed_files: list[FileRecord] = field(default_factory=list)  # their values are null
    batches: list[BatchRecord] = field(default_factory=list)
    idempotency: dict[tuple[str, str], str] = field(default_factory=dict)  # (owner, key) -> batch id
    events: list[dict[str, Any]] = field(default_factory=list)  # {"event", "attempts", "next_at"}
    forgotten_events: list[str] = field(default_factory=list)  # their values are null


def key_value_entries(old: OldRecords) -> dict[str, str]:
    """The key-value entries that service wrote for these records, each value as it wrote it
    (``json.dumps`` of the record's ``model_dump()``, lists of ids in the order they were added,
    ``null`` for what was removed)."""
    entries: dict[str, Any] = {"keys": sorted(set(old.key_hashes))}
    for f in old.files:
        entries[f"file.{f.id}"] = f.model_dump()
        entries.setdefault(f"files.{f.owner}", []).append(f.id)
    for f in old.removed_files:
        entries[f"file.{f.id}"] = None
        entries.setdefault(f"files.{f.owner}", [])
    entries["expiring"] = [f.id for f in old.files if f.expires_at is not None]
    for b in old.batches:
        entries[f"batch.{b.id}"] = b.model_dump()
        entries.setdefault(f"batches.{b.owner}", []).append(b.id)
    entries["active"] = [b.id for b in old.batches if not b.finished]
    for (owner, key), batch_id in old.idempotency.items():
        entries[f"idempotency.{owner}.{hashlib.sha256(key.encode()).hexdigest()}"] = batch_id
    for pending in old.events:
        entries[f"event.{pending['event']['id']}"] = pending
    for event_id in old.forgotten_events:
        entries[f"event.{event_id}"] = None
    entries["events"] = [p["event"]["id"] for p in old.events]
    return {KEY_VALUE_PREFIX + name: json.dumps(value) for name, value in entries.items()}


def write_old_records(instance: dg.DagsterInstance, work_root: Path, old: OldRecords) -> None:
    """Writes the records into the instance's key-value store as that service did (one pair per
    call), and the files' bytes and the batches' input copies into the work root."""
    for key, value in key_value_entries(old).items():
        instance.run_storage.set_cursor_values({key: value})
    files_dir = work_root / "batch-api" / "files"
    files_dir.mkdir(parents=True, exist_ok=True)
    for f in old.files:
        (files_dir / f.id).write_bytes(b"x" * f.bytes)
    copies = work_root / "batch-api" / "batches"
    copies.mkdir(parents=True, exist_ok=True)
    for b in old.batches:
        (copies / f"{b.id}.jsonl").write_bytes(b"x")


def insert_batches(store: Store, records: Sequence[BatchRecord], chunk: int = 1000) -> None:
    """Puts many batches straight into the table, in their order (for listings of thousands;
    :meth:`Store.add_batch` makes an input copy and commits once per batch)."""
    with store.db.writing() as conn:
        for start in range(0, len(records), chunk):
            conn.execute(sa.insert(batches), [batch_row(r) for r in records[start : start + chunk]])


def insert_files(store: Store, records: Sequence[FileRecord]) -> None:
    """Puts files' records straight into the table, in their order (their upload order), with the
    creation times they carry, and writes their bytes."""
    with store.db.writing() as conn:
        conn.execute(sa.insert(files), [file_row(r) for r in records])
    for r in records:
        store.content_path(r.id).parent.mkdir(parents=True, exist_ok=True)
        store.content_path(r.id).write_bytes(b"x" * r.bytes)


def ids(records: Iterable[FileRecord | BatchRecord]) -> list[str]:
    return [r.id for r in records]


def file_record(owner: str, created_at: int, purpose: str = "batch", expires_at: int | None = None) -> FileRecord:
    return FileRecord(
        id=new_id("file-"),
        owner=owner,
        filename="f.jsonl",
        purpose=purpose,
        bytes=3,
        created_at=created_at,
        expires_at=expires_at,
    )


def old_files_page(
    made: Sequence[FileRecord], owner: str, purpose: str | None, newest_first: bool, after: str | None, limit: int
) -> tuple[list[str], bool]:
    """The page the key-value store gave (its algorithm, as it was): the owner's live files of the
    purpose, sorted by creation time in upload order, reversed for newest first."""
    at = time.time()
    records = [r for r in made if r.owner == owner and not r.expired(at) and purpose in (None, r.purpose)]
    records.sort(key=lambda r: r.created_at)
    if newest_first:
        records.reverse()
    names = [r.id for r in records]
    start = names.index(after) + 1 if after in names else 0 if after is None else len(names)
    return names[start : start + limit], start + limit < len(names)


def old_batches_page(made: Sequence[BatchRecord], owner: str, after: str | None, limit: int) -> tuple[list[str], bool]:
    """The page of batches the key-value store gave: the owner's in reverse creation order."""
    names = [b.id for b in reversed(made) if b.owner == owner]
    start = names.index(after) + 1 if after in names else 0 if after is None else len(names)
    return names[start : start + limit], start + limit < len(names)


def old_records() -> OldRecords:
    """What a service before the tables stored for three owners (one whose key is gone)."""
    t = now() - 600
    old = OldRecords(key_hashes=[OWNER_A, OWNER_B])
    f1, f2 = file_record(OWNER_A, t), file_record(OWNER_A, t)  # made in the same second
    expired = file_record(OWNER_A, t + 1, expires_at=t + 2)
    g1, h1 = file_record(OWNER_B, t + 1), file_record(OWNER_C, t + 2)
    gone = file_record(OWNER_A, t + 3)
    b1 = batch_of(f1).model_copy(update={"created_at": t + 5, "job_id": "job-b1", "in_progress_at": t + 6})
    b2 = batch_of(f2).model_copy(update={"created_at": t + 6, "metadata": {"k": "v"}, "completed_at": t + 9})
    out = file_record(OWNER_A, t + 9, "batch_output", expires_at=now() + 3600).model_copy(update={"batch_id": b2.id})
    b2 = b2.model_copy(update={"output_file_id": out.id})
    b3 = batch_of(f1).model_copy(
        update={"created_at": t + 7, "errors": [BatchError(code="x", message="y", line=2)], "failed_at": t + 8}
    )
    c1 = batch_of(g1).model_copy(update={"created_at": t + 6, "cancelled_at": t + 7})
    d1 = batch_of(h1).model_copy(update={"created_at": t + 8})
    old.files = [f1, f2, expired, g1, h1, out]
    old.removed_files = [gone]
    old.batches = [b1, b2, c1, b3, d1]
    old.idempotency = {(OWNER_A, "order-17"): b1.id}
    done = {"event": batch_event(b2.id, "completed"), "attempts": 2, "next_at": time.time() + 100}
    old.events = [done, {"event": batch_event(c1.id, "cancelled"), "attempts": 0, "next_at": 0.0}]
    old.forgotten_events = ["evt_sent"]
    return old


def assert_moved(store: Store, old: OldRecords) -> None:
    """Every record of ``old`` is in the store, whole, in its order, and nothing else is."""
    f1, f2, expired, g1, h1, out = old.files
    b1, b2, _, b3, d1 = old.batches
    assert store.key_hashes() == {OWNER_A, OWNER_B}
    for owner in (OWNER_A, OWNER_B, OWNER_C):
        for purpose in (None, "batch", "batch_output"):
            for newest_first in (True, False):
                for after in (None, f1.id, f2.id, out.id):
                    for limit in (1, 2, 10):
                        got, more = store.files(owner, purpose, newest_first, after, limit)
                        want = old_files_page(old.files, owner, purpose, newest_first, after, limit)
                        assert (ids(got), more) == want
        for after in (None, b1.id, b3.id):
            for limit in (1, 2, 10):
                got_batches, more = store.batches(owner, after, limit)
                assert (ids(got_batches), more) == old_batches_page(old.batches, owner, after, limit)
    for f in (f1, f2, g1, h1, out):
        assert store.file(f.owner, f.id) == f
    assert store.file(OWNER_A, expired.id) is None and store.expired_files(time.time()) == [expired]
    assert store.file(OWNER_A, old.removed_files[0].id) is None
    for b in old.batches:
        assert store.batch(b.id, b.owner) == b
    assert store.unfinished() == [b1, d1]
    assert store.batch_for_key(OWNER_A, "order-17") == b1 and store.in_use(f1.id) == b1
    assert store.delivered_by(b2) == [out]
    assert store.pending_events() == old.events
    with store.db.reading() as conn:
        counted = {t.name: conn.execute(sa.select(sa.func.count()).select_from(t)).scalar() for t in _record_tables()}
    assert counted == {
        tables.files.name: 6,
        tables.batches.name: 5,
        tables.api_keys.name: 2,
        tables.idempotency_keys.name: 1,
        tables.webhook_events.name: 2,
    }


def _record_tables() -> list[sa.Table]:
    return [tables.files, tables.batches, tables.api_keys, tables.idempotency_keys, tables.webhook_events]
