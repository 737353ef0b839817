"""Answers kept by key in one SQLite file: the job's answer book and the answer store across jobs.

Each answer is a row outcome's record as JSON (never a pickle: whoever can write the file must not
be able to run code in the jobs that read it), with the job that stored it, when, and its size.
Answers are written a batch at a time, in one transaction. With a size limit, the answers stored
first go once the table outgrows it (a running total of the sizes, kept by triggers, says when).

An answer that cannot be read back (not JSON, not a record, a field missing) counts as no answer:
it is removed, and :attr:`AnswerTable.dropped` counts it. A table that cannot be opened, read or
written only saves less work: the callers generate what it does not answer. The folder holding
the file, and the file, must be this user's alone (:func:`~anex_pipeline.paths.private_problem`); otherwise the table
is not opened.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from anex_pipeline.errors import AnexError
from anex_pipeline.paths import private_problem
from anex_pipeline.spec import RowOutcome

log = logging.getLogger(__name__)

FILE_NAME = "answers.sqlite3"
BUSY_TIMEOUT_S = 60.0  # how long a write waits for another process's (shards of one job write at once)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS answers (
    key TEXT PRIMARY KEY, job TEXT NOT NULL, stored REAL NOT NULL, size INTEGER NOT NULL, value BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS answers_by_job ON answers (job);
CREATE INDEX IF NOT EXISTS answers_by_age ON answers (stored);
CREATE TABLE IF NOT EXISTS total (bytes INTEGER NOT NULL);
INSERT INTO total SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM total);
CREATE TRIGGER IF NOT EXISTS added AFTER INSERT ON answers BEGIN UPDATE total SET bytes = bytes + new.size; END;
CREATE TRIGGER IF NOT EXISTS replaced AFTER UPDATE ON answers
    BEGIN UPDATE total SET bytes = bytes + new.size - old.size; END;
CREATE TRIGGER IF NOT EXISTS removed AFTER DELETE ON answers BEGIN UPDATE total SET bytes = bytes - old.size; END;
"""

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


class UnsafeFolder(AnexError):
    """A folder or file of answers that another user owns or may write."""


class AnswerTable:
    """The answers of one file, by key."""

    def __init__(self, folder: Path, size_limit: int | None = None):
        """Opens (creating it if need be) ``folder/answers.sqlite3``; raises :class:`UnsafeFolder`,
        ``sqlite3.Error`` or ``OSError`` when that cannot be done safely."""
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = folder / FILE_NAME
        for each in (folder, path):
            problem = private_problem(each, os.stat(each)) if each.exists() else None
            if problem is not None:
                raise UnsafeFolder(problem)
        self.path, self.size_limit = path, size_limit
        self.dropped = 0  # answers found unreadable and removed
        self._db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        try:
            os.chmod(path, 0o600)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # an answer lost to a power cut is generated again
            self._db.executescript(_SCHEMA)
        except BaseException:
            self._db.close()
            raise

    def get(self, key: str) -> RowOutcome | None:
        """The answer stored under ``key``, or None (an unreadable one is removed and counted)."""
        found = self._db.execute("SELECT value FROM answers WHERE key = ?", (key,)).fetchone()
        if found is None:
            return None
        try:
            record = _decode(found[0])
            if not isinstance(record, dict):
                raise TypeError(f"a stored answer is {type(record).__name__}, not a record")
            return RowOutcome.from_record(record)
        except (msgspec.DecodeError, TypeError, KeyError, ValueError, RecursionError) as exc:
            log.warning("an unreadable answer in %s was removed (%s): its row is generated", self.path, exc)
            self.dropped += 1
            self._db.execute("DELETE FROM answers WHERE key = ?", (key,))
            return None

    def put(self, answers: Iterable[tuple[str, RowOutcome]], job: str) -> None:
        """Stores the successful ``(key, outcome)`` answers as ``job``'s, in one transaction. With a
        size limit, room is made first by removing the answers stored first (of a batch larger
        than the limit, only its last answers are kept), so the file never holds much more."""
        now = time.time()
        rows = []
        for key, outcome in answers:
            if outcome.ok:
                value = _encode(outcome.to_record())
                rows.append((key, job, now, len(value), value))
        if self.size_limit is not None:
            rows = _last_fitting(rows, self.size_limit)
        if not rows:
            return
        with self._transaction():
            culled = self.size_limit is not None and self._make_room(sum(row[3] for row in rows))
            self._db.executemany(
                "INSERT INTO answers (key, job, stored, size, value) VALUES (?, ?, ?, ?, ?) ON CONFLICT (key) DO "
                "UPDATE SET job = excluded.job, stored = excluded.stored, size = excluded.size, value = excluded.value",
                rows,
            )
        if culled:  # the pages freed are reused; the log that copied them need not stay that large
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _make_room(self, adding: int) -> bool:
        """Removes the answers stored first until ``adding`` more bytes fit the size limit; whether
        any went. Inside a transaction."""
        assert self.size_limit is not None
        excess = self._db.execute("SELECT bytes FROM total").fetchone()[0] + adding - self.size_limit
        if excess <= 0:
            return False
        oldest = []
        for rowid, size in self._db.execute("SELECT rowid, size FROM answers ORDER BY stored, rowid"):
            oldest.append((rowid,))
            excess -= size
            if excess <= 0:
                break
        self._db.executemany("DELETE FROM answers WHERE rowid = ?", oldest)
        return True

    def drop_job(self, job: str) -> None:
        """Removes the answers ``job`` stored."""
        with self._transaction():
            self._db.execute("DELETE FROM answers WHERE job = ?", (job,))

    def _transaction(self) -> Any:
        return _Transaction(self._db)

    def close(self) -> None:
        self._db.close()


def _last_fitting(
    rows: list[tuple[str, str, float, int, bytes]], limit: int
) -> list[tuple[str, str, float, int, bytes]]:
    """The last of ``rows`` whose sizes add up to at most ``limit``."""
    total, first = 0, len(rows)
    while first > 0 and total + rows[first - 1][3] <= limit:
        first -= 1
        total += rows[first][3]
    return rows[first:]


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on an error): a writer takes the file's
    write lock at once, so two processes never both read and then fail to write."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")
