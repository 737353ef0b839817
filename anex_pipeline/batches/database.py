"""The Batch API's connection to the Dagster instance's own database, and its transactions.

The store keeps its tables in the database of the instance's run storage (SQLite's ``runs.db`` in
the Dagster home, or the instance's PostgreSQL database). Dagster's SQL run storages hand out
connections through ``SqlRunStorage.connect()``; the SQLAlchemy engine behind one
(``Connection.engine``) tells the store where that database is and how Dagster reaches it. The
store then keeps an engine of its own, because it needs transactions that Dagster's engines do
not give:

* SQLite: an engine on the same file, whose write transactions start with ``BEGIN IMMEDIATE``, so
  that a transaction that reads and then writes holds the database's write lock from its start
  (Python's ``sqlite3`` would begin one only at the first write, and two such transactions could
  both read the old value). Other processes and threads wait for the lock up to
  :data:`BUSY_TIMEOUT_S`. Reads see one snapshot of the write-ahead log.
* PostgreSQL: a pool of connections opened by Dagster's own engine (its URL, its credentials and
  whatever hooks it has), in ``READ COMMITTED`` transactions (Dagster's engine runs every
  statement in autocommit). Where a check and a write must be one (a file in use, a cancel, a
  lease), the store locks the rows it reads (``FOR UPDATE``, ``FOR SHARE``) or writes with a
  condition in the ``UPDATE`` itself, which PostgreSQL evaluates again on the row's newest version.

A process keeps one :class:`Database` per run storage (:func:`instance_database`).
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import dagster as dg
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from anex_pipeline.errors import RejectedError

BUSY_TIMEOUT_S = 30.0  # how long a SQLite transaction waits for another's write lock
POOL_SIZE = 5  # connections kept open per process
POOL_OVERFLOW = 10  # more, opened while the pool's are all in use and closed after


class Database:
    """An engine on the instance's database, with the transactions the store uses."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.dialect = engine.dialect.name
        # SQLite write transactions take the write lock at BEGIN (see the listener below).
        self._writer = engine.execution_options(anex_write=True) if self.dialect == "sqlite" else engine
        self.prepared = False  # the tables exist and earlier records were moved in (see migration.py)
        self.preparing = threading.Lock()

    @contextmanager
    def reading(self) -> Iterator[Connection]:
        """A transaction that only reads."""
        with self.engine.begin() as conn:
            yield conn

    @contextmanager
    def writing(self) -> Iterator[Connection]:
        """A transaction that writes: committed when the block ends, rolled back when it raises."""
        with self._writer.begin() as conn:
            yield conn

    def lock(self, conn: Connection, name: str) -> None:
        """Holds a lock named ``name`` until the transaction ends: on PostgreSQL an advisory
        lock; SQLite's write transactions hold the whole database already."""
        if self.dialect == "postgresql":
            key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(key)))


_databases: weakref.WeakKeyDictionary[Any, Database] = weakref.WeakKeyDictionary()
_databases_lock = threading.Lock()


def instance_database(instance: dg.DagsterInstance) -> Database:
    """The database of the instance's run storage (one :class:`Database` per run storage and
    process). Raises RejectedError when the run storage is not in SQLite or PostgreSQL."""
    from dagster._core.storage.runs.sql_run_storage import SqlRunStorage

    storage = instance.run_storage
    with _databases_lock:
        if (found := _databases.get(storage)) is not None:
            return found
        if not isinstance(storage, SqlRunStorage):
            raise RejectedError(
                f"the Batch API keeps its records in the Dagster instance's database, and this instance's run "
                f"storage ({type(storage).__name__}) has none: use SQLite (the default) or PostgreSQL storage"
            )
        with storage.connect() as conn:
            dagster_engine = conn.engine
        found = _databases[storage] = Database(_own_engine(dagster_engine))
        return found


def _own_engine(dagster_engine: Engine) -> Engine:
    dialect = dagster_engine.dialect.name
    url = dagster_engine.url
    if dialect == "sqlite" and (url.database in (None, "", ":memory:") or url.query.get("mode") == "memory"):
        raise RejectedError(
            "the Batch API keeps its records in the Dagster instance's database, and this instance's is in "
            "memory (DagsterInstance.ephemeral()): use an instance on disk (DAGSTER_HOME) or in PostgreSQL"
        )
    if dialect == "sqlite":
        engine = sa.create_engine(
            url,
            connect_args={"timeout": BUSY_TIMEOUT_S},
            pool_size=POOL_SIZE,
            max_overflow=POOL_OVERFLOW,
        )
        sa.event.listen(engine, "connect", _sqlite_connected)
        sa.event.listen(engine, "begin", _sqlite_begin)
        return engine
    if dialect == "postgresql":

        def opened_by_dagster() -> Any:
            raw = dagster_engine.raw_connection()
            raw.detach()  # ours now: Dagster's pool (none: NullPool) lets go of it
            return raw.dbapi_connection

        return sa.create_engine(
            url,
            creator=opened_by_dagster,
            isolation_level="READ COMMITTED",
            pool_size=POOL_SIZE,
            max_overflow=POOL_OVERFLOW,
            pool_pre_ping=True,  # a connection the server closed (a restart, an idle timeout) is replaced
        )
    raise RejectedError(
        f"the Batch API keeps its records in SQLite or PostgreSQL; this Dagster instance's database is {dialect}"
    )


def _sqlite_connected(dbapi_connection: Any, _: Any) -> None:
    # Python's sqlite3 would BEGIN by itself before the first write only; the begin listener does it.
    dbapi_connection.isolation_level = None


def _sqlite_begin(conn: Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("anex_write") else "BEGIN")
