"""Where the Batch API keeps what must survive a restart, and what replicas of it share.

Records (files, batches, the hashed API keys, idempotency keys, webhook events, batch leases) are
rows of tables (:mod:`.tables`) in the Dagster instance's own database, SQLite or PostgreSQL
(:mod:`.database`); records an earlier version kept in Dagster's key-value store are moved in at
the first start (:mod:`.migration`). Every change is one transaction, so several processes on one
database (replicas of the service, the command line's ``prune`` and ``delete``) never undo each
other's: one ``Idempotency-Key`` gives one batch (a unique key), a batch made from a file and a
delete of that file never both succeed (the file's row is locked by both), a change to a batch
re-reads it under a lock, and a batch ends (with its webhook event) once. File contents live on
disk under the storage resource's work root, in ``batch-api/files/``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import dagster as dg
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from anex_pipeline import metrics
from anex_pipeline.batches.database import instance_database
from anex_pipeline.batches.events import WebhookEvents
from anex_pipeline.batches.leases import BatchLeases, LeaseLost
from anex_pipeline.batches.migration import prepare
from anex_pipeline.batches.objects import ApiError, BatchRecord, FileRecord, batch_event, new_id, not_found, now
from anex_pipeline.batches.tables import api_keys, as_batch, as_file, batch_row, batches, file_row, files
from anex_pipeline.batches.tables import idempotency_keys as idempotency
from anex_pipeline.workdir import layout

HASH_PREFIX = "sha256:"


def key_hash(api_key: str) -> str:
    """How an API key is stored and how its owner is named: the sha256 of the key."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def configured_hash(entry: str) -> str:
    """The hash of a configured key: ``sha256:<hex>`` is taken as it is, anything else is hashed."""
    if entry.startswith(HASH_PREFIX):
        return entry[len(HASH_PREFIX) :].lower()
    return key_hash(entry)


class Store(WebhookEvents, BatchLeases):
    def __init__(self, instance: dg.DagsterInstance, work_root: Path | str):
        self.db = instance_database(instance)
        prepare(self.db)
        self.root = Path(work_root).expanduser() / layout.BATCH_API_DIR
        # With webhooks on, a batch that ends keeps an event to send (see batch_api.webhooks);
        # ``event_added`` wakes this process's sender.
        self.keep_events = False
        self.event_added = threading.Event()

    # -- API keys ---------------------------------------------------------------------------------
    def set_keys(self, api_keys_given: Iterable[str]) -> None:
        """Makes these keys (raw, or ``sha256:<hex>``) the valid ones; only their hashes are kept."""
        hashes = sorted({configured_hash(k) for k in api_keys_given})
        with self.db.writing() as conn:
            self.db.lock(conn, api_keys.name)  # two starts at once: one set wins whole
            conn.execute(sa.delete(api_keys))
            if hashes:
                conn.execute(sa.insert(api_keys), [{"hash": h} for h in hashes])

    def key_hashes(self) -> frozenset[str]:
        with self.db.reading() as conn:
            return frozenset(conn.execute(sa.select(api_keys.c.hash)).scalars())

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
        with self.db.writing() as conn:
            conn.execute(sa.insert(files).values(file_row(record)))
        return record

    def file(self, owner: str, file_id: str) -> FileRecord | None:
        """The file if it exists, has not expired and belongs to ``owner``; None otherwise (the
        three look alike)."""
        with self.db.reading() as conn:
            return _owned(conn.execute(sa.select(files).where(files.c.id == file_id)).first(), owner)

    def files(
        self, owner: str, purpose: str | None, newest_first: bool, after: str | None, limit: int
    ) -> tuple[list[FileRecord], bool]:
        """A page of the owner's live files (of one purpose, if given) by creation time (files made
        in the same second in upload order), starting after the file ``after`` (none when that is
        not one of them)."""
        at = time.time()
        listed = [files.c.owner == owner, sa.or_(files.c.expires_at.is_(None), files.c.expires_at > at)]
        if purpose is not None:
            listed.append(files.c.purpose == purpose)
        order = (files.c.created_at, files.c.seq)
        query = sa.select(files).where(*listed)
        with self.db.reading() as conn:
            if after is not None:
                mark = conn.execute(sa.select(*order).where(*listed, files.c.id == after)).first()
                if mark is None:
                    return [], False
                created, seq = mark
                if newest_first:
                    query = query.where(sa.or_(order[0] < created, sa.and_(order[0] == created, order[1] < seq)))
                else:
                    query = query.where(sa.or_(order[0] > created, sa.and_(order[0] == created, order[1] > seq)))
            ordered = [c.desc() for c in order] if newest_first else list(order)
            rows = conn.execute(query.order_by(*ordered).limit(limit + 1)).all()
        return [as_file(r) for r in rows[:limit]], len(rows) > limit

    def delivered_by(self, batch: BatchRecord) -> list[FileRecord]:
        """The files stored as the output or error file of this batch."""
        query = sa.select(files).where(files.c.batch_id == batch.id, files.c.owner == batch.owner)
        with self.db.reading() as conn:
            return [as_file(r) for r in conn.execute(query.order_by(files.c.seq))]

    def expired_files(self, at: float) -> list[FileRecord]:
        """Files whose expiry time has come (still stored until :meth:`remove_file`)."""
        query = sa.select(files).where(files.c.expires_at.is_not(None), files.c.expires_at <= at)
        with self.db.reading() as conn:
            return [as_file(r) for r in conn.execute(query.order_by(files.c.seq))]

    def remove_file(self, record: FileRecord) -> None:
        """Removes the file's bytes and its record."""
        self.content_path(record.id).unlink(missing_ok=True)
        with self.db.writing() as conn:
            conn.execute(sa.delete(files).where(files.c.id == record.id))

    def remove_unused_file(self, owner: str, file_id: str) -> FileRecord:
        """Removes the owner's file unless an unfinished batch was made from it, and returns it: the
        check and the removal are one transaction, which a batch being made from the file waits
        for (or which waits for it). Raises the API's 404 when the owner has no such live file,
        its 400 when a batch uses it."""
        with self.db.writing() as conn:
            found = conn.execute(sa.select(files).where(files.c.id == file_id).with_for_update()).first()
            record = _owned(found, owner)
            if record is None:
                raise not_found("file", file_id)
            if (batch := self._in_use(conn, file_id)) is not None:
                raise ApiError(
                    400,
                    f"File {file_id} is the input of batch {batch.id}, which is {batch.status}; delete it "
                    "once the batch has finished, or cancel the batch.",
                    param="file_id",
                )
            conn.execute(sa.delete(files).where(files.c.id == file_id))
        # Only once the removal is committed: until then a batch being made may still link the bytes.
        self.content_path(file_id).unlink(missing_ok=True)
        return record

    def in_use(self, file_id: str) -> BatchRecord | None:
        """An unfinished batch made from this input file, if there is one."""
        with self.db.reading() as conn:
            return self._in_use(conn, file_id)

    def _in_use(self, conn: Connection, file_id: str) -> BatchRecord | None:
        found = conn.execute(
            sa.select(batches.c.record)
            .where(batches.c.input_file_id == file_id, batches.c.finished == sa.false())
            .order_by(batches.c.seq)
            .limit(1)
        ).scalar()
        return None if found is None else as_batch(found)

    def scratch(self, name: str) -> Path:
        """A path for a file being written that will become a stored file (see :meth:`add_file`)."""
        path = self.root / "scratch" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    # -- batches ----------------------------------------------------------------------------------
    def input_path(self, batch_id: str) -> Path:
        """The batch's own copy of its input: the job's id is made from this file's name."""
        return self.root / "batches" / f"{batch_id}.jsonl"

    def output_path(self, batch_id: str) -> Path:
        """Where the batch's job publishes its whole result (and its report beside it)."""
        return self.root / "batches" / f"{batch_id}.results.jsonl"

    def drop_batch_copies(self, batch_id: str) -> None:
        """Removes the batch's own copies of its input and its whole result (its report stays:
        it holds only counts and usage, which the batch object keeps showing)."""
        self.input_path(batch_id).unlink(missing_ok=True)
        self.output_path(batch_id).unlink(missing_ok=True)

    def batch_for_key(self, owner: str, idempotency_key: str) -> BatchRecord | None:
        """The batch this owner created earlier with this idempotency key, if any."""
        with self.db.reading() as conn:
            return self._batch_for_key(conn, owner, _key_sha256(idempotency_key))

    def _batch_for_key(self, conn: Connection, owner: str, key_sha256: str) -> BatchRecord | None:
        found = conn.execute(
            sa.select(batches.c.record)
            .join(idempotency, idempotency.c.batch_id == batches.c.id)
            .where(idempotency.c.owner == owner, idempotency.c.key_sha256 == key_sha256)
        ).scalar()
        return None if found is None else as_batch(found)

    def add_batch(self, record: BatchRecord, idempotency_key: str | None) -> BatchRecord:
        """Registers a new batch with its own copy of its input file (a hard link when the file
        system allows it), or returns the one this owner made earlier with the same idempotency
        key. Raises the API's 404 when the input is no live file of the owner, its 400 when it is
        no batch input. The copy is made once the file is known, outside any lock; the
        registration then checks the file again holding its row, so that of a batch made from a
        file and a delete of it exactly one succeeds."""
        key_sha256 = None if idempotency_key is None else _key_sha256(idempotency_key)
        with self.db.reading() as conn:
            if key_sha256 is not None and (earlier := self._batch_for_key(conn, record.owner, key_sha256)):
                return earlier
            self._check_input(conn, record, lock=False)
        copy = self.input_path(record.id)
        copy.parent.mkdir(parents=True, exist_ok=True)
        try:
            try:
                os.link(self.content_path(record.input_file_id), copy)
            except FileNotFoundError:  # removed since the check
                raise not_found("file", record.input_file_id) from None
            except OSError:
                shutil.copyfile(self.content_path(record.input_file_id), copy)
            with self.db.writing() as conn:
                if key_sha256 is not None and (earlier := self._batch_for_key(conn, record.owner, key_sha256)):
                    copy.unlink()
                    return earlier
                self._check_input(conn, record, lock=True)
                conn.execute(sa.insert(batches).values(batch_row(record)))
                if key_sha256 is not None:
                    conn.execute(
                        sa.insert(idempotency).values(owner=record.owner, key_sha256=key_sha256, batch_id=record.id)
                    )
            return record
        except sa.exc.IntegrityError:
            # Another process made the batch of this idempotency key first (and committed).
            copy.unlink(missing_ok=True)
            earlier = None if idempotency_key is None else self.batch_for_key(record.owner, idempotency_key)
            if earlier is None:
                raise
            return earlier
        except BaseException:
            copy.unlink(missing_ok=True)
            raise

    def _check_input(self, conn: Connection, record: BatchRecord, *, lock: bool) -> None:
        """Raises the API's 404 unless the batch's input is a live file of its owner, its 400 when
        that is no batch input; with ``lock``, the file's row stays locked against a delete (``FOR
        SHARE`` on PostgreSQL; SQLite's write transaction holds the whole database) until the
        transaction ends."""
        query = sa.select(files).where(files.c.id == record.input_file_id)
        found = _owned(conn.execute(query.with_for_update(read=True) if lock else query).first(), record.owner)
        if found is None:
            raise not_found("file", record.input_file_id)
        if found.purpose != "batch":
            raise ApiError(
                400, f"File {record.input_file_id} is a {found.purpose} file, not a batch input.", param="input_file_id"
            )

    def update_batch(
        self, batch_id: str, *, held_by: str | None = None, once: bool = False, **changes: Any
    ) -> BatchRecord:
        """Re-reads the record under a lock and applies changes, so that no two processes or threads
        undo each other's. A finished batch stays as it ended: its record is returned unchanged. A
        batch that ends here gets its webhook event in the same transaction (so it has exactly
        one), and counts in the metrics. With ``held_by``, raises LeaseLost unless that holder
        holds the batch's lease. With ``once``, a field the record has set already keeps its value
        (two cancels at once: the first one's time stays)."""
        with self.db.writing() as conn:
            found = conn.execute(
                sa.select(batches.c.record, batches.c.lease_holder).where(batches.c.id == batch_id).with_for_update()
            ).first()
            if found is None:
                raise LookupError(f"no batch {batch_id}")
            if held_by is not None and found.lease_holder != held_by:
                raise LeaseLost(f"batch {batch_id} is no longer held by {held_by}")
            before = as_batch(found.record)
            if before.finished:
                return before
            if once:
                changes = {name: value for name, value in changes.items() if getattr(before, name) is None}
                if not changes:
                    return before
            record = before.model_copy(update=changes)
            if record.finished and self.keep_events:
                self._add_event(conn, batch_event(record.id, record.status))
            row = batch_row(record)
            conn.execute(
                sa.update(batches)
                .where(batches.c.id == batch_id)
                .values(record=row["record"], finished=row["finished"])
            )
        if record.finished:
            metrics.BATCHES_FINISHED.labels(record.status).inc()
            if self.keep_events:
                self.event_added.set()
        return record

    def batch(self, batch_id: str, owner: str | None = None) -> BatchRecord | None:
        """The batch (if ``owner`` is given: only when it belongs to that owner)."""
        query = sa.select(batches.c.record).where(batches.c.id == batch_id)
        if owner is not None:
            query = query.where(batches.c.owner == owner)
        with self.db.reading() as conn:
            found = conn.execute(query).scalar()
        return None if found is None else as_batch(found)

    def batches(self, owner: str, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """A page of the owner's batches, newest first, starting after the batch ``after`` (none
        when that is not one of them)."""
        query = sa.select(batches.c.record).where(batches.c.owner == owner)
        with self.db.reading() as conn:
            if after is not None:
                mark = conn.execute(
                    sa.select(batches.c.seq).where(batches.c.owner == owner, batches.c.id == after)
                ).scalar()
                if mark is None:
                    return [], False
                query = query.where(batches.c.seq < mark)
            found = conn.execute(query.order_by(batches.c.seq.desc()).limit(limit + 1)).scalars().all()
        return [as_batch(r) for r in found[:limit]], len(found) > limit

    def unfinished(self) -> list[BatchRecord]:
        """Batches that were not finished, oldest first (what a restarted service takes up again)."""
        query = sa.select(batches.c.record).where(batches.c.finished == sa.false()).order_by(batches.c.seq)
        with self.db.reading() as conn:
            return [as_batch(r) for r in conn.execute(query).scalars()]


def _key_sha256(idempotency_key: str) -> str:
    return hashlib.sha256(idempotency_key.encode()).hexdigest()


def _owned(row: sa.Row[Any] | None, owner: str) -> FileRecord | None:
    """The file of this row if it belongs to ``owner`` and has not expired."""
    record = None if row is None else as_file(row)
    if record is None or record.owner != owner or record.expired(time.time()):
        return None
    return record
