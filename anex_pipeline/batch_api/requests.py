"""What a Batch API request asks for, checked: a batch's job options (from ``metadata.anex_options``
and the ``anex_options`` body field, narrowed to the service's media policy), its metadata, and an
upload's expiry. Each refusal is an :class:`~anex_pipeline.batch_api.objects.ApiError` naming the
parameter."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from anex_pipeline.batch_api.objects import (
    MAX_EXPIRY_S,
    ApiError,
    CreateBatch,
    ExpiresAfter,
)
from anex_pipeline.options import OptionsError, job_options, options_from_json
from anex_pipeline.spec import (
    ENDPOINT_BY_URL,
    INVALID_VALUE,
    MISSING_PARAMETER,
    JobRejected,
    MediaOptions,
)
from anex_pipeline.validate import pydantic_code

OPTIONS_METADATA_KEY = "anex_options"


MAX_METADATA_PAIRS = 16  # OpenAI's limits on a batch's metadata


MAX_METADATA_KEY = 64


MAX_METADATA_VALUE = 512


MEDIA_LIMITS = ("max_bytes", "timeout_s", "per_host_connections", "max_retries")  # a caller may only lower these


def batch_options(body: CreateBatch, media: MediaOptions) -> dict[str, Any]:
    """The job options of a batch: ``metadata["anex_options"]`` (a JSON object as a string), then
    the ``anex_options`` body field over it, the batch's endpoint and ``model``, and the service's
    media policy narrowed by the caller's ``media``; checked here."""
    if body.endpoint not in ENDPOINT_BY_URL:
        supported = ", ".join(ENDPOINT_BY_URL)
        raise ApiError(
            400,
            f"endpoint {body.endpoint!r} is not supported here; use one of {supported}.",
            param="endpoint",
        )
    if body.completion_window != "24h":
        raise ApiError(
            400,
            f"completion_window must be '24h', got {body.completion_window!r}.",
            param="completion_window",
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
    options["media"] = narrowed_media(options.get("media"), media)
    if body.model is not None:
        options.setdefault("model", body.model)
    endpoint = ENDPOINT_BY_URL[body.endpoint]
    if options.setdefault("endpoint", endpoint) != endpoint:
        raise ApiError(
            400,
            f"the job option endpoint {options['endpoint']!r} contradicts the batch's endpoint {body.endpoint}.",
            param="anex_options.endpoint",
        )
    try:
        return job_options(options).model_dump(exclude_defaults=True)
    except JobRejected as exc:
        raise ApiError(
            400,
            "The job options are not valid: " + "; ".join(str(p) for p in exc.problems),
            param=OPTIONS_METADATA_KEY,
            code=exc.problems[0].code,
        ) from None


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
