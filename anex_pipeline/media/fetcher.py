"""The cached media downloader: one download per URL per machine, kept in a disk cache keyed by URL
that outlives the job.

Downloads go through the guarded client of :mod:`anex_pipeline.media.guard`, and the address check
runs again before the cache answers, so media cached for a job that allowed a host are not handed
to a job that does not. Retries on 429/5xx honour ``Retry-After``; a response larger than the
job's cap is refused.

A cache that cannot store (a full disk) does not fail rows: the bytes are kept in memory for the
rows that need them.

The module is a little over the project's usual ~400 lines because :class:`MediaFetcher` is one
state machine (claim a URL, check its address, download with retries and a deadline, store, hand
out) whose steps share the cache, the per-host slots and the statistics.
"""

from __future__ import annotations

import base64
import mimetypes
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urljoin, urlsplit

import diskcache
import httpcore
import httpx

from anex_pipeline import metrics
from anex_pipeline.errors import AnexError
from anex_pipeline.media.audio import sound_seconds
from anex_pipeline.media.guard import (
    AddressRefused,
    GuardedBackend,
    allowed_endpoints,
    media_client,
    request_deadline,
)
from anex_pipeline.net.retry import RetryPolicy, retryable_status
from anex_pipeline.paths import media_cache_dir, private_problem
from anex_pipeline.spec import MediaOptions
from anex_pipeline.validate.media_refs import MediaRef, fetch_problem

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
T = TypeVar("T")


class _NoPickles(diskcache.Disk):
    """diskcache's storage, refusing a value stored as a pickle. The media cache stores bytes,
    files and numbers, never a pickle, so one found in its database was written by someone else,
    and unpickling it would run their code: it is refused, which diskcache takes as a miss (the
    media are downloaded again and stored over it)."""

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> Any:
        if mode == diskcache.core.MODE_PICKLE:
            raise OSError("it holds a pickled value, which it never writes (written there by someone else)")
        return super().fetch(mode, filename, value, read)


class MediaOutOfTime(AnexError):
    """The job's time limit ran out before this media arrived; the media are not at fault."""


class MediaFetchError(AnexError):
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
    """Fetched media: its type, size in bytes, and whether the cache had it already."""

    mime: str
    size: int
    from_cache: bool = False


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
    fetching must end: what has not arrived by then raises MediaOutOfTime, not MediaFetchError.
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
        self.backend = GuardedBackend(allowed_endpoints(options.allowed_hosts))
        self.client = media_client(options, self.backend)
        self._lock = threading.Lock()
        self._results: dict[str, Future[Cached]] = {}
        self._encoded: dict[str, str] = {}
        self._lengths: dict[str, float | None] = {}  # a sound's seconds by URL (None: not readable here)
        self._uncached: dict[str, bytes] = {}
        self._hosts: dict[tuple[str, str, int | None], threading.BoundedSemaphore] = {}
        # How long a claim holds when its process died mid-download: one URL's worst case.
        self._claim_s = (options.timeout_s + RETRY_AFTER_LIMIT_S) * (options.max_retries + 1 + MAX_REDIRECTS)
        self.cache: diskcache.Cache | None = None
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if (problem := private_problem(self.folder, os.stat(self.folder))) is not None:
                raise OSError(f"it is not used, since {problem}")
            self.cache = diskcache.Cache(str(self.folder), size_limit=CACHE_SIZE_LIMIT, disk=_NoPickles)
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
                cached = self._cached_or_download(url)
            except BaseException as exc:
                if isinstance(exc, MediaFetchError):  # not a stop that cut the fetch short
                    metrics.MEDIA_FAILURES.inc()
                future.set_exception(exc)
            else:
                (metrics.MEDIA_HITS if cached.from_cache else metrics.MEDIA_DOWNLOADS).inc()
                future.set_result(cached)
        return future.result()

    def checked(self, ref: MediaRef) -> Cached:
        """The media of a remote reference, which must be of the kind its content part needs."""
        cached = self.fetch(ref.url)
        if cached.mime.split("/")[0] != ref.kind:
            raise MediaFetchError(ref.url, f"it is {cached.mime}, not the {ref.kind} its {ref.type} part needs")
        return cached

    def check_inline(self, ref: MediaRef) -> None:
        """Raises MediaFetchError for inline ``data:`` media larger than ``media.max_bytes``, the
        cap downloads have too; measured from the base64 text's length, before anything decodes it."""
        header, _, payload = ref.url.partition(",")
        size = len(payload) * 3 // 4 if header.endswith(";base64") else len(payload)
        limit = self.options.max_bytes
        if size > limit:
            label = f"{header[:60]},..." if len(header) < 60 else f"{header[:60]}..."
            raise MediaFetchError(label, f"it is about {size} bytes, more than media.max_bytes={limit}", status=413)

    def _check_length(self, ref: MediaRef, data: Callable[[], bytes]) -> None:
        """Raises MediaFetchError for a sound longer than ``media.max_audio_seconds`` (read from
        its header; a sound that cannot be read here is left to the model, which refuses it)."""
        if ref.url not in self._lengths:
            self._lengths[ref.url] = sound_seconds(data())
        seconds, limit = self._lengths[ref.url], self.options.max_audio_seconds
        if seconds is not None and seconds > limit:
            label = ref.url if ref.remote else ref.url.partition(",")[0] + ",..."
            raise MediaFetchError(
                label, f"it is {seconds:.1f} s long, more than media.max_audio_seconds={limit:g}", status=413
            )

    def inline_value(self, ref: MediaRef) -> Any:
        """What replaces the reference in its part: a data: URL, or input_audio's data and format;
        None when the reference is already inline and needs no change."""
        if not ref.remote:
            self.check_inline(ref)
            if ref.kind == "audio":
                self._check_length(ref, lambda: _inline_bytes(ref.url))
            header, _, payload = ref.url.partition(",")
            if ref.type != "input_audio" or not header.endswith(";base64"):
                return None
            return {"data": payload, "format": _audio_format(header[5:].split(";")[0])}
        cached = self.checked(ref)
        if ref.kind == "audio":
            self._check_length(ref, lambda: self._read(ref.url))
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
        return Cached(mime, size, from_cache=True)

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
        except (AddressRefused, httpcore.ConnectError) as exc:
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
            raise MediaOutOfTime("the job's time limit ran out before the media arrived")

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
            except AddressRefused as exc:
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
            raise MediaOutOfTime("the job's time limit ran out before the media arrived")
        try:
            yield
        finally:
            slot.release()

    def _request(self, url: str, hop: str, deadline: float, hops: list[str]) -> Cached | str:
        """One request, over by the attempt's deadline (or the job's stop, if sooner); returns the
        media, or the URL it redirects to."""
        at = deadline if self.stop_at is None else min(deadline, self.stop_at)
        try:
            with request_deadline(at), self.client.stream("GET", hop) as response:
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


def _media_type(content_type: str | None, url: str) -> str | None:
    """The media type of a body, guessed from the URL when the server gives none; None if not media."""
    mime = (content_type or "").split(";", 1)[0].strip().lower()
    if mime in ("", "application/octet-stream", "binary/octet-stream"):
        mime = mimetypes.guess_type(urlsplit(url).path)[0] or ""
    return mime if mime.split("/")[0] in ("image", "audio", "video") else None


def _inline_bytes(url: str) -> bytes:
    """The bytes of a base64 ``data:`` URL (empty when it is not one)."""
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        return b""
    try:
        return base64.b64decode(payload)
    except ValueError:
        return b""


def _audio_format(mime: str) -> str:
    """input_audio's format from a media type: audio/x-wav -> wav, audio/mpeg -> mpeg."""
    return mime.split("/")[-1].removeprefix("x-")


def _phrase(status: int) -> str:
    try:
        return httpx.codes(status).phrase
    except ValueError:
        return ""


def _check_scheme(url: str, hop: str) -> None:
    if (why := fetch_problem(hop)) is not None:
        raise MediaFetchError(url, why, hop=hop)
