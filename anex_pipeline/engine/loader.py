"""Model runtimes behind one interface, loaded once per process and shared by every shard.

:func:`engine_for` gives a job its engine from an :class:`EngineConfig`. Engines are looked up by
the config's ``kind`` in a registry: ``vllm`` (in this process) and ``http`` (an OpenAI-compatible
server) are built in, and :func:`register_engine` adds others. That registry is the one seam for
swapping the engine: tests register their stand-ins under a name and run jobs with
``EngineConfig(kind=name)`` (or ``ANEX_ENGINE=name`` in a process they start).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, Literal

from anex_pipeline import metrics
from anex_pipeline.console import PROGRESS_FIELD, PROGRESS_LOGGER, EngineLoad
from anex_pipeline.engine.base import Engine
from anex_pipeline.engine.config import EngineConfig, EngineSettings, HttpSettings
from anex_pipeline.engine.engine_args import canonical, vllm_version
from anex_pipeline.engine.modes import EngineMode, core_in_process, engine_kind, engine_mode
from anex_pipeline.engine.orphans import guard_descendants
from anex_pipeline.errors import EngineLoadFailed, JobStopped
from anex_pipeline.request_fields import AUDIO, POOLING
from anex_pipeline.workdir.manifest import JobManifest

__all__ = [
    "engine_for",
    "engine_key",
    "engine_kind",
    "job_engine",
    "load_engine",
    "machine_engine",
    "register_engine",
    "release_engines",
    "vllm_settings",
]

progress = logging.getLogger(PROGRESS_LOGGER)
RELEASE_WAIT_S = 5.0  # how long releasing waits for a load in progress before leaving it
_lock = threading.Lock()
_loaded: dict[EngineSettings | HttpSettings, Engine] = {}
FAILED_LOAD_KEPT_S = 60.0  # how long a failed load's reason answers for the same settings
_failed: dict[EngineSettings, tuple[float, str]] = {}  # settings -> when and why their latest load failed


EngineFactory = Callable[[EngineConfig, JobManifest], Engine]


def load_engine(settings: EngineSettings | HttpSettings) -> Engine:
    """The engine for these settings, loading it on first use; other loaded models are shut down
    first so two models never hold memory at once, each once the rows other threads run on it are
    done (a load never fails another job's rows). An HTTP engine is only a client of its server."""
    with _lock:
        if settings in _loaded and _loaded[settings].dead:
            progress.info("the engine for %s died; loading it again", _loaded[settings].model_name)
            _shutdown(_loaded.pop(settings))
        if settings in _loaded:
            return _loaded[settings]
        if isinstance(settings, HttpSettings):
            from anex_pipeline.engine.http.engine import OpenAIHttpEngine

            with metrics.engine_load() as ready:
                engine = _loaded[settings] = OpenAIHttpEngine(settings)
                ready(engine)
            progress.info("sending rows to the model server(s) at %s", engine.root)
            return engine
        failed = _failed.get(settings)
        if failed is not None and time.monotonic() - failed[0] < FAILED_LOAD_KEPT_S:  # e.g. a load ahead of time
            raise EngineLoadFailed(failed[1])
        for other in list(_loaded):
            _shutdown(_loaded.pop(other), waiting=True)
        from anex_pipeline.engine.vllm.engine import VllmLocalEngine
        from anex_pipeline.engine.vllm.stepping import one_line

        guard_descendants()  # vLLM's processes must not outlive this one, however it ends
        started = time.monotonic()
        progress.info("loading %s into vLLM", settings.model_name, extra=_load_state(settings, "loading"))
        try:
            with metrics.engine_load() as ready:
                engine = VllmLocalEngine(settings)
                ready(engine)
        except Exception as exc:
            progress.info("loading %s ended without an engine", settings.model_name, extra=_load_state(settings))
            if isinstance(exc, JobStopped):  # a stop signal cut the wait short: not a fault of the load
                raise
            reason = f"the engine could not load {settings.model_name}: {one_line(exc)[:600]}"
            _failed[settings] = (time.monotonic(), reason)
            raise EngineLoadFailed(reason) from exc
        _failed.pop(settings, None)
        progress.info("engine ready in %.1f s", time.monotonic() - started, extra=_load_state(settings, "ready"))
        _loaded[settings] = engine
        return engine


def _load_state(settings: EngineSettings, state: Literal["loading", "ready", "failed"] = "failed") -> dict[str, Any]:
    """The ``extra`` of a loading line, so the terminal's display knows the engine's state."""
    return {PROGRESS_FIELD: EngineLoad(settings.model_name, state)}


def release_engines(exiting: bool = False) -> None:
    """Shuts down every engine this process loaded. An engine still loading is left alone: the
    load cannot be cut short, and a process that is ending must not wait minutes for it. With
    ``exiting`` (the process ends next, skipping its teardown), an engine that ends with the
    process is only let go: vLLM's engine core in this process takes 1.5 s to shut down on the
    CPU build, for nothing that would outlive the process."""
    if not _lock.acquire(timeout=RELEASE_WAIT_S):
        progress.info("an engine is still loading; not waiting for it")
        return
    try:
        while _loaded:
            engine = _loaded.popitem()[1]
            if exiting and engine.ends_with_process:
                engine.let_go()
            else:
                _shutdown(engine)
        metrics.engines_released()
    finally:
        _lock.release()


def _shutdown(engine: Engine, waiting: bool = False) -> None:
    """Shuts ``engine`` down; ``waiting``: once the streams using it have ended."""
    try:
        if waiting:
            engine.wait_idle()
        engine.shutdown()
    except Exception as exc:  # a dead engine may fail to stop cleanly; it is dropped all the same
        progress.info("shutting down %s failed: %s", engine.model_name, exc)


def vllm_settings(config: EngineConfig, manifest: JobManifest) -> EngineSettings:
    """The in-process engine's settings for a job: the config's sizing and engine arguments, the
    job's model and the reasoning and tool parsers of its family (or the ones the job names)."""
    from anex_pipeline.engine.models import local_model_path
    from anex_pipeline.engine.parsing import ParserNames, choose_parsers

    model = str(local_model_path(manifest.model))
    pooling = manifest.endpoint in POOLING
    parsers = ParserNames() if pooling else choose_parsers(model, manifest.model_name, manifest.job_options())
    return EngineSettings(
        model=model,
        model_name=manifest.model_name,
        runner="pooling" if pooling else "generate",
        dtype=config.dtype,
        # Embedding models, cross-encoders and speech models have short fixed contexts (256 for
        # MiniLM, Whisper's decoder 448): use the model's own.
        max_model_len=None if pooling or manifest.endpoint in AUDIO else config.max_model_len,
        memory_share=config.memory_share,
        kv_cache_gib=config.kv_cache_gib,
        engine_args=canonical(config.engine_args),
        reasoning_parser=parsers.reasoning,
        tool_parser=parsers.tool,
        lora_modules=canonical(manifest.job_options().lora_modules or {}),
        core_in_process=core_in_process(config, manifest),
    )


def _vllm_engine(config: EngineConfig, manifest: JobManifest) -> Engine:
    return load_engine(vllm_settings(config, manifest))


def _http_settings(config: EngineConfig, manifest: JobManifest) -> HttpSettings:
    from anex_pipeline.engine.http.replicas import server_urls

    if not config.base_url:
        raise EngineLoadFailed("the http engine needs base_url: the address of an OpenAI-compatible server")
    try:
        servers = server_urls(config.base_url)
    except ValueError as exc:
        raise ValueError(f"the engine's base_url: {exc}") from None
    return HttpSettings(
        base_url=servers,
        model_name=manifest.model_name,
        model_named="model" in manifest.options,
        adapters=tuple(sorted(manifest.job_options().lora_modules or {})),
        api_key=config.api_key,
        max_concurrency=config.max_concurrency,
        timeout_s=config.timeout_s,
    )


def _http_engine(config: EngineConfig, manifest: JobManifest) -> Engine:
    return load_engine(_http_settings(config, manifest))


def engine_key(config: EngineConfig, manifest: JobManifest) -> Hashable:
    """What the engine a job runs on is, as far as sharing it goes: jobs of equal keys run on one
    loaded engine at once, and a job of another key needs another engine (for the in-process
    engine, another load in place of this one)."""
    kind = engine_kind(config)
    if kind == "vllm":
        return vllm_settings(config, manifest)
    if kind == "http":
        return _http_settings(config, manifest)
    return (kind, manifest.model_name, manifest.endpoint in POOLING)  # a registered engine kind


_factories: dict[str, EngineFactory] = {"vllm": _vllm_engine, "http": _http_engine}


def register_engine(kind: str, factory: EngineFactory) -> None:
    """Makes ``EngineConfig(kind=kind)`` run jobs on the engines ``factory(config, manifest)``
    returns (a factory that shares one engine per process should cache it)."""
    _factories[kind] = factory


def engine_for(config: EngineConfig, manifest: JobManifest) -> Engine:
    """The engine a job runs on under these settings."""
    kind = engine_kind(config)
    factory = _factories.get(kind)
    if factory is None:
        known = ", ".join(sorted(["auto", *_factories]))
        raise EngineLoadFailed(f"no engine named {kind!r}: use one of {known}")
    return factory(config, manifest)


def schedules_by_priority(config: EngineConfig) -> bool | None:
    """Whether the engine these settings pick orders rows by their ``priority`` (vLLM's
    ``scheduling_policy``); None for any other engine (a model server decides for itself)."""
    if engine_kind(config) != "vllm":
        return None
    return config.engine_args.get("scheduling_policy") == "priority"


def machine_engine(config: EngineConfig, manifest: JobManifest, idle_s: float, *, start: bool = True) -> Engine | None:
    """The engine a job runs on, with the vLLM engine replaced by this machine's shared model
    server (started if none serves the job's model and settings) reached over loopback. With
    ``start=False`` only a server that is up for them already is used: None when there is none
    (or the engine is not vLLM)."""
    if engine_kind(config) != "vllm":
        return engine_for(config, manifest) if start else None
    from anex_pipeline.engine.engine_args import engine_kwargs
    from anex_pipeline.engine.http.continuation import TraceContinuation
    from anex_pipeline.engine.server import machine_server
    from anex_pipeline.engine.server.machine_server import server_for

    settings = vllm_settings(config, manifest)
    server = server_for(settings, idle_s, start=start)
    if server is None:
        return None
    shared = config.model_copy(update={"kind": "http", "base_url": server.url, "api_key": server.token})
    engine = _http_engine(shared, manifest)
    engine.prefix_cache = machine_server.prefix_cache(server.url)  # its rows may then go in prefix order
    given = engine_kwargs(settings, machine_server.cpu_build())
    if settings.reasoning_parser:
        engine.continuation = TraceContinuation(settings, given)
    engine.server_account = {
        "kind": "machine_server",
        "model": settings.model_name,
        "server": server.url,
        "vllm_version": vllm_version(),
        "engine_args": {k: v for k, v in given.items() if k != "model"},
    }
    return engine


def job_engine(config: EngineConfig, manifest: JobManifest) -> Engine:
    """The engine a job runs on, in the mode these settings pick (:mod:`~anex_pipeline.engine.modes`):
    the machine's shared server when the mode sends the job there and one is up (or may be
    started), else the engine of the settings' kind in this process."""
    mode = engine_mode(config, manifest)
    if mode in (EngineMode.MACHINE_SERVER, EngineMode.WARM_SERVER):
        start = mode is EngineMode.MACHINE_SERVER or config.keep_warm
        shared = machine_engine(config, manifest, config.machine_server_idle_s, start=start)
        if shared is not None:
            return shared
    return engine_for(config, manifest)


def loads_here(config: EngineConfig, manifest: JobManifest) -> bool:
    """Whether the job's vLLM engine would be built in this process (not on a shared server)."""
    mode = engine_mode(config, manifest)
    if mode is EngineMode.WARM_SERVER:
        return (
            not config.keep_warm and machine_engine(config, manifest, config.machine_server_idle_s, start=False) is None
        )
    return mode in (EngineMode.IN_PROCESS, EngineMode.IN_PROCESS_CORE)
