"""How jobs reach a model, as plain settings: which engine, and how it is sized or reached.

The Dagster resource (:class:`~anex_pipeline.orchestration.resources.EngineResource`) carries
these same fields; the command line, the Batch API and the tests build an :class:`EngineConfig`
and get engines from it through :func:`anex_pipeline.engine.engine_for`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field, field_validator

from anex_pipeline import settings
from anex_pipeline.engine.engine_args import EngineArgError, check_engine_args
from anex_pipeline.net.retry import RetryPolicy


def _machine_server_on() -> bool:
    """On unless ANEX_MACHINE_SERVER is 0; unset, off with the k8s and ray executors."""
    if settings.MACHINE_SERVER.is_set():
        return settings.MACHINE_SERVER.get() != "0"
    return settings.EXECUTOR.get() not in ("k8s", "ray")


DEFAULT_IDLE_S = 600.0  # seconds the machine's shared model server stays up unused


class EngineConfig(BaseModel):
    """The in-process vLLM engine (the model comes from each job, loaded once per process), or,
    with ``base_url`` set, an OpenAI-compatible server such as ``vllm serve``."""

    kind: str = Field(
        default_factory=lambda: os.environ.get("ANEX_ENGINE", "auto"),
        description="Which engine: 'auto' (vLLM here, or the server at base_url), 'vllm', 'http', "
        "or a name given to anex_pipeline.engine.register_engine.",
    )
    dtype: str = Field(default="auto", description="Weights dtype; on a CPU 'auto' means float32.")
    max_model_len: int | None = Field(
        default=None,
        description="Context length the engine reserves for; unset = the model's own, capped by what the KV "
        "cache holds (vLLM's auto-fit).",
    )
    memory_share: float | None = Field(
        default=None, description="gpu_memory_utilization (on a CPU: share of RAM); unset = 0.9 GPU, 0.3 CPU."
    )
    kv_cache_gib: int = Field(default=1, description="CPU build only: KV cache size in GiB.")
    engine_args: dict[str, Any] = Field(
        default_factory=lambda: _env_engine_args(),
        validate_default=True,  # those from the environment are checked too
        description='vLLM engine arguments by their EngineArgs names, e.g. {"tensor_parallel_size": 2, '
        '"quantization": "fp8"}: the in-process engine and the machine\'s model server get the same ones '
        "(default: $ANEX_ENGINE_ARGS, a JSON object).",
    )
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description='LoRA adapters of every generation job this engine runs, by name: {"name": "local folder or '
        "HF id\"}; they join each job's own lora_modules at submit, and rows choose one by body.model.",
    )
    core_in_process_rows: int = Field(
        default=0,
        ge=0,
        description="In-process vLLM only: a job of at most this many rows runs vLLM's engine core in this "
        "process instead of two processes of its own (one import of vLLM instead of three: on a CPU the engine "
        "starts about 12 s sooner, and generates as fast). 0 = never. The command line sets it for small jobs.",
    )
    base_url: str | None = Field(
        default_factory=lambda: settings.ENGINE_BASE_URL.get() or None,
        description="OpenAI-compatible server(s) to send rows to, e.g. http://gpu-1:8000, or a comma-separated "
        "list of replicas of one model; unset = vLLM in this process.",
    )
    api_key: str | None = Field(
        default=None, description="Bearer token for base_url (give it as an EnvVar to keep it out of run config)."
    )
    max_concurrency: int = Field(default=32, ge=1, description="HTTP mode: requests in flight at once per server.")
    machine_server: bool = Field(
        default_factory=_machine_server_on,
        description="vLLM engine: share one model server per machine between the step processes, "
        "instead of loading the model in each (ANEX_MACHINE_SERVER=0 turns it off; off by default "
        "with ANEX_EXECUTOR=k8s or ray, where each step has a pod or a Ray job of its own).",
    )
    machine_server_idle_s: float = Field(
        default=DEFAULT_IDLE_S, gt=0, description="The shared model server ends after this many seconds unused."
    )
    warm_server: bool = Field(
        default=False,
        description="With machine_server off: use the machine's shared model server when one is up for the "
        "job's model and engine settings, else load the model in this process.",
    )
    keep_warm: bool = Field(
        default=False,
        description="With warm_server: start the shared model server when none is up, so that it stays warm "
        "for machine_server_idle_s after the run.",
    )
    timeout_s: float = Field(default=600.0, gt=0, description="HTTP mode: seconds one request may take.")

    @field_validator("engine_args")
    @classmethod
    def _known_to_vllm(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_engine_args(value)

    def plain(self) -> EngineConfig:
        """These settings as a plain EngineConfig (from a subclass such as the Dagster resource)."""
        return EngineConfig(**{name: getattr(self, name) for name in EngineConfig.model_fields})


def _env_engine_args() -> dict[str, Any]:
    """``$ANEX_ENGINE_ARGS``: a JSON object of engine arguments (how a deployment's pods get them)."""
    text = os.environ.get("ANEX_ENGINE_ARGS", "").strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        example = '{"tensor_parallel_size": 2}'
        raise EngineArgError(f"ANEX_ENGINE_ARGS must be a JSON object, e.g. {example}; got {text!r}")
    return value


@dataclass(frozen=True)
class EngineSettings:
    """How to load a model; two equal settings share one loaded engine."""

    model: str  # local folder or HF id
    model_name: str  # the name written into responses
    runner: str = "generate"  # "generate" or "pooling" (embeddings, score, rerank)
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own, capped by what the KV cache holds
    memory_share: float | None = None  # gpu_memory_utilization; on a CPU the share of RAM
    kv_cache_gib: int = 1  # CPU only: VLLM_CPU_KVCACHE_SPACE
    engine_args: str = "{}"  # vLLM's other engine arguments, as engine_args.canonical JSON
    reasoning_parser: str | None = None  # vLLM's name; it also turns on the thinking budget
    tool_parser: str | None = None
    lora_modules: str = "{}"  # the LoRA adapters loaded with the model, by name, as canonical JSON
    # vLLM's engine core in this process (see build_llm). How the engine runs, not what it answers:
    # left out of the comparison, so an engine or a shared server of either kind serves both.
    core_in_process: bool = field(default=False, compare=False)


@dataclass(frozen=True)
class HttpSettings:
    """Where and how to reach the servers; two equal settings share one client."""

    # e.g. http://gpu-1:8000 (a trailing /v1 is accepted); several: a comma-separated list or a tuple
    base_url: str | tuple[str, ...]
    model_name: str  # the job's model
    model_named: bool = False  # the job named its model, so the server must serve exactly that one
    adapters: tuple[str, ...] = ()  # the job's LoRA adapters, which the server must serve too
    api_key: str | None = None
    max_concurrency: int = 32  # per server
    timeout_s: float = 600.0  # per request, generation included
    retries: int = 4  # further attempts after the first
    backoff_s: float = 1.0  # first wait; doubles on every retry
    max_wait_s: float = 60.0  # cap on one wait, Retry-After included

    @property
    def policy(self) -> RetryPolicy:
        return RetryPolicy(retries=self.retries, backoff_s=self.backoff_s, max_wait_s=self.max_wait_s)
