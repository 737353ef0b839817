"""Where the Batch API keeps what must survive a restart.

Records (files, batches, the hashed API keys, idempotency keys and the indexes that list them) are
JSON values in the Dagster instance's own key-value store (``run_storage.set_cursor_values``),
which works on SQLite and PostgreSQL alike. File contents live on disk under the storage
resource's work root, in ``batch-api/files/``. One service process per instance: every access to
the store goes through one lock of this process, so that a read-modify-write of a record is whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import dagster as dg

from anex_pipeline import metrics
from anex_pipeline.batches.objects import BatchRecord, FileRecord, batch_event, new_id, now
from anex_pipeline.workdir import layout

PREFIX = "anex.batch_api."
HASH_PREFIX = "sha256:"


def key_hash(api_key: str) -> str:
    """How an API key is stored and how its owner is named: the sha256 of the key."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def configured_hash(entry: str) -> str:
    """The hash of a configured key: ``sha256:<hex>`` is taken as it is, anything else is hashed."""
    if entry.startswith(HASH_PREFIX):
        return entry[len(HASH_PREFIX) :].lower()
    return key_hash(entry)


class Store:
    def __init__(self, instance: dg.DagsterInstance, work_root: Path | str):
        self._kv = instance.run_storage
        self.root = Path(work_root).expanduser() / layout.BATCH_API_DIR
        self._lock = threading.RLock()
        # Held by a new batch from the check that its input file exists to its registration (see
        # add_batch), and by a delete from its check that no unfinished batch uses the file to its
        # removal: of a batch made from a file and a delete of it, exactly one succeeds.
        self.inputs = threading.Lock()
        # With webhooks on, a batch that ends keeps an event to send (see batch_api.webhooks);
        # ``event_added`` wakes the sender.
        self.keep_events = False
        self.event_added = threading.Event()

    # -- key-value helpers ------------------------------------------------------------------------
    def _get_many(self, keys: Iterable[str]) -> dict[str, Any]:
        with self._lock:
            found = self._kv.get_cursor_values({PREFIX + k for k in keys})
        return {k[len(PREFIX) :]: json.loads(v) for k, v in found.items()}

    def _get(self, key: str) -> Any:
        return self._get_many([key]).get(key)

    def _set(self, key: str, value: Any) -> None:
        # One pair per call: Dagster's upsert of several pairs drops the new ones when any exists.
        with self._lock:
            self._kv.set_cursor_values({PREFIX + key: json.dumps(value)})

    def _edit_list(self, key: str, change: Callable[[list[str]], list[str]]) -> None:
        with self._lock:
            self._set(key, change(self._get(key) or []))

    # -- API keys ---------------------------------------------------------------------------------
    def set_keys(self, api_keys: Iterable[str]) -> None:
        """Makes these keys (raw, or ``sha256:<hex>``) the valid ones; only their hashes are kept."""
        self._set("keys", sorted({configured_hash(k) for k in api_keys}))

    def key_hashes(self) -> frozenset[str]:
        return frozenset(self._get("keys") or [])

    # -- files ------------------------------------------------------------------------------------
    def content_path(self, file_id: str) -> Path:
        return self.root / "files" / file_id

    def add_file(
        self,
        owner: str,
        filename: str,
        purpose: str,
        source: IO[bytes] | Path,
        *,
        expires_after_s: int | None = None,
        batch_id: str | None = None,
    ) -> FileRecord:
        """Stores the bytes of a file (a stream, or a finished file that is moved in) and its record;
        with ``expires_after_s`` the file is gone that many seconds after it was made."""
        file_id = new_id("file-")
        target = self.content_path(file_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, Path):
            os.replace(source, target)
        else:
            tmp = target.with_name(f".{file_id}.partial")
            with tmp.open("wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, target)
        created = now()
        record = FileRecord(
            id=file_id,
            owner=owner,
            filename=filename,
            purpose=purpose,
            bytes=target.stat().st_size,
            created_at=created,
            expires_at=None if expires_after_s is None else created + expires_after_s,
            batch_id=batch_id,
        )
        with self._lock:
            self._set(f"file.{file_id}", record.model_dump())
            self._edit_list(f"files.{owner}", lambda ids: [*ids, file_id])
            if record.expires_at is not None:
                self._edit_list("expiring", lambda ids: [*ids, file_id])
        return record

    def file(self, owner: str, file_id: str) -> FileRecord | None:
        """The file if it exists, has not expired and belongs to ``owner``; None otherwise (the
        three look alike)."""
        raw = self._get(f"file.{file_id}")
        record = FileRecord.model_validate(raw) if raw else None
        if record is None or record.owner != owner or record.expired(time.time()):
            return None
        return record

    def files(
        self, owner: str, purpose: str | None, newest_first: bool, after: str | None, limit: int
    ) -> tuple[list[FileRecord], bool]:
        """A page of the owner's live files (of one purpose, if given) by creation time, starting
        after the file ``after``."""
        ids = self._get(f"files.{owner}") or []
        found = self._get_many(f"file.{i}" for i in ids)
        at = time.time()
        records = [
            r
            for i in ids
            if (raw := found.get(f"file.{i}"))
            and not (r := FileRecord.model_validate(raw)).expired(at)
            and purpose in (None, r.purpose)
        ]
        records.sort(key=lambda r: r.created_at)  # stable: files made in the same second keep upload order
        if newest_first:
            records.reverse()
        names = [r.id for r in records]
        start = names.index(after) + 1 if after in names else 0 if after is None else len(names)
        return records[start : start + limit], start + limit < len(records)

    def delivered_by(self, batch: BatchRecord) -> list[FileRecord]:
        """The files stored as the output or error file of this batch."""
        ids = self._get(f"files.{batch.owner}") or []
        found = self._get_many(f"file.{i}" for i in ids)
        records = [FileRecord.model_validate(raw) for i in ids if (raw := found.get(f"file.{i}"))]
        return [r for r in records if r.batch_id == batch.id]

    def expired_files(self, at: float) -> list[FileRecord]:
        """Files whose expiry time has come (still stored until :meth:`remove_file`)."""
        ids = self._get("expiring") or []
        found = self._get_many(f"file.{i}" for i in ids)
        records = [FileRecord.model_validate(raw) for i in ids if (raw := found.get(f"file.{i}"))]
        return [r for r in records if r.expired(at)]

    def remove_file(self, record: FileRecord) -> None:
        """Removes the file's bytes and its record (the key-value store has no delete: the
        record's value becomes null, which reads as absent)."""
        self.content_path(record.id).unlink(missing_ok=True)
        with self._lock:
            self._set(f"file.{record.id}", None)
            self._edit_list(f"files.{record.owner}", lambda ids: [i for i in ids if i != record.id])
            self._edit_list("expiring", lambda ids: [i for i in ids if i != record.id])

    def in_use(self, file_id: str) -> BatchRecord | None:
        """An unfinished batch made from this input file, if there is one."""
        return next((r for r in self.unfinished() if r.input_file_id == file_id), None)

    def scratch(self, name: str) -> Path:
        """A path for a file being written that will become a stored file (see :meth:`add_file`)."""
        path = self.root / "scratch" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    # -- batches ----------------------------------------------------------------------------------
    def input_path(self, batch_id: str) -> Path:
        """The batch's own copy of its input: the job's id is made from this file's name."""
        return self.root / "batches" / f"{batch_id}.jsonl"

    def _idempotency_marker(self, owner: str, idempotency_key: str) -> str:
        return f"idempotency.{owner}.{hashlib.sha256(idempotency_key.encode()).hexdigest()}"

    def batch_for_key(self, owner: str, idempotency_key: str) -> BatchRecord | None:
        """The batch this owner created earlier with this idempotency key, if any."""
        earlier = self._get(self._idempotency_marker(owner, idempotency_key))
        return None if earlier is None else self.batch(earlier)

    def output_path(self, batch_id: str) -> Path:
        """Where the batch's job publishes its whole result (and its report beside it)."""
        return self.root / "batches" / f"{batch_id}.results.jsonl"

    def drop_batch_copies(self, batch_id: str) -> None:
        """Removes the batch's own copies of its input and its whole result (its report stays:
        it holds only counts and usage, which the batch object keeps showing)."""
        self.input_path(batch_id).unlink(missing_ok=True)
        self.output_path(batch_id).unlink(missing_ok=True)

    def add_batch(self, record: BatchRecord, idempotency_key: str | None) -> BatchRecord:
        """Registers a new batch with its own copy of its input file (a hard link when the file
        system allows it, so that :attr:`inputs` is held for no time), or returns the one made
        earlier with the same idempotency key. The caller holds :attr:`inputs`."""
        copy = self.input_path(record.id)
        copy.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(self.content_path(record.input_file_id), copy)
        except OSError:
            shutil.copyfile(self.content_path(record.input_file_id), copy)
        with self._lock:
            if idempotency_key is not None and (earlier := self.batch_for_key(record.owner, idempotency_key)):
                copy.unlink()
                return earlier
            self.put_batch(record)
            self._edit_list(f"batches.{record.owner}", lambda ids: [*ids, record.id])
            self._edit_list("active", lambda ids: [*ids, record.id])
            if idempotency_key is not None:
                self._set(self._idempotency_marker(record.owner, idempotency_key), record.id)
            return record

    def put_batch(self, record: BatchRecord) -> None:
        self._set(f"batch.{record.id}", record.model_dump())
        if record.finished:
            self._edit_list("active", lambda ids: [i for i in ids if i != record.id])

    def update_batch(self, batch_id: str, **changes: Any) -> BatchRecord:
        """Re-reads the record and applies changes, so the worker and a cancel never undo each other.
        A batch that ends here gets its webhook event (stored first: a service that dies between
        the two writes ends the batch again at its next start, and sends a second event rather
        than none), and counts in the metrics."""
        with self._lock:
            before = BatchRecord.model_validate(self._get(f"batch.{batch_id}"))
            record = before.model_copy(update=changes)
            ended = record.finished and not before.finished
            if ended and self.keep_events:
                self._add_event(batch_event(record.id, record.status))
            self.put_batch(record)
        if ended:
            metrics.BATCHES_FINISHED.labels(record.status).inc()
        return record

    # -- webhook events ---------------------------------------------------------------------------
    def _add_event(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._set(f"event.{event['id']}", {"event": event, "attempts": 0, "next_at": 0.0})
            self._edit_list("events", lambda ids: [*ids, event["id"]])
        self.event_added.set()

    def pending_events(self) -> list[dict[str, Any]]:
        """Events not delivered yet, oldest first: ``{"event", "attempts", "next_at"}``."""
        ids = self._get("events") or []
        found = self._get_many(f"event.{i}" for i in ids)
        return [found[f"event.{i}"] for i in ids if found.get(f"event.{i}")]

    def retry_event(self, event_id: str, attempts: int, next_at: float) -> dict[str, Any] | None:
        """Records a failed attempt; the event as pending now (None if it is gone)."""
        with self._lock:
            pending = self._get(f"event.{event_id}")
            if not pending:
                return None
            pending.update(attempts=attempts, next_at=next_at)
            self._set(f"event.{event_id}", pending)
            return pending

    def forget_event(self, event_id: str) -> None:
        with self._lock:
            self._set(f"event.{event_id}", None)
            self._edit_list("events", lambda ids: [i for i in ids if i != event_id])

    def batch(self, batch_id: str, owner: str | None = None) -> BatchRecord | None:
        """The batch (if ``owner`` is given: only when it belongs to that owner)."""
        raw = self._get(f"batch.{batch_id}")
        record = BatchRecord.model_validate(raw) if raw else None
        if record is None or (owner is not None and record.owner != owner):
            return None
        return record

    def batches(self, owner: str, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """A page of the owner's batches, newest first, starting after the batch ``after``."""
        ids = list(reversed(self._get(f"batches.{owner}") or []))
        start = ids.index(after) + 1 if after in ids else 0 if after is None else len(ids)
        page = ids[start : start + limit]
        found = self._get_many(f"batch.{i}" for i in page)
        records = [BatchRecord.model_validate(found[f"batch.{i}"]) for i in page]
        return records, start + limit < len(ids)

    def unfinished(self) -> list[BatchRecord]:
        """Batches that were not finished, oldest first (what a restarted service takes up again)."""
        return [r for i in self._get("active") or [] if (r := self.batch(i)) is not None and not r.finished]
