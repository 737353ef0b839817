"""Batch events for the operator's webhook: OpenAI's event objects, signed as Standard Webhooks.

When a batch ends, the store keeps an event for it (``batch.completed``, ``batch.failed``,
``batch.cancelled`` or ``batch.expired``) beside the batch's record, in the same lock; a sender
thread posts each pending event to the webhook URL and forgets it once the receiver answers 2xx.
Any other answer, a timeout or a refused connection is tried again later, with a delay that
doubles from :data:`RETRY_FIRST_S` up to :data:`RETRY_MOST_S`, for up to :data:`GIVE_UP_S`; the
events still pending when the service stops are sent after its next start. Delivery is
therefore at least once: a receiver should ignore a ``webhook-id`` it has seen. The sender runs
on its own thread, so a receiver that is down or slow never holds up a batch.

Signatures follow the Standard Webhooks specification, as OpenAI's do: the headers
``webhook-id`` (the event id), ``webhook-timestamp`` (Unix seconds) and ``webhook-signature``
(``v1,`` and the base64 HMAC-SHA256 of ``<id>.<timestamp>.<body>`` under the secret's bytes).
The secret is ``whsec_`` followed by base64, as OpenAI's dashboard gives it. The request goes
through the media downloads' address policy: loopback, private, link-local and metadata
addresses are refused unless the operator's ``--webhook-allowed-host`` names them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from anex_pipeline import metrics
from anex_pipeline.media.guard import guarded_client, refusal

if TYPE_CHECKING:
    from anex_pipeline.batches.store import Store

log = logging.getLogger("anex_pipeline.batch_api")

SECRET_PREFIX = "whsec_"
RETRY_FIRST_S = 1.0  # the delay before the first retry; each further one doubles it
RETRY_MOST_S = 600.0  # the longest delay between two tries
GIVE_UP_S = 3 * 24 * 3600  # an event not delivered this long after it was made is dropped (OpenAI's 72 h)
TIMEOUT_S = 10.0  # one delivery attempt, from connecting to the answer, by default
ALLOWED_BY = "serve --webhook-allowed-host"


@dataclass(frozen=True)
class WebhookSettings:
    """Where batch events go, and the secret they are signed with (``whsec_`` + base64)."""

    url: str
    secret: str
    allowed_hosts: tuple[str, ...] = ()
    retry_first_s: float = RETRY_FIRST_S
    timeout_s: float = TIMEOUT_S

    def check(self) -> None:
        """Raises ValueError with one line when the URL or the secret cannot be used, or the
        address policy refuses the URL's host."""
        signing_key(self.secret)
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the webhook URL must be an http(s) URL with a host, got {self.url!r}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise ValueError(f"the webhook URL has a port that is not a number: {self.url!r}") from None
        if why := refusal(parts.hostname, port, self.allowed_hosts, ALLOWED_BY):
            raise ValueError(f"the webhook URL is refused: {why}")


def signing_key(secret: str) -> bytes:
    """The bytes a ``whsec_`` secret stands for; ValueError when it is not of that form."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError("the webhook secret must start with 'whsec_' followed by base64 (as OpenAI's secrets do)")
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
    except binascii.Error:
        raise ValueError("the webhook secret's part after 'whsec_' is not valid base64") from None
    if len(key) < 16:
        raise ValueError("the webhook secret is too short: give at least 16 bytes of base64 after 'whsec_'")
    return key


def sign(key: bytes, event_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header of one delivery."""
    mac = hmac.new(key, f"{event_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


class WebhookSender:
    """Posts the store's pending events, on a thread of its own."""

    def __init__(self, store: Store, settings: WebhookSettings):
        self.store = store
        self.settings = settings
        self.key = signing_key(settings.secret)
        self.client = guarded_client(settings.allowed_hosts, ALLOWED_BY, settings.timeout_s, "anex-pipeline webhooks")
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="batch-webhooks", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stops sending (what is pending stays stored for the next start)."""
        self._closing.set()
        self.store.event_added.set()
        self._thread.join(self.settings.timeout_s + 5)
        self.client.close()

    def _loop(self) -> None:
        while not self._closing.is_set():
            self.store.event_added.clear()
            try:
                wake_at = self._send_due()
            except Exception:  # the store failed (its database busy, say): the events stay; look again soon
                log.exception("webhook events could not be read or updated; trying again")
                wake_at = time.time() + self.settings.retry_first_s
            wait = None if wake_at is None else max(0.0, wake_at - time.time())
            self.store.event_added.wait(wait)

    def _send_due(self) -> float | None:
        """Tries every event that is due; when the next one falls due (None: none is pending)."""
        wake_at = None
        for pending in self.store.pending_events():
            if self._closing.is_set():
                return None
            if pending["next_at"] <= time.time():
                pending = self._deliver(pending)
            if pending is not None:
                wake_at = pending["next_at"] if wake_at is None else min(wake_at, pending["next_at"])
        return wake_at

    def _deliver(self, pending: dict[str, Any]) -> dict[str, Any] | None:
        """One attempt; the event as still pending (with its next try), or None once it is done."""
        event = pending["event"]
        body = json.dumps(event, separators=(",", ":")).encode()
        stamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "webhook-id": event["id"],
            "webhook-timestamp": str(stamp),
            "webhook-signature": sign(self.key, event["id"], stamp, body),
        }
        try:
            answer = self.client.post(self.settings.url, content=body, headers=headers)
            problem = None if 200 <= answer.status_code < 300 else f"the receiver answered {answer.status_code}"
        except Exception as exc:  # refused, unreachable, timed out: tried again later
            problem = str(exc) or type(exc).__name__
        if problem is None:
            metrics.WEBHOOKS.labels("delivered").inc()
            self.store.forget_event(event["id"])
            return None
        attempts = pending["attempts"] + 1
        if time.time() - event["created_at"] > GIVE_UP_S:
            metrics.WEBHOOKS.labels("dropped").inc()
            log.warning(
                "webhook %s for batch %s dropped after %d tries: %s",
                event["type"],
                event["data"]["id"],
                attempts,
                problem,
            )
            self.store.forget_event(event["id"])
            return None
        metrics.WEBHOOKS.labels("failed").inc()
        delay = min(self.settings.retry_first_s * 2 ** (attempts - 1), RETRY_MOST_S)
        log.warning(
            "webhook %s for batch %s not delivered (%s); trying again in %.0f s",
            event["type"],
            event["data"]["id"],
            problem,
            delay,
        )
        return self.store.retry_event(event["id"], attempts, time.time() + delay)
