"""The webhook events the store keeps until they are delivered (see ``batch_api.webhooks``).

An event is stored in the same transaction that ends its batch, so a batch ends with exactly one
event, whichever process ends it. A sender claims an event before it tries it: the claim is a
conditional ``UPDATE`` that only one sender's can match, so with several senders on one database
(replicas of the service) each try is made by one of them. A claim holds for the time it is given
(the try's deadline and a margin) and ends when the sender records the try's outcome; the claim
of a sender that died ends with its time, and another sender takes the event up then.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from anex_pipeline.batches.database import Database
from anex_pipeline.batches.tables import webhook_events as events


class WebhookEvents:
    """The events part of :class:`~anex_pipeline.batches.store.Store`."""

    db: Database
    event_added: threading.Event  # set when this process stores an event, to wake its sender

    def _add_event(self, conn: Connection, event: dict[str, Any]) -> None:
        """Stores a new event within the caller's transaction (the caller sets ``event_added``
        once it is committed)."""
        conn.execute(sa.insert(events).values(id=event["id"], event=json.dumps(event), attempts=0, next_at=0.0))

    def pending_events(self) -> list[dict[str, Any]]:
        """Events not delivered yet, oldest first: ``{"event", "attempts", "next_at"}``, where
        ``next_at`` is when a sender may try the event next (the later of its retry time and the
        end of a sender's claim on it)."""
        with self.db.reading() as conn:
            rows = conn.execute(
                sa.select(events.c.event, events.c.attempts, events.c.next_at, events.c.claimed_until).order_by(
                    events.c.seq
                )
            ).all()
        return [
            {"event": json.loads(r.event), "attempts": r.attempts, "next_at": max(r.next_at, r.claimed_until or 0.0)}
            for r in rows
        ]

    def claim_event(self, event_id: str, holder: str, ttl_s: float) -> bool:
        """Claims a due event for ``holder`` for ``ttl_s`` seconds; False when it is gone, not
        due yet, or another sender's claim on it holds."""
        at = time.time()
        with self.db.writing() as conn:
            taken = conn.execute(
                sa.update(events)
                .where(
                    events.c.id == event_id,
                    events.c.next_at <= at,
                    sa.or_(events.c.claimed_by.is_(None), events.c.claimed_until <= at),
                )
                .values(claimed_by=holder, claimed_until=at + ttl_s)
            )
        return taken.rowcount == 1

    def retry_event(self, event_id: str, attempts: int, next_at: float) -> dict[str, Any] | None:
        """Records a failed attempt, which ends the claim on it; the event as pending now (None if
        it is gone)."""
        with self.db.writing() as conn:
            changed = conn.execute(
                sa.update(events)
                .where(events.c.id == event_id)
                .values(attempts=attempts, next_at=next_at, claimed_by=None, claimed_until=None)
            )
            if changed.rowcount == 0:
                return None
            event = conn.execute(sa.select(events.c.event).where(events.c.id == event_id)).scalar_one()
        return {"event": json.loads(event), "attempts": attempts, "next_at": next_at}

    def forget_event(self, event_id: str) -> None:
        with self.db.writing() as conn:
            conn.execute(sa.delete(events).where(events.c.id == event_id))

    def release_claims(self, holder: str) -> None:
        """Ends every claim of ``holder`` (a sender that stops while tries are still under way):
        the next sender tries those events again at once."""
        with self.db.writing() as conn:
            conn.execute(
                sa.update(events).where(events.c.claimed_by == holder).values(claimed_by=None, claimed_until=None)
            )
