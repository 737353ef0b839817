"""Batch leases: which replica of the service runs a batch, kept in the batch's row.

A replica takes a batch up for a time (:meth:`BatchLeases.take_up`), renews the lease well before
it runs out (:meth:`~BatchLeases.renew`; a third of its time is a sensible pace) and lets it go
when it stops running the batch (:meth:`~BatchLeases.release`). A lease nobody renewed in time has
ended: another replica may take the batch over (:meth:`~BatchLeases.unclaimed_batches` lists the
unfinished batches whose lease is free or ended). Every change is one conditional ``UPDATE``, so of
replicas taking one batch at the same moment exactly one wins, on PostgreSQL and SQLite alike.
A holder whose renewal fails has lost the batch and must stop working on it; an update made for a
holder (``Store.update_batch(..., held_by=holder)``) is refused once it has lost the lease.

Times are Unix seconds of the machine that asks: replicas' clocks must agree to well within a
lease's time (NTP does).
"""

from __future__ import annotations

import time

import sqlalchemy as sa

from anex_pipeline.batches.database import Database
from anex_pipeline.batches.objects import BatchRecord
from anex_pipeline.batches.tables import as_batch
from anex_pipeline.batches.tables import batches as rows
from anex_pipeline.errors import AnexError


class LeaseLost(AnexError):
    """A holder changed a batch whose lease it no longer holds (another replica took it over)."""


def _free(at: float) -> sa.ColumnElement[bool]:
    return sa.or_(rows.c.lease_holder.is_(None), rows.c.lease_until <= at)


class BatchLeases:
    """The leases part of :class:`~anex_pipeline.batches.store.Store`."""

    db: Database

    def take_up(self, batch_id: str, holder: str, ttl_s: float) -> bool:
        """Takes the unfinished batch for ``holder`` for ``ttl_s`` seconds; True when the lease is
        its own now (also when it already was: that renews it), False when another holder's lease
        holds, or the batch is finished or unknown."""
        at = time.time()
        with self.db.writing() as conn:
            taken = conn.execute(
                sa.update(rows)
                .where(
                    rows.c.id == batch_id,
                    rows.c.finished == sa.false(),
                    sa.or_(_free(at), rows.c.lease_holder == holder),
                )
                .values(lease_holder=holder, lease_until=at + ttl_s)
            )
        return taken.rowcount == 1

    def renew(self, batch_id: str, holder: str, ttl_s: float) -> bool:
        """Moves the end of ``holder``'s lease to ``ttl_s`` seconds from now; False when the lease
        is no longer its own (another holder took the batch over after it ran out)."""
        with self.db.writing() as conn:
            renewed = conn.execute(
                sa.update(rows)
                .where(rows.c.id == batch_id, rows.c.lease_holder == holder)
                .values(lease_until=time.time() + ttl_s)
            )
        return renewed.rowcount == 1

    def release(self, batch_id: str, holder: str) -> None:
        """Lets the batch go, if ``holder`` still holds it."""
        with self.db.writing() as conn:
            conn.execute(
                sa.update(rows)
                .where(rows.c.id == batch_id, rows.c.lease_holder == holder)
                .values(lease_holder=None, lease_until=None)
            )

    def lease(self, batch_id: str) -> tuple[str, float] | None:
        """Who holds the batch's lease and until when, if anyone does (an ended lease included)."""
        with self.db.reading() as conn:
            found = conn.execute(
                sa.select(rows.c.lease_holder, rows.c.lease_until).where(
                    rows.c.id == batch_id, rows.c.lease_holder.is_not(None)
                )
            ).first()
        return None if found is None else (found.lease_holder, found.lease_until)

    def unclaimed_batches(self, limit: int | None = None) -> list[BatchRecord]:
        """Unfinished batches that no lease holds (never taken, let go, or not renewed in time),
        oldest first: the ones a replica looking for work may take up."""
        query = sa.select(rows.c.record).where(rows.c.finished == sa.false(), _free(time.time())).order_by(rows.c.seq)
        with self.db.reading() as conn:
            found = conn.execute(query if limit is None else query.limit(limit)).scalars().all()
        return [as_batch(r) for r in found]
