"""Model runtimes behind one interface, loaded once per process and shared by every shard."""

from __future__ import annotations

import logging
import threading
import time

from anex_pipeline.engine.base import Engine, EngineRequest, resolve_request
from anex_pipeline.engine.openai_http import HttpSettings, OpenAIHttpEngine
from anex_pipeline.engine.orphans import guard_descendants
from anex_pipeline.engine.vllm_local import EngineSettings
from anex_pipeline.errors import AnexError

__all__ = [
    "Engine",
    "EngineLoadFailed",
    "EngineRequest",
    "EngineSettings",
    "HttpSettings",
    "load_engine",
    "release_engines",
    "resolve_request",
]

progress = logging.getLogger("anex_pipeline.progress")
RELEASE_WAIT_S = 5.0  # how long releasing waits for a load in progress before leaving it
_lock = threading.Lock()
_loaded: dict[EngineSettings | HttpSettings, Engine] = {}
FAILED_LOAD_KEPT_S = 60.0  # how long a failed load's reason answers for the same settings
_failed: dict[EngineSettings, tuple[float, str]] = {}  # settings -> when and why their latest load failed


class EngineLoadFailed(AnexError):
    """The engine could not be loaded (e.g. the model is missing, its configuration is not one
    vLLM accepts, or memory ran out): loading it again at once with the same settings would fail
    the same way, so for :data:`FAILED_LOAD_KEPT_S` the same settings get the same failure."""


def load_engine(settings: EngineSettings | HttpSettings) -> Engine:
    """The engine for these settings, loading it on first use; other loaded models are shut down
    first so two models never hold memory at once. An HTTP engine is only a client of its server."""
    with _lock:
        if settings in _loaded and getattr(_loaded[settings], "dead", False):
            progress.info("the engine for %s died; loading it again", _loaded[settings].model_name)
            _shutdown(_loaded.pop(settings))
        if settings in _loaded:
            return _loaded[settings]
        if isinstance(settings, HttpSettings):
            engine = _loaded[settings] = OpenAIHttpEngine(settings)
            progress.info("sending rows to the model server(s) at %s", engine.root)
            return engine
        failed = _failed.get(settings)
        if failed is not None and time.monotonic() - failed[0] < FAILED_LOAD_KEPT_S:  # e.g. a load ahead of time
            raise EngineLoadFailed(failed[1])
        for other in list(_loaded):
            _shutdown(_loaded.pop(other))
        from anex_pipeline.engine.vllm_local import VllmLocalEngine, one_line

        guard_descendants()  # vLLM's processes must not outlive this one, however it ends
        started = time.monotonic()
        progress.info("loading %s into vLLM", settings.model_name)
        try:
            engine = VllmLocalEngine(settings)
        except Exception as exc:
            from anex_pipeline.stopping import JobStopped

            if isinstance(exc, JobStopped):  # a stop signal cut the wait short: not a fault of the load
                raise
            reason = f"the engine could not load {settings.model_name}: {one_line(exc)[:600]}"
            _failed[settings] = (time.monotonic(), reason)
            raise EngineLoadFailed(reason) from exc
        _failed.pop(settings, None)
        progress.info("engine ready in %.1f s", time.monotonic() - started)
        _loaded[settings] = engine
        return engine


def release_engines() -> None:
    """Shuts down every engine this process loaded. An engine still loading is left alone: the
    load cannot be cut short, and a process that is ending must not wait minutes for it."""
    if not _lock.acquire(timeout=RELEASE_WAIT_S):
        progress.info("an engine is still loading; not waiting for it")
        return
    try:
        while _loaded:
            _shutdown(_loaded.popitem()[1])
    finally:
        _lock.release()


def _shutdown(engine: Engine) -> None:
    stop = getattr(engine, "shutdown", None)
    if stop is not None:
        try:
            stop()
        except Exception as exc:  # a dead engine may fail to stop cleanly; it is dropped all the same
            progress.info("shutting down %s failed: %s", engine.model_name, exc)
