"""Media that rows reference by URL: found, downloaded once, handed over as data.

The ``fetched_media`` stage (:func:`fetch_shard`) downloads every http(s) URL of a shard into a
disk cache keyed by URL that outlives the job, and records the rows whose media could not be
fetched. Generation then calls :func:`attach_media`, which fails those rows with
``media_fetch_error`` before they reach the engine and swaps every other row's URLs for
``data:`` URLs made from the cached bytes, so the engine never opens a connection.

Downloads are guarded. Only http and https are fetched. Every TCP connection, including each hop
of a redirect (redirects are followed here, one checked hop at a time), goes to an address that
was resolved and checked in the same step, so a host that resolves to a loopback, private,
link-local or cloud-metadata address is refused before a byte is sent to it, unless the job's
``media.allowed_hosts`` names it (``host`` for every port, ``host:port`` for one). The same check
runs before the cache answers, so media cached for a job that allowed a host are not handed to a
job that does not. Each request has one deadline, ``media.timeout_s`` from its first byte sent to
its last byte read (redirects included), and the stage stops at the job's time limit.

A cache that cannot store (a full disk) does not fail rows: the bytes are kept in memory for the
rows that need them.
"""

from __future__ import annotations

import base64
import ipaddress
import mimetypes
import os
import re
import socket
import sqlite3
import ssl
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urljoin, urlsplit

import diskcache
import httpcore
import httpx

from anex_pipeline.formats import InputRow
from anex_pipeline.http_retry import RetryPolicy, retryable_status
from anex_pipeline.jobs import JobDir, append_outcomes, read_outcomes
from anex_pipeline.models import cache_root
from anex_pipeline.spec import MediaOptions, RowError, RowOutcome

# Content part type -> (key of the reference inside the part's object, the kind of media it holds).
MEDIA_PARTS = {
    "image_url": ("url", "image"),
    "audio_url": ("url", "audio"),
    "video_url": ("url", "video"),
    "input_audio": ("data", "audio"),
}
TOTAL_CONNECTIONS = 16  # downloads in flight at once, over all hosts
MAX_REDIRECTS = 5
RETRY_AFTER_LIMIT_S = 60.0  # a server that asks for a longer wait fails the URL at once
BACKOFF_BASE_S = 0.5  # first wait after a 429/5xx without Retry-After; doubles per retry
BACKOFF_CAP_S = 30.0
CACHE_SIZE_LIMIT = 20 * 2**30  # the disk cache evicts the least recently stored media beyond this
REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
CLAIM_POLL_S = 0.05
SPOOL_IN_MEMORY_BYTES = 8 * 2**20  # a download larger than this is spooled to a file in the cache folder
# What a cache that cannot store raises: a full disk (OSError, sqlite's "disk is full" / "disk I/O
# error") or its database locked by a write that could not finish.
CACHE_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
# Metadata services. Most live on link-local or private addresses, refused anyway; the Azure one
# (168.63.129.16) is a public address, so the list is checked on its own.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200", "168.63.129.16", "192.0.0.192")
)
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated ::a.b.c.d; :: and ::1 are not of it
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # a network's own translator: never public
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
T = TypeVar("T")


def media_cache_dir() -> Path:
    """Where downloaded media are kept: ``$ANEX_MEDIA_CACHE_DIR``, else ``<cache_root>/media``."""
    configured = os.environ.get("ANEX_MEDIA_CACHE_DIR")
    return Path(configured).expanduser() if configured else cache_root() / "media"


def media_failures_path(job: JobDir, shard: int) -> Path:
    return job.shard_dir(shard) / "media.jsonl"


# -- finding references ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MediaRef:
    """One content part that holds media: where it is in the messages, and its URL."""

    message: int
    part: int
    type: str  # the content part type, a key of MEDIA_PARTS
    url: str

    @property
    def kind(self) -> str:
        return MEDIA_PARTS[self.type][1]

    @property
    def param(self) -> str:
        return f"messages[{self.message}].content[{self.part}]"

    @property
    def remote(self) -> bool:
        """Anything but an inline data: URL has to be fetched (or is refused)."""
        return not self.url.startswith("data:")


def media_references(body: dict[str, Any]) -> list[MediaRef]:
    """Every media reference in a chat body's content parts.

    ``input_audio`` parts normally carry raw base64 (no reference); they count when their
    ``data`` is a URL.
    """
    refs = []
    for m, message in enumerate(body.get("messages") or []):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in MEDIA_PARTS:
                continue
            value = part.get(kind)
            if isinstance(value, dict):
                value = value.get(MEDIA_PARTS[kind][0])
            if isinstance(value, str) and (kind != "input_audio" or _SCHEME.match(value)):
                refs.append(MediaRef(m, p, kind, value))
    return refs


# -- where connections may go ---------------------------------------------------------------------


def address_problem(address: str) -> str | None:
    """Why connecting to this IP address is refused by default; None for a public address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone (fe80::1%eth0) is not part of it
    if isinstance(ip, ipaddress.IPv6Address) and (embedded := _embedded_ipv4(ip)):
        problems = [p for p in map(address_problem, map(str, embedded)) if p]
        if problems:
            return problems[0]
        return "a local-use NAT64 address" if ip in _NAT64_LOCAL else None
    if ip in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_unspecified:
        return "the unspecified address, which reaches this machine"
    if ip.is_link_local:
        return "a link-local address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return "a site-local address"
    if ip.is_private:
        return "a private address"
    if not ip.is_global or ip.is_multicast:
        return "not a public unicast address"
    return None


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address maps, embeds or tunnels to (where a connection ends up):
    IPv4-mapped, IPv4-compatible, NAT64 (the IPv4 address in the last 32 bits), 6to4, and Teredo's
    server and client."""
    if ip.ipv4_mapped:
        return [ip.ipv4_mapped]
    if ip.sixtofour:
        return [ip.sixtofour]
    if ip.teredo:
        return list(ip.teredo)
    if (ip in _IPV4_COMPATIBLE and int(ip) > 1) or ip in _NAT64 or ip in _NAT64_LOCAL:
        return [ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)]
    return []


def allowed_endpoints(entries: Iterable[str]) -> frozenset[tuple[str, int | None]]:
    """``allowed_hosts`` entries as (host, port) pairs; port None opens every port of the host."""
    found = set()
    for entry in entries:
        entry = entry.strip().lower()
        host, port = entry, ""
        if entry.startswith("["):  # [v6 address] or [v6 address]:port
            host, _, rest = entry[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else ""
        elif entry.count(":") == 1:
            host, port = entry.split(":")
        found.add((host, int(port)) if port.isdigit() else (host, None))
    return frozenset(found)


class _Refused(Exception):
    """A connection the address policy does not allow; nothing was sent."""


class _OutOfTime(Exception):
    """The job's time limit ran out before this media arrived; the media are not at fault."""


# The monotonic time by which the current thread's request must be over (None: no deadline).
_request_deadline = threading.local()


@contextmanager
def _deadline(at: float) -> Iterator[None]:
    _request_deadline.at = at
    try:
        yield
    finally:
        _request_deadline.at = None


def _time_left(timeout: float | None, error: type[Exception]) -> float | None:
    """The timeout for one network operation: the one given, cut to what is left before the current
    request's deadline; raises ``error`` (an httpcore timeout) once the deadline has passed."""
    at = getattr(_request_deadline, "at", None)
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        raise error("the request's deadline passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose reads, writes and TLS handshake all end by the current request's deadline,
    so a host that answers a byte at a time cannot stretch a request past it."""

    def __init__(self, stream: httpcore.NetworkStream):
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _time_left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _time_left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        # The handshake's timeout bounds the whole handshake (Python's ssl keeps one deadline for it).
        limit = _time_left(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, limit))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _GuardedBackend(httpcore.SyncBackend):
    """Opens TCP connections only to hosts on the allow-list or to addresses that pass the policy.

    The host is resolved here and the connection goes to the very address that was checked, so a
    name cannot resolve to a public address for the check and a private one for the connection.
    """

    def __init__(self, allowed: frozenset[tuple[str, int | None]]):
        self.allowed = allowed

    def addresses(self, host: str, port: int) -> list[str] | None:
        """The checked addresses of host:port, or None when the allow-list names it (it is then
        connected to by name). Raises _Refused, or httpcore.ConnectError when the name does not resolve."""
        if (host.lower(), port) in self.allowed or (host.lower(), None) in self.allowed:
            return None
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise httpcore.ConnectError(f"the host name {host} does not resolve ({exc.strerror})") from None
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        for address in addresses:
            problem = address_problem(address)
            if problem:
                where = f"{host} is {problem}" if address == host else f"{host} resolves to {address}, {problem}"
                raise _Refused(
                    f"{where}; loopback, private, link-local and cloud-metadata hosts are refused unless the "
                    "job's media.allowed_hosts names them"
                )
        return addresses

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        failure: httpcore.ConnectError | None = None
        for address in self.addresses(host, port) or [host]:
            limit = _time_left(timeout, httpcore.ConnectTimeout)
            try:
                return _DeadlineStream(super().connect_tcp(address, port, limit, local_address, socket_options))
            except httpcore.ConnectError as exc:
                failure = exc
        raise failure or httpcore.ConnectError(f"{host} has no address")


@contextmanager
def _httpx_errors() -> Iterator[None]:
    """httpcore's errors as httpx's (a timeout as a timeout), as httpx's own transport raises them."""
    try:
        yield
    except httpcore.TimeoutException as exc:
        raise httpx.TimeoutException(str(exc)) from exc
    except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol, httpcore.ProxyError) as exc:
        raise httpx.TransportError(str(exc)) from exc


class _Body(httpx.SyncByteStream):
    def __init__(self, stream: Iterable[bytes]):
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        with _httpx_errors():
            yield from self._stream

    def close(self) -> None:
        close = getattr(self._stream, "close", None)
        if close is not None:
            close()


class _GuardedTransport(httpx.BaseTransport):
    """An httpx transport over an httpcore connection pool whose every connection is opened by the
    guarded backend. Built from public parts only: httpx's own transport takes no network backend."""

    def __init__(self, backend: _GuardedBackend):
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(),
            max_connections=TOTAL_CONNECTIONS,
            max_keepalive_connections=TOTAL_CONNECTIONS,
            network_backend=backend,
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = httpcore.URL(
            scheme=request.url.raw_scheme, host=request.url.raw_host, port=request.url.port, target=request.url.raw_path
        )
        outgoing = httpcore.Request(
            request.method, url, headers=request.headers.raw, content=request.stream, extensions=request.extensions
        )
        with _httpx_errors():
            response = self._pool.handle_request(outgoing)
        return httpx.Response(
            response.status, headers=response.headers, stream=_Body(response.stream), extensions=response.extensions
        )

    def close(self) -> None:
        self._pool.close()


def _client(options: MediaOptions, backend: _GuardedBackend) -> httpx.Client:
    return httpx.Client(
        transport=_GuardedTransport(backend),
        timeout=options.timeout_s,
        follow_redirects=False,
        trust_env=False,  # a proxy from the environment would connect on our behalf, unchecked
        headers={"User-Agent": "anex-pipeline media fetcher"},
    )


# -- downloading ----------------------------------------------------------------------------------


class MediaFetchError(Exception):
    """Media that could not be fetched; ``status`` is the remote HTTP status when there was one."""

    def __init__(self, url: str, reason: str, status: int | None = None, hop: str | None = None):
        via = f"after a redirect to {hop}, " if hop and hop != url else ""
        super().__init__(f"media {url} could not be fetched: {via}{reason}")
        self.url = url
        self.status = status


class _Retry(Exception):
    def __init__(self, status: int, retry_after: str | None):
        self.status = status
        self.retry_after = retry_after


@dataclass(frozen=True)
class Cached:
    """Fetched media: its type and size in bytes."""

    mime: str
    size: int


@dataclass
class FetchStats:
    fetched: int = 0
    from_cache: int = 0
    bytes_downloaded: int = 0
    not_cached: int = 0  # fetched, but the cache could not store them
    cache_problem: str = ""  # why the cache could not be used, the first time it failed


class MediaFetcher:
    """Brings media URLs into the disk cache, each once however many threads ask for it at once.

    A URL is looked up or downloaded once per fetcher (failures included); across fetchers and
    processes on the machine, a claim in the cache makes one download while the others wait for it.
    Media the cache cannot store (a full disk, a broken cache) are kept in memory for this fetcher
    when ``hold_uncached``, else only counted. ``stop_at`` (a ``time.monotonic()`` value) is when
    fetching must end: what has not arrived by then raises _OutOfTime, not MediaFetchError.
    """

    def __init__(
        self,
        options: MediaOptions,
        cache_dir: Path | None = None,
        *,
        stop_at: float | None = None,
        hold_uncached: bool = True,
    ):
        self.options = options
        self.folder = Path(cache_dir or media_cache_dir())
        self.stop_at = stop_at
        self.hold_uncached = hold_uncached
        self.stats = FetchStats()
        self.backend = _GuardedBackend(allowed_endpoints(options.allowed_hosts))
        self.client = _client(options, self.backend)
        self._lock = threading.Lock()
        self._results: dict[str, Future[Cached]] = {}
        self._encoded: dict[str, str] = {}
        self._uncached: dict[str, bytes] = {}
        self._hosts: dict[tuple[str, str, int | None], threading.BoundedSemaphore] = {}
        # How long a claim holds when its process died mid-download: one URL's worst case.
        self._claim_s = (options.timeout_s + RETRY_AFTER_LIMIT_S) * (options.max_retries + 1 + MAX_REDIRECTS)
        self.cache: diskcache.Cache | None = None
        try:
            self.cache = diskcache.Cache(str(self.folder), size_limit=CACHE_SIZE_LIMIT)
        except CACHE_ERRORS as exc:
            self._cache_failed(exc)

    def __enter__(self) -> MediaFetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self._cache_op(lambda cache: cache.close(), None)

    def fetch(self, url: str) -> Cached:
        """The media at ``url``, downloaded first when needed; raises MediaFetchError."""
        with self._lock:
            future = self._results.get(url)
            owner = future is None
            if future is None:
                future = self._results[url] = Future()
        if owner:
            try:
                future.set_result(self._cached_or_download(url))
            except BaseException as exc:
                future.set_exception(exc)
        return future.result()

    def checked(self, ref: MediaRef) -> Cached:
        """The media of a remote reference, which must be of the kind its content part needs."""
        cached = self.fetch(ref.url)
        if cached.mime.split("/")[0] != ref.kind:
            raise MediaFetchError(ref.url, f"it is {cached.mime}, not the {ref.kind} its {ref.type} part needs")
        return cached

    def inline_value(self, ref: MediaRef) -> Any:
        """What replaces the reference in its part: a data: URL, or input_audio's data and format;
        None when the reference is already inline and needs no change."""
        if not ref.remote:
            header, _, payload = ref.url.partition(",")
            if ref.type != "input_audio" or not header.endswith(";base64"):
                return None
            return {"data": payload, "format": _audio_format(header[5:].split(";")[0])}
        cached = self.checked(ref)
        encoded = self._encoded.get(ref.url)
        if encoded is None:
            encoded = self._encoded[ref.url] = base64.b64encode(self._read(ref.url)).decode("ascii")
        if ref.type == "input_audio":
            return {"data": encoded, "format": _audio_format(cached.mime)}
        return f"data:{cached.mime};base64,{encoded}"

    def _cache_op(self, op: Callable[[diskcache.Cache], T], otherwise: T) -> T:
        """``op(cache)``, or ``otherwise`` when there is no cache or it fails (a full disk, a broken
        database): media then bypass the cache rather than fail."""
        if self.cache is None:
            return otherwise
        try:
            return op(self.cache)
        except CACHE_ERRORS as exc:
            self._cache_failed(exc)
            return otherwise

    def _cache_failed(self, exc: Exception) -> None:
        with self._lock:
            if not self.stats.cache_problem:
                self.stats.cache_problem = f"the media cache {self.folder} failed: {str(exc) or type(exc).__name__}"

    def _read(self, url: str) -> bytes:
        for _ in range(2):
            with self._lock:
                held = self._uncached.get(url)
            if held is not None:
                return held
            handle, _ = self._cache_op(lambda cache: cache.get(url, read=True, tag=True), (None, None))
            if handle is not None:
                with handle:
                    return handle.read()
            self._cached_or_download(url)  # evicted since it was fetched
        raise MediaFetchError(url, "the media cache dropped it as soon as it was stored")

    def _lookup(self, url: str) -> Cached | None:
        """The cached media of ``url``, once every host its download went through passes the policy."""
        handle, tag = self._cache_op(lambda cache: cache.get(url, read=True, tag=True), (None, None))
        if handle is None:
            return None
        with handle:
            size = handle.seek(0, os.SEEK_END)
        mime, *hops = (tag or "").split("\n")
        for hop in hops:
            self._check_destination(url, hop)
        return Cached(mime, size)

    def _from_cache(self, url: str) -> Cached | None:
        found = self._lookup(url)
        if found is not None:
            with self._lock:
                self.stats.from_cache += 1
        return found

    def _check_destination(self, url: str, hop: str) -> None:
        """Raises MediaFetchError unless the job's policy lets ``hop`` be fetched: its scheme, and its
        host on the allow-list or resolving to allowed addresses only."""
        _check_scheme(url, hop)
        parts = urlsplit(hop)
        try:
            port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
            self.backend.addresses(parts.hostname or "", port)
        except ValueError as exc:
            raise MediaFetchError(url, f"the URL is malformed ({exc})", hop=hop) from None
        except (_Refused, httpcore.ConnectError) as exc:
            raise MediaFetchError(url, str(exc), hop=hop) from None

    def _cached_or_download(self, url: str) -> Cached:
        self._check_destination(url, url)  # the policy holds for cached media too
        found = self._from_cache(url)
        claim = ("downloading", url)
        claimed: bool | None = None  # None: the cache cannot hold claims; download without one
        while found is None:
            claimed = self._cache_op(lambda cache: cache.add(claim, os.getpid(), expire=self._claim_s), None)
            if claimed is not False:
                break
            self._check_time_left()
            time.sleep(CLAIM_POLL_S)  # another fetcher is downloading it
            found = self._from_cache(url)
        if found is not None:
            return found
        try:
            return self._from_cache(url) or self._download(url)
        finally:
            if claimed:
                self._cache_op(lambda cache: cache.delete(claim), None)

    def _job_time_left(self) -> float | None:
        return None if self.stop_at is None else self.stop_at - time.monotonic()

    def _check_time_left(self) -> None:
        left = self._job_time_left()
        if left is not None and left <= 0:
            raise _OutOfTime()

    def _download(self, url: str) -> Cached:
        """Requests the URL, following redirects one checked hop at a time and retrying 429 and 5xx.

        One attempt (a request and the redirects it leads to) has ``timeout_s`` in all; a retry
        starts a new attempt at the hop that failed.
        """
        hop, hops = url, []
        attempt = 0
        deadline: float | None = None  # set when the attempt's first request starts
        while True:
            _check_scheme(url, hop)
            self._check_time_left()
            try:
                with self._host_slot(hop):
                    if deadline is None:
                        deadline = time.monotonic() + self.options.timeout_s
                    result = self._request(url, hop, deadline, hops)
            except _Refused as exc:
                raise MediaFetchError(url, str(exc), hop=hop) from None
            except _Retry as retry:
                self._pause_before_retry(url, hop, retry, attempt)
                attempt += 1
                deadline = None
                continue
            if isinstance(result, Cached):
                return result
            if len(hops) == MAX_REDIRECTS:
                raise MediaFetchError(url, f"it redirected more than {MAX_REDIRECTS} times")
            hop = result
            hops.append(hop)

    def _pause_before_retry(self, url: str, hop: str, retry: _Retry, attempt: int) -> None:
        """Waits as the server asked (or backs off), or raises when retrying is over."""
        retries = self.options.max_retries
        policy = RetryPolicy(retries=retries, backoff_s=BACKOFF_BASE_S, max_wait_s=BACKOFF_CAP_S)
        wait = policy.wait(attempt, retry.retry_after)
        if not policy.may_retry(attempt + 1):
            raise MediaFetchError(
                url,
                f"the server answered {retry.status} {_phrase(retry.status)} to all "
                f"{retries + 1} attempts (media.max_retries is {retries})",
                retry.status,
                hop,
            ) from None
        if wait > RETRY_AFTER_LIMIT_S:
            raise MediaFetchError(
                url,
                f"the server answered {retry.status} {_phrase(retry.status)} and asked to retry after "
                f"{wait:.0f} s, longer than the {RETRY_AFTER_LIMIT_S:.0f} s this stage waits",
                retry.status,
                hop,
            ) from None
        left = self._job_time_left()
        time.sleep(wait if left is None else max(0.0, min(wait, left)))

    @contextmanager
    def _host_slot(self, url: str) -> Iterator[None]:
        parts = urlsplit(url)
        key = (parts.scheme, parts.hostname or "", parts.port)
        with self._lock:
            slot = self._hosts.setdefault(key, threading.BoundedSemaphore(self.options.per_host_connections))
        left = self._job_time_left()
        if not slot.acquire(timeout=None if left is None else max(0.0, left)):
            raise _OutOfTime()
        try:
            yield
        finally:
            slot.release()

    def _request(self, url: str, hop: str, deadline: float, hops: list[str]) -> Cached | str:
        """One request, over by the attempt's deadline (or the job's stop, if sooner); returns the
        media, or the URL it redirects to."""
        at = deadline if self.stop_at is None else min(deadline, self.stop_at)
        try:
            with _deadline(at), self.client.stream("GET", hop) as response:
                status = response.status_code
                if status in REDIRECT_CODES and "location" in response.headers:
                    return urljoin(hop, response.headers["location"])
                if retryable_status(status):
                    raise _Retry(status, response.headers.get("retry-after"))
                if not response.is_success:
                    raise MediaFetchError(url, f"the server answered {status} {_phrase(status)}", status, hop)
                return self._store(url, hop, response, hops)
        except httpx.TimeoutException:
            self._check_time_left()
            timeout = self.options.timeout_s
            raise MediaFetchError(url, f"it did not arrive within media.timeout_s={timeout:g} s", hop=hop) from None
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise MediaFetchError(url, f"the transfer failed: {exc}", hop=hop) from None

    def _store(self, url: str, hop: str, response: httpx.Response, hops: list[str]) -> Cached:
        """Reads the body, stopping as soon as it breaks the size limit, and stores it in the cache
        (with the hops it came through), or in memory when the cache cannot take it."""
        limit = self.options.max_bytes
        mime = _media_type(response.headers.get("content-type"), hop)
        if mime is None:
            stated = response.headers.get("content-type") or "of no stated type"
            raise MediaFetchError(url, f"it is {stated}, not an image, audio or video file", hop=hop)
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise MediaFetchError(url, f"it is {declared} bytes, more than media.max_bytes={limit}", hop=hop)
        size = 0
        spool_dir = str(self.folder) if self.folder.is_dir() else None
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY_BYTES, dir=spool_dir) as spool:
            for chunk in response.iter_bytes():  # as they arrive: a chunk size would wait to fill it
                size += len(chunk)
                if size > limit:
                    raise MediaFetchError(url, f"it is larger than media.max_bytes={limit}; stopped reading", hop=hop)
                try:
                    spool.write(chunk)
                except OSError as exc:  # a large download, and no room on the cache's disk to spool it
                    raise MediaFetchError(
                        url,
                        f"it is larger than {SPOOL_IN_MEMORY_BYTES // 2**20} MiB and the media cache {self.folder} has "
                        f"no room to hold it ({exc.strerror}); free some space there or set ANEX_MEDIA_CACHE_DIR",
                        hop=hop,
                    ) from None
            spool.seek(0)
            tag = "\n".join([mime, *hops])
            stored = self._cache_op(lambda cache: cache.set(url, spool, read=True, tag=tag), False)
            held = None
            if not stored and self.hold_uncached:
                spool.seek(0)
                held = spool.read()
        with self._lock:
            self.stats.fetched += 1
            self.stats.bytes_downloaded += size
            self.stats.not_cached += int(not stored)
            if held is not None:
                self._uncached[url] = held
        return Cached(mime, size)


def _check_scheme(url: str, hop: str) -> None:
    parts = urlsplit(hop)
    if parts.scheme.lower() not in ("http", "https"):
        scheme = f"{parts.scheme}: URLs" if parts.scheme else "a URL without a scheme"
        raise MediaFetchError(url, f"only http and https URLs are fetched, not {scheme}", hop=hop)
    if not parts.hostname:
        raise MediaFetchError(url, "the URL names no host", hop=hop)


def _media_type(content_type: str | None, url: str) -> str | None:
    """The media type of a body, guessed from the URL when the server gives none; None if not media."""
    mime = (content_type or "").split(";", 1)[0].strip().lower()
    if mime in ("", "application/octet-stream", "binary/octet-stream"):
        mime = mimetypes.guess_type(urlsplit(url).path)[0] or ""
    return mime if mime.split("/")[0] in ("image", "audio", "video") else None


def _audio_format(mime: str) -> str:
    """input_audio's format from a media type: audio/x-wav -> wav, audio/mpeg -> mpeg."""
    return mime.split("/")[-1].removeprefix("x-")


def _phrase(status: int) -> str:
    try:
        return httpx.codes(status).phrase
    except ValueError:
        return ""


# -- the stage, and what generation uses ----------------------------------------------------------


def media_failure(row: InputRow, ref: MediaRef, error: MediaFetchError) -> RowOutcome:
    """A row that fails because one of its media could not be fetched."""
    return RowOutcome(
        index=row.index,
        key=row.key,
        status_code=error.status,
        error=RowError(message=str(error), type="media_fetch_error", code=error.status, param=ref.param),
    )


def _first_failure(fetcher: MediaFetcher, row: InputRow, refs: Sequence[MediaRef]) -> RowOutcome | None:
    for ref in refs:
        if ref.remote:
            try:
                fetcher.checked(ref)
            except MediaFetchError as exc:
                return media_failure(row, ref, exc)
    return None


def fetch_shard(job: JobDir, shard: int, options: MediaOptions, cache_dir: Path | None = None) -> dict[str, Any]:
    """Downloads the media of the shard's unfinished rows and records the rows whose media failed.

    Fetching stops when the job's time limit runs out; the media not fetched by then fail no row
    (generation then stops the job, as it does whenever the time is up). Returns the
    materialization metadata: URLs seen, fetched, served from cache, failed by code, and bytes.
    """
    started = time.monotonic()
    finished = job.finished_rows(shard)
    rows: list[tuple[InputRow, list[MediaRef]]] = []
    total = inline = 0
    for row in job.read_requests(shard):
        total += 1
        refs = media_references(row.body) if row.index not in finished else []
        inline += sum(1 for ref in refs if not ref.remote)
        if refs:
            rows.append((row, refs))
    urls = list(dict.fromkeys(ref.url for _, refs in rows for ref in refs if ref.remote))
    failures: list[RowOutcome] = []
    codes: Counter[str] = Counter()
    stats = FetchStats()
    media_bytes = out_of_time = 0
    if urls:
        left = job.time_left()
        stop_at = None if left is None else time.monotonic() + left
        # The stage only fills the cache; what the cache cannot store, generation fetches again.
        with (
            MediaFetcher(options, cache_dir, stop_at=stop_at, hold_uncached=False) as fetcher,
            ThreadPoolExecutor(TOTAL_CONNECTIONS) as pool,
        ):
            for future in [pool.submit(fetcher.fetch, url) for url in urls]:
                error = future.exception()
                if isinstance(error, _OutOfTime):
                    out_of_time += 1
                elif isinstance(error, MediaFetchError):
                    codes[str(error.status or "none")] += 1
                elif error is not None:
                    raise error
                else:
                    media_bytes += future.result().size
            if not out_of_time:
                failures = [f for row, refs in rows if (f := _first_failure(fetcher, row, refs))]
            stats = fetcher.stats
    path = media_failures_path(job, shard)
    path.unlink(missing_ok=True)
    append_outcomes(path, failures)
    return {
        "rows": total,
        "rows_with_media": len(rows),
        "inline_media": inline,
        "urls_seen": len(urls),
        "fetched": stats.fetched,
        "from_cache": stats.from_cache,
        "not_cached": stats.not_cached,
        "cache_problem": stats.cache_problem,
        "failed_urls": sum(codes.values()),
        "failed_by_code": dict(codes),
        "not_fetched_time_limit": out_of_time,
        "rows_failed": len(failures),
        "bytes": media_bytes,
        "bytes_downloaded": stats.bytes_downloaded,
        "seconds": round(time.monotonic() - started, 3),
    }


def recorded_failures(job: JobDir, shard: int) -> dict[int, RowOutcome]:
    """The rows the media stage failed for this shard, by row index."""
    return read_outcomes(media_failures_path(job, shard))


def attach_media(
    rows: Sequence[InputRow],
    options: MediaOptions,
    recorded: dict[int, RowOutcome] | None = None,
    cache_dir: Path | None = None,
) -> tuple[list[InputRow], list[RowOutcome]]:
    """Splits rows into those ready for the engine, their media now inline as data, and failures.

    ``recorded`` are the media stage's failures; media that stage did not leave in the cache are
    fetched here, so rows can also be prepared without it.
    """
    recorded = recorded or {}
    ready: list[InputRow] = []
    failed: list[RowOutcome] = []
    with ExitStack() as stack:
        fetcher: MediaFetcher | None = None
        for row in rows:
            if row.index in recorded:
                failed.append(recorded[row.index])
                continue
            refs = media_references(row.body)
            if not refs:
                ready.append(row)
                continue
            fetcher = fetcher or stack.enter_context(MediaFetcher(options, cache_dir))
            values = {}
            for ref in refs:
                try:
                    values[ref] = fetcher.inline_value(ref)
                except MediaFetchError as exc:
                    failed.append(media_failure(row, ref, exc))
                    break
            else:
                ready.append(InputRow(row.index, row.key, _with_values(row.body, values)))
    return ready, failed


def _with_values(body: dict[str, Any], values: dict[MediaRef, Any]) -> dict[str, Any]:
    """A copy of the body with each reference's part given its new value (the input is not changed)."""
    messages = list(body["messages"])
    for ref, value in values.items():
        if value is None:
            continue
        message = dict(messages[ref.message])
        content = list(message["content"])
        part = dict(content[ref.part])
        inner = part[ref.type]
        if ref.type == "input_audio":
            part[ref.type] = {**inner, **value}
        else:
            part[ref.type] = {**inner, "url": value} if isinstance(inner, dict) else {"url": value}
        content[ref.part] = part
        message["content"] = content
        messages[ref.message] = message
    return {**body, "messages": messages}
