"""Submit-time checks that do not depend on the input's file format.

:func:`check_body` checks one row's request body, with the checks of this package's modules:
:mod:`.inputs` (what the row gives the model), :mod:`.answers` (what shapes its answer),
:mod:`.numbers` (the ranges of number fields) and :mod:`.problems` (what a check returns). Each
check returns a list of :class:`~.problems.FieldProblem`; the format readers add the line number
and turn them into :class:`~anex_pipeline.spec.Problem` objects.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from anex_pipeline.request_fields import AUDIO, NUMBER, fields_of, unknown_field
from anex_pipeline.responses import EFFORTS
from anex_pipeline.spec import INVALID_TYPE, UNKNOWN_PARAMETER, Endpoint
from anex_pipeline.validate.answers import (
    check_choices,
    check_labelled_row,
    check_logprobs,
    check_response_format,
    check_structured_outputs,
    check_tool_choice,
)
from anex_pipeline.validate.inputs import (
    MAX_PROMPTS,
    check_audio_request,
    check_continuation,
    check_embedding_request,
    check_messages,
    check_prompt_shape,
    check_rerank_request,
    check_responses_request,
    check_score_request,
)
from anex_pipeline.validate.numbers import INT32_MAX, check_numbers
from anex_pipeline.validate.problems import KIND_WORDS, FieldProblem, kind_of, wrong_kind


class ModelNames(frozenset[str]):
    """The names a row may give as ``body.model``: each spelling of the job's model (``base`` is
    the one responses carry) and the job's LoRA adapters."""

    base: str
    adapters: tuple[str, ...]

    def __new__(cls, base: str, spellings: Iterable[str] = (), adapters: Iterable[str] = ()) -> ModelNames:
        adapters = tuple(sorted(adapters))
        names = super().__new__(cls, {base, *spellings, *adapters})
        names.base, names.adapters = base, adapters
        return names


@dataclass(frozen=True)
class EngineTraits:
    """What the job's engine can do, for the fields that need it, as far as the submit check
    knows; None where it does not (a job sent to a model server runs what that server does).

    ``shortening``: for an embeddings job, whether its model can shorten vectors and to which
    lengths (see :func:`anex_pipeline.engine.models.matryoshka_dimensions`). ``priority``: whether
    the engine schedules rows by their ``priority`` (vLLM's ``scheduling_policy=priority``)."""

    shortening: tuple[bool, list[int] | None] | None = None
    priority: bool | None = None
    labels: bool = False  # the job holds its chat rows to its labels option


NO_TRAITS = EngineTraits()


def check_body(
    body: Any, endpoint: Endpoint, model_names: frozenset[str], traits: EngineTraits = NO_TRAITS
) -> list[FieldProblem]:
    """Checks a request body for what the pipeline needs before anything runs, on an engine
    with ``traits``."""
    if not isinstance(body, dict):
        return [wrong_kind("body", body, f"must be an object with the request, got {kind_of(body)}")]
    problems: list[FieldProblem] = []
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        problems.append(
            FieldProblem("body.model", f"must be the model's name as a string, got {kind_of(model)}", INVALID_TYPE)
        )
    elif model is not None and model not in model_names:
        problems.append(FieldProblem("body.model", _unknown_model(model, model_names)))
    if endpoint == "chat":
        problems += check_messages(body.get("messages"))
    elif endpoint == "responses":
        problems += check_responses_request(body)
    elif endpoint == "completions":
        problems += check_prompt_shape(body.get("prompt"), "body.prompt", MAX_PROMPTS, "complete")
    elif endpoint == "score":
        problems += check_score_request(body)
    elif endpoint == "rerank":
        problems += check_rerank_request(body)
    elif endpoint == "classify":
        problems += check_prompt_shape(body.get("input"), "body.input", MAX_PROMPTS, "classify")
    elif endpoint in AUDIO:
        problems += check_audio_request(body)
    else:
        problems += check_embedding_request(body, model_names, traits.shortening)
    if "response_format" in body and endpoint not in ("embeddings", *AUDIO):
        problems += check_response_format(body["response_format"], "body.response_format")
    if body.get("stream"):
        problems.append(FieldProblem("body.stream", "streaming is not available in a batch job; remove it"))
    problems += check_numbers(body, "body.")
    problems += check_fields(body, endpoint)
    problems += check_logprobs(body, endpoint)
    problems += check_choices(body)
    if endpoint == "chat":
        problems += check_tool_choice(body)
    if isinstance(body.get("structured_outputs"), dict):
        problems += check_structured_outputs(body)
    for name, kind, words in (("bad_words", str, "strings"), ("allowed_token_ids", int, "token ids")):
        items = body.get(name)
        if isinstance(items, list) and not all(type(i) is kind and (kind is str or 0 <= i <= INT32_MAX) for i in items):
            problems.append(FieldProblem(f"body.{name}", f"must be a list of {words}", INVALID_TYPE))
    effort = body.get("reasoning_effort")
    if endpoint == "chat" and isinstance(effort, str) and effort not in EFFORTS:
        message = f"must be one of {', '.join(EFFORTS)}; got {json.dumps(effort)}"
        problems.append(FieldProblem("body.reasoning_effort", message))
    if traits.priority is False and type(body.get("priority")) is int and body["priority"] != 0:
        message = (
            "asks for a place in the scheduler's order, and this job's engine does not schedule by "
            "priority; start it with --engine-arg scheduling_policy=priority, or remove priority"
        )
        problems.append(FieldProblem("body.priority", message))
    if endpoint == "chat" and traits.labels:
        problems += check_labelled_row(body)
    if endpoint == "chat" and body.get("continue_final_message") is True:
        problems += check_continuation(body)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        problems.append(
            FieldProblem("body.chat_template_kwargs", f"must be an object, got {kind_of(kwargs)}", INVALID_TYPE)
        )
    return problems


def _unknown_model(model: str, model_names: frozenset[str]) -> str:
    """The message for a row naming a model the job does not run: neither its model nor an adapter."""
    base = model_names.base if isinstance(model_names, ModelNames) else sorted(model_names)[0]
    adapters = model_names.adapters if isinstance(model_names, ModelNames) else ()
    if not adapters:
        return (
            f"is '{model}' but this job runs '{base}' (one model per job); "
            "remove body.model, submit the job with --model set to it, or add it as an adapter "
            f"(--lora-modules {model}=PATH)"
        )
    return (
        f"is '{model}', which is neither this job's model '{base}' nor one of its adapters "
        f"({', '.join(adapters)}); name one of those, or add the adapter with --lora-modules {model}=PATH"
    )


def check_fields(body: dict[str, Any], endpoint: Endpoint) -> list[FieldProblem]:
    """The fields the endpoint does not take, and values of the wrong kind or out of range
    (see :mod:`anex_pipeline.request_fields`; integer ranges are :func:`check_numbers`')."""
    accepted = fields_of(endpoint)
    problems: list[FieldProblem] = []
    for name, value in body.items():  # runs for every row: a look-up and a type test per field
        spec = accepted.get(name)
        if spec is None:
            problems.append(FieldProblem(f"body.{name}", unknown_field(name, endpoint), UNKNOWN_PARAMETER))
        elif not spec.kinds or (value is None and not spec.sampling):
            continue  # checked on its own, or an unset envelope field as OpenAI clients write them
        elif type(value) not in spec.kinds:
            wanted = " or ".join(KIND_WORDS[k] for k in spec.kinds if not (k is int and float in spec.kinds))
            problems.append(FieldProblem(f"body.{name}", f"must be {wanted}, got {kind_of(value)}", INVALID_TYPE))
        elif type(value) is float and not math.isfinite(value):
            continue  # check_numbers says so
        elif type(value) in NUMBER and (why := spec.out_of_range(value)) is not None:
            problems.append(FieldProblem(f"body.{name}", why))
    return problems
