"""Makes the Batch API's tables, and moves in the records that earlier versions of the service kept
in Dagster's key-value store.

Those versions kept each record as a JSON value under ``anex.batch_api.<name>`` in the run
storage's key-value table (``kvs``), with the listings as JSON arrays of ids: ``file.<id>``,
``files.<owner>``, ``expiring``, ``batch.<id>``, ``batches.<owner>``, ``active``,
``idempotency.<owner>.<sha256 of the key>``, ``keys``, ``event.<id>`` and ``events``. A removed
file or forgotten event is the JSON ``null`` (that store has no delete).

The first process to open the store makes the tables and moves every record in one transaction,
under a lock, and notes that it did (in ``anex_batch_api_schema``): a second start, or replicas
starting at the same time, find the note and move nothing. The old values are left where they
are, untouched (nothing reads them any more). A tenant's files and batches keep the order their
lists gave them, so every listing pages through them as before.
"""

from __future__ import annotations

import heapq
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from anex_pipeline.batches import tables
from anex_pipeline.batches.database import Database
from anex_pipeline.batches.objects import BatchRecord, FileRecord
from anex_pipeline.batches.tables import batch_row, file_row

log = logging.getLogger("anex_pipeline.batch_api")

KEY_VALUE_PREFIX = "anex.batch_api."
VERSION = "1"
MOVED = "key_value_records_moved"  # the note that the move was made (its value: what was moved)

R = TypeVar("R", FileRecord, BatchRecord)


def prepare(db: Database) -> None:
    """Makes the tables and moves the key-value records in, once per database (and, after the
    first time, with one look per process)."""
    with db.preparing:
        if db.prepared:
            return
        with db.writing() as conn:
            db.lock(conn, tables.schema.name)
            tables.metadata.create_all(conn)
            moved = conn.execute(sa.select(tables.schema.c.value).where(tables.schema.c.name == MOVED)).scalar()
            if moved is None:
                counts = move_key_value_records(conn)
                conn.execute(
                    sa.insert(tables.schema),
                    [{"name": "version", "value": VERSION}, {"name": MOVED, "value": json.dumps(counts)}],
                )
                if any(counts.values()):
                    for table in tables.metadata.sorted_tables:  # the planner's statistics of the rows moved in
                        conn.exec_driver_sql(f"ANALYZE {table.name}")
                    log.info("Batch API records moved from the key-value store into tables: %s", counts)
        db.prepared = True


def move_key_value_records(conn: Connection) -> dict[str, int]:
    """Copies every record of the key-value store into the tables; how many of each kind."""
    from dagster._core.storage.runs.schema import KeyValueStoreTable as kvs

    rows = conn.execute(
        sa.select(kvs.c.key, kvs.c.value).where(kvs.c.key.startswith(KEY_VALUE_PREFIX, autoescape=True))
    ).all()
    values = {key[len(KEY_VALUE_PREFIX) :]: json.loads(value) for key, value in rows}
    records = {name: value for name, value in values.items() if value is not None}

    files = [FileRecord.model_validate(v) for k, v in records.items() if k.startswith("file.")]
    batches = [BatchRecord.model_validate(v) for k, v in records.items() if k.startswith("batch.")]
    ordered_files = _in_listed_order(files, values, "files")
    ordered_batches = _in_listed_order(batches, values, "batches")
    known = {b.id for b in batches}
    markers = []
    for name, batch_id in records.items():
        if name.startswith("idempotency.") and batch_id in known:
            owner, _, key_sha256 = name[len("idempotency.") :].partition(".")
            markers.append({"owner": owner, "key_sha256": key_sha256, "batch_id": batch_id})
    events = [v for k, v in records.items() if k.startswith("event.")]
    event_order = {event_id: n for n, event_id in enumerate(values.get("events") or [])}
    events.sort(key=lambda e: (event_order.get(e["event"]["id"], len(event_order)), e["event"]["created_at"]))

    keys = [{"hash": h} for h in sorted(set(values.get("keys") or []))]
    _insert(conn, tables.api_keys, keys)
    _insert(conn, tables.files, [file_row(f) for f in ordered_files])
    _insert(conn, tables.batches, [batch_row(b) for b in ordered_batches])
    _insert(conn, tables.idempotency_keys, markers)
    _insert(
        conn,
        tables.webhook_events,
        [
            {
                "id": e["event"]["id"],
                "event": json.dumps(e["event"]),
                "attempts": e["attempts"],
                "next_at": e["next_at"],
            }
            for e in events
        ],
    )
    return {
        "keys": len(keys),
        "files": len(files),
        "batches": len(batches),
        "idempotency_keys": len(markers),
        "webhook_events": len(events),
    }


def _in_listed_order(records: Sequence[R], values: Mapping[str, Any], kind: str) -> list[R]:
    """The records in the order the tables must number them: each owner's in the order of the
    owner's list (``files.<owner>``, ``batches.<owner>``; records missing from it after, by
    creation time), the owners' sequences merged by creation time."""
    by_owner: dict[str, list[R]] = {}
    for record in records:
        by_owner.setdefault(record.owner, []).append(record)
    sequences = []
    for owner, mine in by_owner.items():
        position = {record_id: n for n, record_id in enumerate(values.get(f"{kind}.{owner}") or [])}
        mine.sort(key=lambda r: (position.get(r.id, len(position)), r.created_at))
        sequences.append(mine)
    return list(heapq.merge(*sequences, key=lambda r: r.created_at))


def _insert(conn: Connection, table: sa.Table, rows: Iterable[dict[str, Any]], chunk: int = 500) -> None:
    """Inserts the rows in their order (which numbers them), ``chunk`` at a time."""
    rows = list(rows)
    for start in range(0, len(rows), chunk):
        conn.execute(sa.insert(table), rows[start : start + chunk])
