"""The one place ``bench.overhead`` reads package internals (everything else it does goes through
the ``anex-pipeline`` command): the keyword arguments the pipeline builds ``vllm.LLM`` with, the
environment it gives vLLM's CPU engine processes, and how it reads ``--engine-arg``
(``parse_engine_arg``), so that vLLM's ``run_batch`` and a plain ``LLM.chat`` script get the same
engine as the command. ``bench.vs_run_batch.run_peer``, reused for ``run_batch``, reads the
package's engine arguments the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from anex_pipeline.engine.config import EngineSettings
from anex_pipeline.engine.engine_args import canonical, engine_kwargs, parse_engine_arg
from anex_pipeline.engine.server.machine_server import cpu_build
from anex_pipeline.engine.vllm.cpu_environment import KV_CACHE_ENV, engine_environment

__all__ = ["build_near_free_model", "llm_kwargs", "parse_engine_arg", "peer_environment"]

MAX_MODEL_LEN = 2048  # bench.vs_run_batch's, on every side
KV_CACHE_GIB = 1


def llm_kwargs(model: str, engine_args: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM``'s keyword arguments for ``model``, as the pipeline's in-process engine builds it
    with ``--max-model-len 2048`` and ``engine_args`` given as ``--engine-arg``."""
    settings = EngineSettings(
        model=model, model_name=model, max_model_len=MAX_MODEL_LEN, engine_args=canonical(engine_args)
    )
    return engine_kwargs(settings, cpu_build())


def peer_environment() -> dict[str, str]:
    """The variables the pipeline sets for its CPU engine's processes (cores, KV cache, preloaded
    allocator), given here to a whole process that builds vLLM's engine."""
    if not cpu_build():
        return {}
    base = {**os.environ, KV_CACHE_ENV: os.environ.get(KV_CACHE_ENV, str(KV_CACHE_GIB))}
    return {KV_CACHE_ENV: base[KV_CACHE_ENV], **engine_environment(KV_CACHE_GIB, base)}


def build_near_free_model(folder: Path) -> Path:
    """The near-free chat model (``tiny_models.build_near_free_chat_model``), built in a process of
    its own so that this one never imports torch."""
    code = (
        "import sys, pathlib; from anex_pipeline_tests.harness.tiny_models import build_near_free_chat_model; "
        "build_near_free_chat_model(pathlib.Path(sys.argv[1]))"
    )
    repo = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True, cwd=repo, capture_output=True)
    return folder
