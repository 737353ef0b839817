"""Webhook receivers on loopback for the Batch API's events: a plain one that may be down for a
while, and answers a receiver may give on purpose to hurt its sender (a huge body sent lazily, an
answer trickled a byte at a time)."""

from __future__ import annotations

import base64
import secrets
import select
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import dagster as dg
from openai import OpenAI

from anex_pipeline.batches.store import Store

SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
CHUNK = 64 * 1024


class Answer(Protocol):
    """How the receiver answers one request itself (instead of a plain status)."""

    def __call__(self, handler: BaseHTTPRequestHandler) -> None: ...


class Receiver:
    """A webhook receiver on loopback that answers 503 to its first ``down_for`` requests and 200
    to the others, except the requests whose number (0 for the first) ``answers`` maps to an
    answer of its own."""

    def __init__(self, down_for: int = 0, answers: dict[int, Answer] | None = None):
        self.down_for = down_for
        self.answers = answers or {}
        self.requests: list[tuple[dict[str, str], bytes, int]] = []  # headers, body, the status answered
        self.arrived: list[float] = []  # the monotonic time each request's body was read
        self.changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                with receiver.changed:
                    number = len(receiver.requests)
                    answer = receiver.answers.get(number)
                    status = 0 if answer else 503 if number < receiver.down_for else 200  # 0: its own answer
                    receiver.requests.append(({k.lower(): v for k, v in self.headers.items()}, body, status))
                    receiver.arrived.append(time.monotonic())
                    receiver.changed.notify_all()
                if answer is not None:
                    answer(self)
                    self.close_connection = True
                    return
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, count: int, timeout: float = 60) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.requests) >= count, timeout), self.requests

    def delivered(self) -> list[dict[str, Any]]:
        """The events it accepted, each checked against its signature by the openai SDK."""
        sdk = OpenAI(api_key="unused", webhook_secret=SECRET)
        return [
            sdk.webhooks.unwrap(body, headers).to_dict() for headers, body, status in self.requests if status == 200
        ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def receiving(down_for: int = 0, answers: dict[int, Answer] | None = None) -> Iterator[Receiver]:
    receiver = Receiver(down_for, answers)
    try:
        yield receiver
    finally:
        receiver.close()


def no_event_pending(instance: dg.DagsterInstance, work_root: str, timeout: float = 30) -> None:
    """Waits until the service has no webhook event left to send."""
    store = Store(instance, work_root)
    deadline = time.monotonic() + timeout
    while store.pending_events():
        assert time.monotonic() < deadline, store.pending_events()
        time.sleep(0.05)


class HugeBody:
    """Answers 200 with a body of ``size`` bytes, made 64 KiB at a time as the connection takes
    them (never held whole), once ``go`` is set; counts what the sender took before it closed."""

    def __init__(self, size: int):
        self.size = size
        self.asked = threading.Event()  # the request arrived; the answer waits for go
        self.go = threading.Event()
        self.ended = threading.Event()
        self.sent = 0

    def __call__(self, handler: BaseHTTPRequestHandler) -> None:
        self.asked.set()
        try:
            if not self.go.wait(60):
                return
            handler.wfile.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n" % self.size
            )
            chunk = b"x" * CHUNK
            while self.sent < self.size:
                handler.wfile.write(chunk[: self.size - self.sent])
                self.sent += min(CHUNK, self.size - self.sent)
        except OSError:  # the sender closed the connection: it read no further
            pass
        finally:
            self.ended.set()


class Trickle:
    """Answers a status line and a header that never ends, one byte every ``pace_s`` seconds, until
    the sender closes the connection (or ``stop`` is set); ``lasted`` is how long that took from the
    first byte."""

    def __init__(self, pace_s: float):
        self.pace_s = pace_s
        self.stop = threading.Event()
        self.ended = threading.Event()
        self.lasted: float | None = None
        self.closed_at: float | None = None  # monotonic

    def __call__(self, handler: BaseHTTPRequestHandler) -> None:
        text = b"HTTP/1.1 200 OK\r\nx-slow: " + b"a" * 10**6
        started = time.monotonic()
        try:
            for byte in text:
                if self.stop.is_set():
                    break
                handler.wfile.write(bytes([byte]))
                # The pause between two bytes, cut short when the sender closes (its end reads as EOF).
                if select.select([handler.connection], [], [], self.pace_s)[0] and not handler.connection.recv(1):
                    break
        except OSError:
            pass
        finally:
            self.closed_at = time.monotonic()
            self.lasted = self.closed_at - started
            self.ended.set()
