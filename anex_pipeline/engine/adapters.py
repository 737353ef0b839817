"""LoRA adapters: the ones a job names (the ``lora_modules`` option, ``--lora-modules name=path``),
checked at submit, loaded with the base model into one engine, and chosen row by row.

A row runs on an adapter when its ``body.model`` is one of the job's adapter names, or, with no
``model`` of its own, when the job sets ``adapter`` (Parquet rows have no body, so that is how a
Parquet job uses one). Every other row runs on the base model. The engine is built once for the
base model and every adapter of the job: ``enable_lora``, with ``max_lora_rank`` the smallest rank
vLLM offers that holds the largest adapter, and the adapters loaded as the engine starts, so that
a broken adapter fails the load with its name instead of a row in the middle of a shard.

An adapter is a PEFT folder (``adapter_config.json`` and ``adapter_model.safetensors``), given as
a local path or a Hugging Face id; only its configuration is read here, never its weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from anex_pipeline.errors import RejectedError
from anex_pipeline.request_fields import POOLING
from anex_pipeline.spec import MODEL_NOT_FOUND, JobOptions, Problem

CONFIG_FILE = "adapter_config.json"
# The ranks vLLM's engine can reserve for (its LoRAConfig.max_lora_rank), smallest first.
ENGINE_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Adapters vLLM holds in a batch at once; the others wait in its CPU cache (all of the job's fit).
MAX_LORAS_AT_ONCE = 8


class AdapterError(RejectedError):
    """An adapter that cannot be used: a malformed ``--lora-modules`` item, or an adapter whose
    configuration is missing, unreadable or beyond what vLLM loads."""


def parse_lora_module(item: str) -> tuple[str, str]:
    """One ``--lora-modules`` item, as vLLM spells it: ``name=path`` or the JSON object
    ``{"name": ..., "path": ...}``."""
    text = item.strip()
    if text.startswith("{"):
        try:
            given = json.loads(text)
        except json.JSONDecodeError as exc:
            raise AdapterError(f"--lora-modules {item!r} is not valid JSON: {exc.msg}") from None
        name, path = (given.get("name"), given.get("path")) if isinstance(given, dict) else (None, None)
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
        raise AdapterError(f"--lora-modules takes NAME=PATH (a local folder or a Hugging Face id); got {item!r}")
    return name.strip(), path.strip()


def lora_modules_of(items: Iterable[str]) -> dict[str, str]:
    """The adapters of repeated ``--lora-modules`` items, by name; a name given twice is refused."""
    found: dict[str, str] = {}
    for item in items:
        name, path = parse_lora_module(item)
        if name in found and found[name] != path:
            raise AdapterError(f"--lora-modules names adapter {name!r} twice ({found[name]} and {path})")
        found[name] = path
    return found


def row_adapter(body: dict[str, Any], lora_modules: dict[str, str] | None, default: str | None) -> str | None:
    """The adapter a row runs on: its ``body.model`` when that names one of the job's adapters,
    the job's ``adapter`` when the row names no model, else None (the base model)."""
    model = body.get("model")
    if model is None:
        return default
    return model if lora_modules and model in lora_modules else None


def config_path(source: str) -> Path:
    """The adapter's ``adapter_config.json`` on this machine: in its folder, or, for a Hugging Face
    id, in the local hub cache or fetched from the hub (the file alone) unless the hub is offline.
    Raises AdapterError saying why it cannot be had."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        path = folder / CONFIG_FILE
        if not path.is_file():
            raise AdapterError(f"{folder} has no {CONFIG_FILE}; name the folder PEFT saved the adapter in")
        return path
    if folder.exists():
        raise AdapterError(f"{source} is a file; name the adapter's folder (the one holding {CONFIG_FILE})")
    if source.startswith(("/", ".", "~")) or source.count("/") != 1:
        raise AdapterError(f"{source} is neither a local folder nor a Hugging Face id like org/name")
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    from anex_pipeline.engine.models import hub_offline

    cached = try_to_load_from_cache(source, CONFIG_FILE)
    if isinstance(cached, str):
        return Path(cached)
    if hub_offline():
        raise AdapterError(
            f"{source} is not a local folder nor in the Hugging Face cache, and the hub is offline "
            f"(HF_HUB_OFFLINE is set); download it first (hf download {source})"
        )
    try:
        return Path(hf_hub_download(source, CONFIG_FILE))
    except Exception as exc:  # not found, no network, a private repository
        raise AdapterError(f"{source}: its {CONFIG_FILE} could not be fetched from the hub ({exc})") from None


def adapter_rank(source: str) -> int:
    """The adapter's largest rank (``r``, or a larger one in its ``rank_pattern``), read from its
    configuration; raises AdapterError when the configuration cannot be read or vLLM would refuse it."""
    path = config_path(source)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path} is a {config['peft_type']} adapter; only LoRA adapters can be loaded")
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in config]
    if missing:
        raise AdapterError(f"{path} lacks {', '.join(missing)}; it is not a LoRA adapter's configuration")
    pattern = config.get("rank_pattern") or {}
    ranks = [config["r"], *(pattern.values() if isinstance(pattern, dict) else [])]
    if not all(type(r) is int and r > 0 for r in ranks):
        raise AdapterError(f"{path}: its ranks must be positive integers, got {ranks}")
    if config.get("use_dora"):
        raise AdapterError(f"{path} is a DoRA adapter, which vLLM does not load")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path} trains biases (bias: {config['bias']!r}), which vLLM does not load")
    rank = max(ranks)
    if rank > ENGINE_RANKS[-1]:
        raise AdapterError(f"{path} has rank {rank}; vLLM loads adapters of rank {ENGINE_RANKS[-1]} at most")
    return rank


def adapter_problems(options: JobOptions, endpoint: str, local: bool) -> list[Problem]:
    """The job's adapters as submit problems: adapters on an embeddings job, a job ``adapter`` that
    is not one of them, and (``local``: the engine runs here, so it reads the same files) each
    adapter whose configuration is unreadable or whose rank vLLM cannot take."""
    modules = options.lora_modules or {}
    problems = []
    if modules and endpoint in POOLING:
        problems.append(
            Problem(f"adapters serve generation; remove lora_modules from a {endpoint} job", field="lora_modules")
        )
    if options.adapter is not None and options.adapter not in modules:
        known = f"the job's adapters are {', '.join(sorted(modules))}" if modules else "the job has no lora_modules"
        problems.append(
            Problem(f"names adapter {options.adapter!r}, but {known}", field="adapter", code=MODEL_NOT_FOUND)
        )
    if local:
        for name, source in sorted(modules.items()):
            try:
                adapter_rank(source)
            except AdapterError as exc:
                problems.append(Problem(f"adapter {name!r}: {exc}", field="lora_modules", code=MODEL_NOT_FOUND))
    return problems


def lora_kwargs(lora_modules: dict[str, str], on_cpu: bool) -> dict[str, Any]:
    """The engine arguments that let one engine serve the base model and these adapters (none
    without adapters): vLLM's smallest rank that holds the largest adapter, and room for all of
    them in its CPU cache.

    On the CPU build the engine gets one adapter slot more than there are adapters, left empty:
    vLLM's CPU LoRA operations look up a base-model row's slot (-1) as Python indexing does, so
    they apply the adapter in the last slot to base rows batched with adapter rows. Slots fill
    from the first, so with a spare one the last holds only zeros and base rows stay the base
    model's; every adapter then has a slot of its own, as none can be evicted into the last."""
    if not lora_modules:
        return {}
    rank = max(adapter_rank(source) for source in lora_modules.values())
    count = len(lora_modules)
    return {
        "enable_lora": True,
        "max_loras": count + 1 if on_cpu else min(count, MAX_LORAS_AT_ONCE),
        "max_cpu_loras": count + 1 if on_cpu else count,
        "max_lora_rank": next(r for r in ENGINE_RANKS if r >= rank),
    }


def serve_flags(lora_modules: dict[str, str]) -> list[str]:
    """The ``vllm serve`` flag that names the adapters, so rows reach them by name."""
    if not lora_modules:
        return []
    return ["--lora-modules", *(f"{name}={_engine_path(path)}" for name, path in sorted(lora_modules.items()))]


def _engine_path(source: str) -> str:
    """What vLLM loads for an adapter: a local folder as an absolute path (the engine's processes
    may run elsewhere in the tree), a Hugging Face id as it is."""
    folder = Path(source).expanduser()
    return str(folder.resolve()) if folder.is_dir() else source


class AdapterRequests:
    """vLLM's ``LoRARequest`` for each adapter of an engine, numbered by name from 1 (vLLM's ids
    must be positive), made once and loaded ahead of the rows that use them."""

    def __init__(self, lora_modules: dict[str, str]):
        from vllm.lora.request import LoRARequest

        ordered = enumerate(sorted(lora_modules.items()), 1)
        self.requests = {name: LoRARequest(name, n, _engine_path(path)) for n, (name, path) in ordered}

    def load(self, engine: Any) -> None:
        """Loads every adapter into the engine (``LLMEngine.add_lora``), so that one that does not
        fit the model fails here, naming it."""
        for name, request in self.requests.items():
            try:
                engine.add_lora(request)
            except Exception as exc:
                raise AdapterError(f"adapter {name!r} ({request.lora_path}) does not load: {exc}") from exc

    def get(self, name: str | None) -> Any:
        """The request for a row's adapter, None for the base model."""
        return None if name is None else self.requests[name]
