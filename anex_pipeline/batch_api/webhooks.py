"""Batch events for the operator's webhook: OpenAI's event objects, signed as Standard Webhooks.

When a batch ends, the store keeps an event for it (``batch.completed``, ``batch.failed``,
``batch.cancelled`` or ``batch.expired``) beside the batch's record, in the same transaction; a
sender thread claims each pending event (so that of several senders on one database only one tries
it), posts it to the webhook URL and forgets it once the receiver answers 2xx.
Any other answer, a timeout or a refused connection is tried again later, with a delay that
doubles from :data:`RETRY_FIRST_S` up to :data:`RETRY_MOST_S` (the project's one
:class:`~anex_pipeline.net.retry.RetryPolicy`), for up to :data:`GIVE_UP_S`; the events still
pending when the service stops are sent after its next start. Delivery is therefore at least
once: a receiver should ignore a ``webhook-id`` it has seen. The sender runs on its own thread, so
a receiver that is down or slow never holds up a batch.

A receiver cannot hurt the service through its answer. Each try has one deadline,
``timeout_s``, from connecting to the last byte read (the media downloads' guarded connections
cut every read and write to the time left, so a receiver sending a byte now and then cannot
stretch it; the host name's lookup before is not under it); of the answer only the status line
and headers count, and reading its body stops once :data:`ANSWER_BYTES` came (raw, never
decompressed), so a huge body costs nothing. Each try runs on a thread of its own, up to
:data:`TRIES_AT_ONCE` at a time, while the sender's thread only starts them and records what they
found: an event whose try hangs until its deadline makes no other event wait for it. Events may
therefore arrive out of order.

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
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from anex_pipeline import metrics
from anex_pipeline.batches.objects import holder_name
from anex_pipeline.media.guard import guarded_client, refusal, request_deadline
from anex_pipeline.net.retry import RetryPolicy

if TYPE_CHECKING:
    from anex_pipeline.batches.store import Store

log = logging.getLogger("anex_pipeline.batch_api")

SECRET_PREFIX = "whsec_"
RETRY_FIRST_S = 1.0  # the delay before the first retry; each further one doubles it (each jittered down to half)
RETRY_MOST_S = 600.0  # the longest delay between two tries
GIVE_UP_S = 3 * 24 * 3600  # an event not delivered this long after it was made is dropped (OpenAI's 72 h)
TIMEOUT_S = 10.0  # one try's deadline, from connecting to the last byte read, by default
ANSWER_BYTES = 4096  # the most of an answer's body a try reads: only its status counts
TRIES_AT_ONCE = 8  # tries under way at the same time, each on a thread of its own
CLAIM_MARGIN_S = 30.0  # a sender's claim on an event holds for a try's deadline and this long
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
    """Posts the store's pending events: a thread of its own starts each due event's try on a
    thread of the try's own (at most :data:`TRIES_AT_ONCE` at once) and records what each found."""

    def __init__(self, store: Store, settings: WebhookSettings):
        self.store = store
        self.settings = settings
        self.key = signing_key(settings.secret)
        self.client = guarded_client(settings.allowed_hosts, ALLOWED_BY, settings.timeout_s, "anex-pipeline webhooks")
        self.backoff = RetryPolicy(backoff_s=settings.retry_first_s, max_wait_s=RETRY_MOST_S)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="batch-webhooks", daemon=True)
        self.holder = holder_name("webhooks")  # the name its claims on events go by
        self._trying: dict[str, threading.Thread] = {}  # event id -> its try; only the sender's thread edits it
        self._found: queue.SimpleQueue[tuple[dict[str, Any], str | None]] = queue.SimpleQueue()  # tries' outcomes

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stops sending, after the tries under way (each over by its deadline); what is pending
        stays stored for the next start."""
        until = time.monotonic() + self.settings.timeout_s + 5
        self._closing.set()
        self.store.event_added.set()
        self._thread.join(max(0.0, until - time.monotonic()))
        for thread in list(self._trying.values()):
            thread.join(max(0.0, until - time.monotonic()))
        try:
            self._record_outcomes()
            self.store.release_claims(self.holder)  # tries still under way: sent again after the next start
        except Exception:  # the store failed: those events are sent again after the next start
            log.exception("webhook deliveries could not be recorded")
        self.client.close()

    def _loop(self) -> None:
        while not self._closing.is_set():
            self.store.event_added.clear()  # set again by a new event and by each try that ends
            try:
                self._record_outcomes()
                wake_at = self._start_due()
            except Exception:  # the store failed (its database busy, say): the events stay; look again soon
                log.exception("webhook events could not be read or updated; trying again")
                wake_at = time.time() + self.settings.retry_first_s
            wait = None if wake_at is None else max(0.0, wake_at - time.time())
            self.store.event_added.wait(wait)

    def _start_due(self) -> float | None:
        """Starts a try of every due event that has none under way, while fewer than
        :data:`TRIES_AT_ONCE` are; when the next one falls due (None: none is waiting for a time)."""
        wake_at = None
        for pending in self.store.pending_events():
            if self._closing.is_set():
                return None
            event_id = pending["event"]["id"]
            if event_id in self._trying:
                continue
            if pending["next_at"] > time.time():
                wake_at = pending["next_at"] if wake_at is None else min(wake_at, pending["next_at"])
            elif len(self._trying) < TRIES_AT_ONCE:  # else the end of a try wakes this thread
                if not self.store.claim_event(event_id, self.holder, self.settings.timeout_s + CLAIM_MARGIN_S):
                    wake_at = time.time()  # another sender took it first: look again at what it left
                    continue
                thread = threading.Thread(target=self._try, args=(pending,), name="batch-webhook-try", daemon=True)
                self._trying[event_id] = thread
                thread.start()
        return wake_at

    def _try(self, pending: dict[str, Any]) -> None:
        """One try, on its own thread: its outcome goes to the sender's thread to be recorded."""
        try:
            problem = self._post(pending["event"])
        except BaseException as exc:  # never leave the event marked as under way
            problem = str(exc) or type(exc).__name__
        self._found.put((pending, problem))
        self.store.event_added.set()

    def _post(self, event: dict[str, Any]) -> str | None:
        """Posts the event, all over by the try's deadline; None when the receiver took it (2xx),
        else what went wrong."""
        body = json.dumps(event, separators=(",", ":")).encode()
        stamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "webhook-id": event["id"],
            "webhook-timestamp": str(stamp),
            "webhook-signature": sign(self.key, event["id"], stamp, body),
        }
        timeout = self.settings.timeout_s
        try:
            with (
                request_deadline(time.monotonic() + timeout),
                self.client.stream("POST", self.settings.url, content=body, headers=headers) as answer,
            ):
                status = answer.status_code
                _read_some(answer)
        except httpx.TimeoutException:
            return f"no answer within {timeout:g} s"
        except Exception as exc:  # refused, unreachable, a broken answer: tried again later
            return str(exc) or type(exc).__name__
        return None if 200 <= status < 300 else f"the receiver answered {status}"

    def _record_outcomes(self) -> None:
        """Records the outcome of every try that has ended: the event is forgotten, dropped, or
        tried again later."""
        while True:
            try:
                pending, problem = self._found.get_nowait()
            except queue.Empty:
                return
            try:
                self._record(pending, problem)
            finally:  # recorded or not (the store failed), the event may be tried again
                self._trying.pop(pending["event"]["id"], None)

    def _record(self, pending: dict[str, Any], problem: str | None) -> None:
        event = pending["event"]
        if problem is None:
            metrics.WEBHOOKS.labels("delivered").inc()
            self.store.forget_event(event["id"])
            return
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
            return
        metrics.WEBHOOKS.labels("failed").inc()
        delay = self.backoff.backoff(attempts - 1)
        log.warning(
            "webhook %s for batch %s not delivered (%s); trying again in %.0f s",
            event["type"],
            event["data"]["id"],
            problem,
            delay,
        )
        self.store.retry_event(event["id"], attempts, time.time() + delay)


def _read_some(answer: httpx.Response) -> None:
    """Reads an answer's body, as it comes and undecoded, until more than :data:`ANSWER_BYTES` came
    (one network read holds at most 64 KiB), so that a short answer leaves its connection for the
    next try; a longer one is cut when the answer is closed, and a broken one changes nothing (the
    status has spoken)."""
    taken = 0
    try:
        for chunk in answer.iter_raw():
            taken += len(chunk)
            if taken > ANSWER_BYTES:
                return
    except httpx.HTTPError:
        pass
