"""What a Batch API request asks for, checked: a batch's job options (from ``metadata.anex_options``
and the ``anex_options`` body field, within the service's size limits, its models and its media
policy), its metadata, and an upload's expiry. Each refusal is an
:class:`~anex_pipeline.batches.objects.ApiError` naming the parameter."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from anex_pipeline.batches.objects import (
    MAX_EXPIRY_S,
    ApiError,
    CreateBatch,
    ExpiresAfter,
)
from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL, DEFAULT_EMBEDDING_MODEL, resolve_model
from anex_pipeline.formats.jsonl_input import option_problem
from anex_pipeline.options import OptionsError, job_options, options_from_json
from anex_pipeline.spec import (
    ENDPOINT_BY_URL,
    INVALID_VALUE,
    MISSING_PARAMETER,
    MODEL_NOT_FOUND,
    JobRejected,
    MediaOptions,
)
from anex_pipeline.validate.numbers import MAX_JOB_TOKENS
from anex_pipeline.validate.problems import pydantic_code

OPTIONS_METADATA_KEY = "anex_options"
DRY_RUN = "dry_run"  # among a batch's options: answer with the batch's quote, run nothing


MAX_METADATA_PAIRS = 16  # OpenAI's limits on a batch's metadata


MAX_METADATA_KEY = 64


MAX_METADATA_VALUE = 512


MAX_OPTIONS_BYTES = 1024 * 1024  # a batch's job options, as UTF-8 JSON
WINDOW_HOURS = (24, 168)  # the completion windows a batch may ask for: OpenAI's one, up to a week
MAX_SYSTEM_PROMPT_BYTES = 256 * 1024  # the job option system_prompt, in UTF-8


MEDIA_LIMITS = ("max_bytes", "timeout_s", "per_host_connections", "max_retries")  # a caller may only lower these


# Job options that shape the engine every batch shares, and the ``serve`` flag that sets each.
ENGINE_OPTIONS = {"reasoning_parser": "--reasoning-parser", "tool_parser": "--tool-parser"}


class ServedModels:
    """The models a service runs batches on, chosen by its operator (``serve --model``, repeatable),
    and how its engine runs them (``serve --reasoning-parser``, ``--tool-parser``, ``--lora-modules``).

    A batch may name one of them (in its options or the body field ``model``); one that names
    none runs the first. Without a list, the service serves the models a job gets when it names
    none: the bundled chat model, and the bundled embedding model for ``/v1/embeddings`` (with
    ``--base-url``, whatever the server serves). Names are compared as the pipeline resolves
    them (``SmolLM2-135M-Instruct`` is the bundled model's full id), never looked up on disk or
    on the hub: every other name gets the same refusal, whatever it is, so a model name cannot
    probe the server's files, nor make the shared engine load another model. Whatever else shapes
    the engine (its parsers, its adapters) is the operator's too: a batch that asks for other ones
    is refused, so no batch can make the engine load again under other settings."""

    def __init__(self, names: Sequence[str] = (), adapters: Sequence[str] = (), parsers: dict[str, str] | None = None):
        self.names = tuple(names)
        self.adapters = tuple(sorted(adapters))  # the operator's LoRA adapters (serve --lora-modules)
        self.parsers = {k: v for k, v in (parsers or {}).items() if v is not None}  # see ENGINE_OPTIONS
        self._served = {_reference(n) for n in self.listed()}
        if self.names:
            served = f"it serves {', '.join(self.names)}; a batch that names no model runs {self.names[0]}"
        else:
            served = (
                f"it serves only its default models, {DEFAULT_CHAT_MODEL} and, for /v1/embeddings, "
                f"{DEFAULT_EMBEDDING_MODEL}; a batch that names no model runs the one of its endpoint"
            )
        self._refusal = f"This service does not serve the model the batch names: {served}."

    def listed(self) -> tuple[str, ...]:
        """The names ``GET /v1/models`` lists: the operator's, else the default models, then the
        adapters."""
        return (self.names or (DEFAULT_CHAT_MODEL, DEFAULT_EMBEDDING_MODEL)) + self.adapters

    def check_engine_options(self, options: dict[str, Any]) -> None:
        """A 400 for a batch whose options ask the engine to be other than the operator set it up
        (see :meth:`check_adapters`, :data:`ENGINE_OPTIONS`); the operator's parsers are set in
        ``options``."""
        self.check_adapters(options)
        for name, flag in ENGINE_OPTIONS.items():
            ours, asked = self.parsers.get(name), options.get(name)
            if asked is not None and asked != ours:
                runs = f"runs {ours}" if ours is not None else "chooses it from the model"
                raise ApiError(
                    400,
                    f"{name} is set by this service's operator (serve {flag}) for every batch, since batches share "
                    f"one engine; this service {runs}: leave {OPTIONS_METADATA_KEY}.{name} out.",
                    param=f"{OPTIONS_METADATA_KEY}.{name}",
                )
            if ours is not None:
                options[name] = ours

    def check_adapters(self, options: dict[str, Any]) -> None:
        """A 400 for a batch that brings adapters of its own (``lora_modules``: a path of the
        service's machine is never the caller's to name) or makes one the service lacks its
        ``adapter``; rows name the operator's adapters in ``body.model``, checked with the rows."""
        if "lora_modules" in options:
            raise ApiError(
                400,
                "Batches cannot bring LoRA adapters (lora_modules): this service serves "
                + (f"the adapters {', '.join(self.adapters)}" if self.adapters else "none")
                + "; name one in each row's body.model or in the option adapter.",
                param=f"{OPTIONS_METADATA_KEY}.lora_modules",
            )
        asked = options.get("adapter")
        if asked is not None and asked not in self.adapters:
            served = f"it serves {', '.join(self.adapters)}" if self.adapters else "it serves no adapters"
            raise ApiError(
                400,
                f"This service does not serve the adapter the batch names: {served}.",
                param=f"{OPTIONS_METADATA_KEY}.adapter",
                code=MODEL_NOT_FOUND,
            )

    def model_for(self, asked: Any, param: str) -> Any:
        """The model a batch runs (None: the job's default), or a 400 naming ``param`` when the
        batch asks for one the service does not serve. A value that is not a string is returned
        as it is, for the option check to name."""
        if asked is None:
            return self.names[0] if self.names else None
        if isinstance(asked, str) and _reference(asked) not in self._served:
            raise ApiError(400, self._refusal, param=param, code=MODEL_NOT_FOUND)
        return asked


def completion_window_s(window: str, longest_s: int | None) -> int:
    """How long a batch may run, in seconds: its ``completion_window``, "24h" (OpenAI's only value)
    or a longer whole number of hours up to a week (a queue of one's own GPUs may be worth waiting
    for), cut to the operator's ``longest_s`` (``serve --max-completion-window``); a 400 naming
    the field for any other value."""
    hours = re.fullmatch(r"([0-9]+)h", window)
    if hours is None or not WINDOW_HOURS[0] <= int(hours[1]) <= WINDOW_HOURS[1]:
        low, high = WINDOW_HOURS
        raise ApiError(
            400,
            f"completion_window must be '{low}h' (OpenAI's window) or a whole number of hours up to "
            f"'{high}h', got {window!r}.",
            param="completion_window",
        )
    seconds = int(hours[1]) * 3600
    return seconds if longest_s is None else min(seconds, longest_s)


def _reference(name: str) -> str:
    """What a model name stands for (a bundled model's aliases are one model); no file is read."""
    return resolve_model(name, "chat")[0]


def batch_options(
    body: CreateBatch, media: MediaOptions, models: ServedModels, max_job_tokens: int = MAX_JOB_TOKENS
) -> tuple[dict[str, Any], bool]:
    """The job options of a batch: ``metadata["anex_options"]`` (a JSON object as a string), then
    the ``anex_options`` body field over it, the batch's endpoint, its model (one the service
    serves), the service's media policy narrowed by the caller's ``media``, and the service's
    budget of output tokens (``max_job_tokens``), which a batch may only lower; checked here.
    With them, whether the batch is a dry run (``dry_run: true`` among those options): quoted, not run."""
    if body.endpoint not in ENDPOINT_BY_URL:
        supported = ", ".join(ENDPOINT_BY_URL)
        raise ApiError(
            400,
            f"endpoint {body.endpoint!r} is not supported here; use one of {supported}.",
            param="endpoint",
        )
    if (body.input_file_id is None) == (body.requests is None):
        raise ApiError(
            400,
            "Give either input_file_id or the embedded requests, not both and not neither.",
            param="input_file_id",
            code=MISSING_PARAMETER if body.input_file_id is None else INVALID_VALUE,
        )
    metadata = body.metadata or {}
    check_metadata(metadata)
    options: dict[str, Any] = {}
    if OPTIONS_METADATA_KEY in metadata:
        try:
            options = options_from_json(metadata[OPTIONS_METADATA_KEY], f"metadata.{OPTIONS_METADATA_KEY}")
        except OptionsError as exc:
            raise ApiError(400, f"{exc}.", param=f"metadata.{OPTIONS_METADATA_KEY}", code=exc.code) from None
    options.update(body.anex_options or {})
    dry_run = options.pop(DRY_RUN, False)
    if type(dry_run) is not bool:
        raise ApiError(400, f"{DRY_RUN} must be true or false.", param=f"{OPTIONS_METADATA_KEY}.{DRY_RUN}")
    check_option_sizes(options)
    models.check_engine_options(options)
    options["media"] = narrowed_media(options.get("media"), media)
    budget = options.get("max_job_tokens")
    if type(budget) is int and budget > max_job_tokens:
        raise ApiError(
            400,
            f"max_job_tokens is {budget:,}, above this service's budget of {max_job_tokens:,} output tokens "
            "per batch; lower it or leave it out.",
            param=f"{OPTIONS_METADATA_KEY}.max_job_tokens",
        )
    if budget is None and max_job_tokens != MAX_JOB_TOKENS:
        options["max_job_tokens"] = max_job_tokens
    asked, where = options.pop("model", None), f"{OPTIONS_METADATA_KEY}.model"
    if asked is None:
        asked, where = body.model, "model"
    model = models.model_for(asked, where)
    if model is not None:
        options["model"] = model
    endpoint = ENDPOINT_BY_URL[body.endpoint]
    if options.setdefault("endpoint", endpoint) != endpoint:
        raise ApiError(
            400,
            f"the job option endpoint {options['endpoint']!r} contradicts the batch's endpoint {body.endpoint}.",
            param="anex_options.endpoint",
        )
    try:
        checked = job_options(options)
        if (problem := option_problem(checked)) is not None:  # a batch's input is JSONL
            raise JobRejected([problem])
        return checked.model_dump(exclude_defaults=True), dry_run
    except JobRejected as exc:
        raise ApiError(
            400,
            "The job options are not valid: " + "; ".join(str(p) for p in exc.problems),
            param=OPTIONS_METADATA_KEY,
            code=exc.problems[0].code,
        ) from None


def check_option_sizes(options: dict[str, Any]) -> None:
    """Refuses job options over the service's limits: :data:`MAX_OPTIONS_BYTES` for all of them
    as JSON, :data:`MAX_SYSTEM_PROMPT_BYTES` for ``system_prompt``. Anything a request carries is
    copied into the batch's record and its job, and the check of its input runs on them."""
    prompt = options.get("system_prompt")
    if isinstance(prompt, str) and (size := _utf8_bytes(prompt)) > MAX_SYSTEM_PROMPT_BYTES:
        raise ApiError(
            400,
            f"{OPTIONS_METADATA_KEY}.system_prompt is {size:,} bytes long; this service takes system prompts "
            f"of up to {MAX_SYSTEM_PROMPT_BYTES:,} bytes (put longer shared text in the rows).",
            param=f"{OPTIONS_METADATA_KEY}.system_prompt",
            code="string_above_max_length",
        )
    if (size := _utf8_bytes(json.dumps(options, ensure_ascii=False))) > MAX_OPTIONS_BYTES:
        raise ApiError(
            400,
            f"the job options are {size:,} bytes of JSON; this service takes up to {MAX_OPTIONS_BYTES:,} bytes.",
            param=OPTIONS_METADATA_KEY,
        )


def _utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))  # JSON may carry a lone surrogate (\ud800)


def check_metadata(metadata: dict[str, str]) -> None:
    """Refuses metadata beyond OpenAI's limits (16 pairs, keys of 64 characters, values of 512),
    with OpenAI's codes and wording."""
    if len(metadata) > MAX_METADATA_PAIRS:
        raise ApiError(
            400,
            f"Invalid 'metadata': too many properties. Expected an object with at most {MAX_METADATA_PAIRS} "
            f"properties, but got an object with {len(metadata)} properties instead.",
            param="metadata",
            code="object_above_max_properties",
        )
    for key, value in metadata.items():
        for what, text, limit in (("key", key, MAX_METADATA_KEY), ("value", value, MAX_METADATA_VALUE)):
            if len(text) > limit:
                hint = (
                    f" (job options that long go in the body field {OPTIONS_METADATA_KEY})" if what == "value" else ""
                )
                raise ApiError(
                    400,
                    f"Invalid 'metadata.{key[:MAX_METADATA_KEY]}': {what} too long. Expected a string with maximum "
                    f"length {limit}, but got a string with length {len(text)} instead{hint}.",
                    param=f"metadata.{key[:MAX_METADATA_KEY]}" if what == "value" else "metadata",
                    code="string_above_max_length",
                )


def upload_expiry(anchor: Any, seconds: Any) -> int | None:
    """Seconds until an uploaded file expires, from the form fields ``expires_after[anchor]`` and
    ``expires_after[seconds]`` (how the SDK sends ``expires_after``); None when neither is sent."""
    if anchor is None and seconds is None:
        return None
    try:
        return ExpiresAfter.model_validate({"anchor": anchor, "seconds": seconds}).seconds
    except ValidationError as exc:
        first = exc.errors()[0]
        param = f"expires_after.{first['loc'][0]}"
        raise ApiError(
            400,
            f"'{param}': {first['msg']} (expires_after takes anchor 'created_at' and 1 to {MAX_EXPIRY_S} seconds).",
            param=param,
            code=pydantic_code(first["type"]),
        ) from None


def narrowed_media(asked: Any, policy: MediaOptions) -> Any:
    """The media options a batch runs with: the operator's policy, where the caller may only
    name fewer of its hosts and lower its limits (hosts reachable from the service are the
    operator's decision). Options that are not valid media options are returned as they are,
    for the option check to name."""
    if asked is None:
        return policy.model_dump()
    try:
        wanted = MediaOptions.model_validate(asked)
    except ValidationError:
        return asked
    param = f"{OPTIONS_METADATA_KEY}.media"
    if extra := [h for h in wanted.allowed_hosts if h not in policy.allowed_hosts]:
        raise ApiError(
            400,
            f"{param}.allowed_hosts: {extra[0]!r} is not a media host this service allows; the hosts are set by "
            f"its operator ({', '.join(policy.allowed_hosts) or 'none beyond public addresses'}) and a batch "
            "may only name some of them",
            param=f"{param}.allowed_hosts",
        )
    for name in MEDIA_LIMITS:
        if name in wanted.model_fields_set and getattr(wanted, name) > getattr(policy, name):
            raise ApiError(
                400,
                f"{param}.{name}: {getattr(wanted, name)} is above this service's limit of "
                f"{getattr(policy, name)}; a batch may only lower it",
                param=f"{param}.{name}",
            )
    return policy.model_copy(update={name: getattr(wanted, name) for name in wanted.model_fields_set}).model_dump()
