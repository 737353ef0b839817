"""Which engine runs a job, decided in one place from the engine settings.

A job runs in one of five modes:

- ``IN_PROCESS``: vLLM loaded in this process, its engine core in processes of its own (the
  command and the Batch API on a job of any size);
- ``IN_PROCESS_CORE``: the same with vLLM's engine core in this process too (a small job run from a
  terminal, ``core_in_process_rows``), which starts about 12 s sooner on a CPU;
- ``MACHINE_SERVER``: this machine's shared model server, started when none serves the job's model
  and settings (the steps Dagster runs in processes of their own, ``machine_server``);
- ``WARM_SERVER``: the shared server when one is up for the job, else vLLM in this process
  (``warm_server``; with ``keep_warm`` one is started and left warm);
- ``EXTERNAL``: an OpenAI-compatible server at ``base_url``, or an engine registered by name
  (``kind``).

:func:`engine_mode` reads every knob that takes part (``kind``, ``base_url``, ``machine_server``,
which ``ANEX_MACHINE_SERVER`` and ``ANEX_EXECUTOR`` set by default, ``warm_server``,
``core_in_process_rows``); :func:`anex_pipeline.engine.loader.job_engine` gets the engine of the mode.
"""

from __future__ import annotations

import enum

from anex_pipeline.engine.config import EngineConfig
from anex_pipeline.workdir.manifest import JobManifest

# Engine arguments that spread a model over several devices: such a model always gets vLLM's processes.
PARALLEL_ARGS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


class EngineMode(enum.Enum):
    IN_PROCESS = "in-process"
    IN_PROCESS_CORE = "in-process, engine core in this process"
    MACHINE_SERVER = "machine's shared server"
    WARM_SERVER = "machine's shared server when warm, else in-process"
    EXTERNAL = "external server or registered engine"


def engine_kind(config: EngineConfig) -> str:
    """The registry name of the engine these settings pick (``auto``: http with a base_url, else vllm)."""
    return config.kind if config.kind != "auto" else ("http" if config.base_url else "vllm")


def engine_mode(config: EngineConfig, manifest: JobManifest) -> EngineMode:
    """How the job reaches its model under these settings."""
    if engine_kind(config) != "vllm":
        return EngineMode.EXTERNAL
    if config.machine_server:
        return EngineMode.MACHINE_SERVER
    if config.warm_server:
        return EngineMode.WARM_SERVER
    return EngineMode.IN_PROCESS_CORE if core_in_process(config, manifest) else EngineMode.IN_PROCESS


def core_in_process(config: EngineConfig, manifest: JobManifest) -> bool:
    """Whether the job is small enough for vLLM's engine core in this process; a model spread over
    several devices always gets its processes (one per device)."""
    if config.core_in_process_rows == 0:  # never (a service's warm-up loads for a job of no rows yet)
        return False
    parallel = any(int(config.engine_args.get(name) or 1) > 1 for name in PARALLEL_ARGS)
    return not parallel and manifest.total_rows <= config.core_in_process_rows
