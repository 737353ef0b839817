"""The Prometheus metrics of this process: the one home of every figure ``serve`` shows on
``GET /metrics`` and ``run --metrics-port`` on its own port.

Counters count what happened in this process since it started (rows, tokens, media): a
restarted service starts them at zero, as Prometheus expects of a counter. Batches by status and
the engine's state are read when scraped. No label holds a tenant's key or anything a
tenant chose: labels are endpoints, outcomes, error types and states only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from anex_pipeline.spec import RowOutcome


class Engine(Protocol):
    """What the metrics read of a loaded engine (the engine package, above this module, imports it)."""

    @property
    def dead(self) -> bool: ...


REGISTRY = CollectorRegistry()
CONTENT_TYPE = CONTENT_TYPE_LATEST  # what exposition() writes

ROWS = Counter(
    "anex_rows",
    "Rows that reached an outcome in this process, by endpoint, outcome (completed or failed) and "
    "error type (the failed row's error code or class; empty for a completed row)",
    ["endpoint", "outcome", "error_type"],
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "anex_prompt_tokens", "Prompt tokens of the rows that reached an outcome", ["endpoint"], registry=REGISTRY
)
COMPLETION_TOKENS = Counter(
    "anex_completion_tokens", "Completion tokens of the rows that reached an outcome", ["endpoint"], registry=REGISTRY
)
CACHED_TOKENS = Counter(
    "anex_cached_prompt_tokens",
    "Prompt tokens the engine served from its prefix cache, of the rows that reached an outcome",
    ["endpoint"],
    registry=REGISTRY,
)
ROWS_IN_FLIGHT = Gauge("anex_rows_in_flight", "Rows handed to the engine that have not finished yet", registry=REGISTRY)
ENGINE_READY_SECONDS = Gauge(
    "anex_engine_ready_seconds", "How long the latest engine load took, until the engine was ready", registry=REGISTRY
)
MEDIA_DOWNLOADS = Counter("anex_media_downloads", "Media URLs downloaded", registry=REGISTRY)
MEDIA_HITS = Counter("anex_media_cache_hits", "Media URLs found in the media cache", registry=REGISTRY)
MEDIA_FAILURES = Counter("anex_media_failures", "Media URLs that could not be fetched", registry=REGISTRY)
BATCHES_FINISHED = Counter(
    "anex_batches_finished",
    "Batch API batches that ended in this process, by final status",
    ["status"],
    registry=REGISTRY,
)
WEBHOOKS = Counter(
    "anex_webhook_deliveries",
    "Webhook delivery attempts, by result (delivered, failed: retried later, dropped: given up)",
    ["result"],
    registry=REGISTRY,
)


def rows_finished(endpoint: str, outcomes: Iterable[RowOutcome]) -> None:
    """Counts rows that reached their outcome, with their tokens."""
    for o in outcomes:
        failed = o.error is not None
        ROWS.labels(endpoint, "failed" if failed else "completed", (o.error_type or "") if failed else "").inc()
        PROMPT_TOKENS.labels(endpoint).inc(o.usage.get("prompt_tokens", 0))
        COMPLETION_TOKENS.labels(endpoint).inc(o.usage.get("completion_tokens", 0))
        CACHED_TOKENS.labels(endpoint).inc(o.usage.get("cached_prompt_tokens", 0))


class _Engine:
    """What the engine is doing: loads in progress, and the latest engine loaded (or whether the
    latest load failed)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loads = 0
        self.engine: Engine | None = None
        self.failed = False

    def state(self) -> str:
        with self.lock:
            if self.loads:
                return "loading"
            if self.failed or (self.engine is not None and self.engine.dead):
                return "dead"
            return "idle" if self.engine is None else "ready"


_engine = _Engine()
ENGINE_STATES = ("idle", "loading", "ready", "dead")


@contextmanager
def engine_load() -> Iterator[Callable[[Engine], None]]:
    """Wraps one engine load; the block calls what it yields with the engine once it is ready. A
    load that raises leaves the state dead, unless a stop cut it short."""
    from anex_pipeline.errors import JobStopped

    started = time.monotonic()
    with _engine.lock:
        _engine.loads += 1

    def ready(engine: Engine) -> None:
        with _engine.lock:
            _engine.engine, _engine.failed = engine, False
        ENGINE_READY_SECONDS.set(time.monotonic() - started)

    try:
        yield ready
    except JobStopped:
        raise
    except BaseException:
        with _engine.lock:
            _engine.failed = True
        raise
    finally:
        with _engine.lock:
            _engine.loads -= 1


def engines_released() -> None:
    """Every engine of the process was shut down."""
    with _engine.lock:
        _engine.engine, _engine.failed = None, False


def engine_state() -> str:
    """``idle``, ``loading``, ``ready`` or ``dead``."""
    return _engine.state()


class _EngineState(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "anex_engine_state",
            "1 for the engine's state: idle (none loaded yet), loading, ready, or dead (its load failed or it died)",
            labels=["state"],
        )
        now = engine_state()
        for state in ENGINE_STATES:
            family.add_metric([state], float(state == now))
        yield family


REGISTRY.register(_EngineState())


class _Batches(Collector):
    """The Batch API's unfinished batches by status, and those waiting for their turn, read from
    the service when scraped."""

    def __init__(self) -> None:
        self.source: Callable[[], tuple[Mapping[str, int], int]] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.source is None:
            return
        by_status, queued = self.source()
        family = GaugeMetricFamily("anex_batches", "Unfinished Batch API batches, by status", labels=["status"])
        for status in ("validating", "in_progress", "finalizing", "cancelling"):
            family.add_metric([status], by_status.get(status, 0))
        yield family
        yield GaugeMetricFamily(
            "anex_batches_queued", "Batches waiting to be checked or for their turn to generate", value=queued
        )


_batches = _Batches()
REGISTRY.register(_batches)


def watch_batches(source: Callable[[], tuple[Mapping[str, int], int]] | None) -> None:
    """Makes ``source`` (unfinished batches by status, and the number queued) the Batch API's
    figures; None stops showing them."""
    _batches.source = source


def exposition() -> bytes:
    """The metrics in Prometheus's text format."""
    return generate_latest(REGISTRY)


def serve_metrics(port: int, host: str = "127.0.0.1") -> Any:
    """Serves the metrics on ``http://host:port/metrics`` from a background thread; returns the
    server (``shutdown()`` ends it). An address in use raises OSError."""
    server, _ = start_http_server(port, addr=host, registry=REGISTRY)
    return server
