"""The Batch API's tables, in the Dagster instance's own database (SQLite or PostgreSQL).

Every name starts with ``anex_batch_api_`` so that none can meet one of Dagster's. Each listing the
service answers has an index that gives its rows in order: a tenant's files by creation time (ties
in upload order, ``seq``), a tenant's batches by ``seq`` (the order they were created in), the
unfinished batches, the expiring files, the files a batch delivered, the batches made from a file.
A batch's whole record is kept as JSON in ``record``; the columns beside it are the ones a query
filters or orders on, kept in step by the store in the same statement.
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from anex_pipeline.batches.objects import BatchRecord, FileRecord

metadata = sa.MetaData()

files = sa.Table(
    "anex_batch_api_files",
    metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),  # upload order
    sa.Column("id", sa.String(64), nullable=False, unique=True),
    sa.Column("owner", sa.String(64), nullable=False),  # sha256 of the API key that uploaded it
    sa.Column("filename", sa.Text, nullable=False),
    sa.Column("purpose", sa.String(32), nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.BigInteger, nullable=False),
    sa.Column("expires_at", sa.BigInteger, nullable=True),
    sa.Column("batch_id", sa.String(64), nullable=True),  # the batch that delivered it
    sa.Index("anex_batch_api_files_by_owner", "owner", "created_at", "seq"),
    sa.Index("anex_batch_api_files_by_expiry", "expires_at"),
    sa.Index("anex_batch_api_files_by_batch", "batch_id"),
)

batches = sa.Table(
    "anex_batch_api_batches",
    metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),  # creation order
    sa.Column("id", sa.String(64), nullable=False, unique=True),
    sa.Column("owner", sa.String(64), nullable=False),
    sa.Column("input_file_id", sa.String(64), nullable=False),
    sa.Column("finished", sa.Boolean, nullable=False),
    sa.Column("record", sa.Text, nullable=False),  # the BatchRecord as JSON
    # The lease of the replica running the batch: who holds it, and until when (Unix seconds).
    sa.Column("lease_holder", sa.String(200), nullable=True),
    sa.Column("lease_until", sa.Double, nullable=True),
    sa.Index("anex_batch_api_batches_by_owner", "owner", "seq"),
    sa.Index("anex_batch_api_batches_unfinished", "finished", "seq"),
    sa.Index("anex_batch_api_batches_by_input", "input_file_id", "finished"),
)

api_keys = sa.Table(
    "anex_batch_api_keys",
    metadata,
    sa.Column("hash", sa.String(64), primary_key=True),  # sha256 of a valid API key
)

idempotency_keys = sa.Table(
    "anex_batch_api_idempotency_keys",
    metadata,
    sa.Column("owner", sa.String(64), primary_key=True),
    sa.Column("key_sha256", sa.String(64), primary_key=True),  # one batch per owner and key, whoever asks
    sa.Column("batch_id", sa.String(64), nullable=False),
)

webhook_events = sa.Table(
    "anex_batch_api_webhook_events",
    metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),  # the order events were made in
    sa.Column("id", sa.String(64), nullable=False, unique=True),
    sa.Column("event", sa.Text, nullable=False),  # the event object as JSON, as it is sent
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("next_at", sa.Double, nullable=False),  # not tried again before this time
    # The sender that is trying it, and until when its claim holds (Unix seconds).
    sa.Column("claimed_by", sa.String(200), nullable=True),
    sa.Column("claimed_until", sa.Double, nullable=True),
)

# What the store has done to the database: its schema's version, and whether the records an
# earlier version kept in Dagster's key-value store have been moved into the tables.
schema = sa.Table(
    "anex_batch_api_schema",
    metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)


def file_row(record: FileRecord) -> dict[str, Any]:
    """A file's row (its columns are the record's fields)."""
    return record.model_dump()


def as_file(row: sa.Row[Any]) -> FileRecord:
    return FileRecord.model_validate({name: getattr(row, name) for name in FileRecord.model_fields})


def batch_row(record: BatchRecord) -> dict[str, Any]:
    """A batch's row, but for its lease."""
    return {
        "id": record.id,
        "owner": record.owner,
        "input_file_id": record.input_file_id,
        "finished": record.finished,
        "record": json.dumps(record.model_dump()),
    }


def as_batch(record: str) -> BatchRecord:
    """The batch whose ``record`` column this is."""
    return BatchRecord.model_validate(json.loads(record))
