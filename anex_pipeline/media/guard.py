"""The address policy for media downloads and the guarded network backend that enforces it.

Only http and https are fetched. Every TCP connection, including each hop of a redirect, goes to an
address that was resolved and checked in the same step, so a host that resolves to a loopback,
private, link-local or cloud-metadata address is refused before a byte is sent to it, unless the
job's ``media.allowed_hosts`` names it (``host`` for every port, ``host:port`` for one). Each
request has one deadline, from its first byte sent to its last byte read."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import httpcore
import httpx

from anex_pipeline.errors import AnexError
from anex_pipeline.spec import MediaOptions

# Metadata services. Most live on link-local or private addresses, refused anyway; the Azure one
# (168.63.129.16) is a public address, so the list is checked on its own.
TOTAL_CONNECTIONS = 16  # downloads in flight at once, over all hosts
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200", "168.63.129.16", "192.0.0.192")
)


_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated ::a.b.c.d; :: and ::1 are not of it


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # a network's own translator: never public


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


class AddressRefused(AnexError):
    """A connection the address policy does not allow; nothing was sent."""


# The monotonic time by which the current thread's request must be over (None: no deadline).
_deadline_of_thread = threading.local()


@contextmanager
def request_deadline(at: float) -> Iterator[None]:
    """Within this block, every network operation of the current thread's requests ends by the
    monotonic time ``at``: each one's timeout is cut to what is left."""
    _deadline_of_thread.at = at
    try:
        yield
    finally:
        _deadline_of_thread.at = None


def _time_left(timeout: float | None, error: type[Exception]) -> float | None:
    """The timeout for one network operation: the one given, cut to what is left before the current
    request's deadline; raises ``error`` (an httpcore timeout) once the deadline has passed."""
    at = getattr(_deadline_of_thread, "at", None)
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


class GuardedBackend(httpcore.SyncBackend):
    """Opens TCP connections only to hosts on the allow-list or to addresses that pass the policy.

    The host is resolved here and the connection goes to the very address that was checked, so a
    name cannot resolve to a public address for the check and a private one for the connection.
    """

    def __init__(self, allowed: frozenset[tuple[str, int | None]], allowed_by: str = "the job's media.allowed_hosts"):
        self.allowed = allowed
        self.allowed_by = allowed_by  # what lets a refused host through, for the refusal's message

    def addresses(self, host: str, port: int) -> list[str] | None:
        """The checked addresses of host:port, or None when the allow-list names it (it is then
        connected to by name). Raises AddressRefused, or httpcore.ConnectError when the name does not resolve."""
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
                raise AddressRefused(
                    f"{where}; loopback, private, link-local and cloud-metadata hosts are refused unless "
                    f"{self.allowed_by} names them"
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

    def __init__(self, backend: GuardedBackend):
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


def media_client(
    options: MediaOptions, backend: GuardedBackend, user_agent: str = "anex-pipeline media fetcher"
) -> httpx.Client:
    """An httpx client that connects only through ``backend`` (the address policy), follows no
    redirect itself and ignores proxies from the environment."""
    return httpx.Client(
        transport=_GuardedTransport(backend),
        timeout=options.timeout_s,
        follow_redirects=False,
        trust_env=False,  # a proxy from the environment would connect on our behalf, unchecked
        headers={"User-Agent": user_agent},
    )


def guarded_client(allowed_hosts: Iterable[str], allowed_by: str, timeout_s: float, user_agent: str) -> httpx.Client:
    """An httpx client for other outbound requests (webhooks) under the same address policy, with
    ``allowed_hosts`` let through; ``allowed_by`` names that setting in a refusal. A connection
    the policy refuses raises before a byte is sent."""
    backend = GuardedBackend(allowed_endpoints(allowed_hosts), allowed_by)
    return media_client(MediaOptions(timeout_s=timeout_s), backend, user_agent)


def refusal(host: str, port: int, allowed_hosts: Iterable[str], allowed_by: str) -> str | None:
    """Why the policy refuses host:port right now (None: allowed, or the name does not resolve)."""
    try:
        GuardedBackend(allowed_endpoints(allowed_hosts), allowed_by).addresses(host, port)
    except AddressRefused as exc:
        return str(exc)
    except httpcore.ConnectError:
        return None
    return None
