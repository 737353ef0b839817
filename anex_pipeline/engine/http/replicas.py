"""The model servers an HTTP engine spreads its rows over, and which of them can take a row now.

Each server takes up to ``per_server`` requests at once; a row goes to the least busy server that
is up. A server whose request got no answer (connection refused or reset, a timeout) is taken
out: its rows in flight are tried again elsewhere, and it is probed again after a backoff (the
same policy as every HTTP retry), then put back once it answers. When every server is out and
each has failed ``retries`` probes in a row, the servers are dead: the engine gives up.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from anex_pipeline.errors import AnexError
from anex_pipeline.net.retry import RetryPolicy

log = logging.getLogger(__name__)


def server_urls(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """The servers named by a base URL setting: one URL, a comma-separated list, or a list of
    either; each must be an http(s) URL. Raises ValueError with what to change otherwise."""
    items = [value] if isinstance(value, str) else list(value or [])
    urls = tuple(u.strip() for item in items for u in item.split(",") if u.strip())
    for url in urls:
        parts = httpx.URL(url) if re.match(r"https?://", url) else None
        if parts is None or not parts.host:
            raise ValueError(f"{url!r} is not an http:// or https:// server address (e.g. http://gpu-1:8000)")
    if len(set(urls)) != len(urls):
        raise ValueError(f"a server is named twice in {', '.join(urls)}")
    return urls


def server_root(url: str) -> str:
    """The server's address without a trailing ``/v1``: request paths start with ``/v1``."""
    return re.sub(r"/v1/?$", "", url.rstrip("/"))


class ServersDown(AnexError, RuntimeError):
    """Every model server stopped answering and none came back while they were probed."""


@dataclass(eq=False)
class Server:
    root: str
    client: httpx.Client
    in_flight: int = 0
    up: bool = True
    failed_probes: int = 0  # since it was taken out
    probe_at: float = 0.0  # monotonic time of its next probe, while it is out
    probing: bool = False
    reason: str = ""  # why it was taken out
    served: int = 0  # rows it answered over the engine's life


class ServerPool:
    """Which servers are up and how busy each is; shared by the streams running on the engine."""

    def __init__(self, servers: list[Server], per_server: int, policy: RetryPolicy):
        self.servers = servers
        self.per_server = per_server
        self.policy = policy
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self.per_server * len(self.servers)

    def has_room(self) -> bool:
        return any(s.up and s.in_flight < self.per_server for s in self.servers)

    def reserve(self, avoid: Server | None = None) -> Server | None:
        """A slot on the least busy server that is up and has room, other than ``avoid`` if
        there is one; give it back with :meth:`release`."""
        with self._lock:
            ready = [s for s in self.servers if s.up and s.in_flight < self.per_server]
            preferred = [s for s in ready if s is not avoid] or ready
            server = min(preferred, key=lambda s: s.in_flight, default=None)
            if server is not None:
                server.in_flight += 1
            return server

    def release(self, server: Server, answered: bool) -> None:
        with self._lock:
            server.in_flight -= 1
            server.served += int(answered)

    def any_up(self) -> bool:
        return any(s.up for s in self.servers)

    def take_out(self, server: Server, reason: str) -> None:
        with self._lock:
            if not server.up:
                return
            server.up, server.failed_probes, server.reason = False, 0, reason
            server.probe_at = time.monotonic() + self.policy.backoff(0)
            others = sum(s.up for s in self.servers)
        log.warning("model server %s taken out (%s); %d other(s) still up", server.root, reason, others)

    def probes_due(self) -> list[Server]:
        now = time.monotonic()
        with self._lock:
            due = [s for s in self.servers if not s.up and not s.probing and s.probe_at <= now]
            for server in due:
                server.probing = True
        return due

    def probed(self, server: Server, error: str | None) -> None:
        """Records a probe's result: ``error`` None puts the server back."""
        with self._lock:
            server.probing = False
            if error is None:
                server.up, server.reason = True, ""
            else:
                server.reason = error
                server.failed_probes += 1
                server.probe_at = time.monotonic() + self.policy.backoff(server.failed_probes)
        if error is None:
            log.warning("model server %s answers again; sending it rows", server.root)

    def probe_dropped(self, server: Server) -> None:
        """A probe that never ran: the next stream probes the server instead."""
        with self._lock:
            server.probing = False

    def next_probe_in(self) -> float | None:
        waiting = [s.probe_at for s in self.servers if not s.up and not s.probing]
        return max(0.0, min(waiting) - time.monotonic()) if waiting else None

    def dead(self) -> bool:
        """Every server is out and has failed all its probes (``retries`` of them in a row)."""
        return all(not s.up and not s.probing and s.failed_probes >= self.policy.retries for s in self.servers)

    def down_message(self) -> str:
        names = "; ".join(f"{s.root} ({s.reason})" for s in self.servers)
        return (
            f"every model server stopped answering: {names}. Start them again (or fix base_url) and rerun: "
            "the rows finished so far are kept"
        )
