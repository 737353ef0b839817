"""Submit-time checks that do not depend on the input's file format.

Each check returns a list of ``(field, message)`` pairs; the format readers add the line number
and turn them into :class:`~anex_pipeline.spec.Problem` objects.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ValidationError

from anex_pipeline.request_fields import NUMBER, fields_of, unknown_field
from anex_pipeline.spec import Endpoint, JobOptions, JobRejected, Problem

FieldProblem = tuple[str, str]

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
ROLES = ("system", "developer", "user", "assistant", "tool")
# How a kind of JSON value is named in a message.
KIND_WORDS = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    list: "a list",
    dict: "an object",
}
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the engine takes a seed as a signed 64-bit integer
INT32_MAX = 2**31 - 1
# Integer request fields and job options with the values the engine can take: (lowest, highest).
INTEGER_RANGES = {
    "seed": (INT64_MIN, INT64_MAX),
    "max_tokens": (1, INT32_MAX),
    "max_completion_tokens": (1, INT32_MAX),
    "min_tokens": (0, INT32_MAX),
    "top_k": (-1, INT32_MAX),
    "reasoning_budget": (0, INT32_MAX),
    "truncate_prompt_tokens": (-1, INT32_MAX),
    "dimensions": (1, INT32_MAX),
}
LOGIT_BIAS_LIMIT = 100.0
# Number fields of a request body and of the job options (integers as above, biases, the rest floats).
NUMBER_FIELDS = frozenset(
    {
        *INTEGER_RANGES,
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "length_penalty",
        "logit_bias",
    }
)


def check_response_format(rf: Any, where: str) -> list[FieldProblem]:
    """Structural check of a response_format: the type, and the nested json_schema.schema object."""
    if not isinstance(rf, dict):
        return [(where, f'must be an object like {{"type": "json_object"}}, got {_kind(rf)}')]
    kind = rf.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        allowed = ", ".join(RESPONSE_FORMAT_TYPES)
        return [(f"{where}.type", f"must be one of {allowed}; got {json.dumps(kind)}")]
    spec = rf.get("json_schema")
    if kind != "json_schema":
        if spec is not None:
            return [(f"{where}.json_schema", f"is only allowed with type 'json_schema', not '{kind}'")]
        return []
    if not isinstance(spec, dict):
        return [
            (
                f"{where}.json_schema",
                'is required for type \'json_schema\' and must be an object {"name": ..., "schema": {...}}',
            )
        ]
    if not isinstance(spec.get("schema"), dict):
        return [
            (
                f"{where}.json_schema.schema",
                "must be a JSON Schema object; the schema sits one level down, at "
                f"json_schema.schema (got {_kind(spec.get('schema'))})",
            )
        ]
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        return [(f"{where}.json_schema.name", "must be a string")]
    return []


def check_body(body: Any, endpoint: Endpoint, model_names: frozenset[str]) -> list[FieldProblem]:
    """Checks a request body for what the pipeline needs before anything runs."""
    if not isinstance(body, dict):
        return [("body", f"must be an object with the request, got {_kind(body)}")]
    problems: list[FieldProblem] = []
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        problems.append(("body.model", f"must be the model's name as a string, got {_kind(model)}"))
    elif model is not None and model not in model_names:
        wanted = sorted(model_names)[0]
        problems.append(
            (
                "body.model",
                f"is '{model}' but this job runs '{wanted}' (one model per job); "
                "remove body.model or submit the job with --model set to it",
            )
        )
    if endpoint == "chat":
        problems += _check_messages(body.get("messages"))
    elif endpoint == "completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            problems.append(("body.prompt", f"a completions row needs a string prompt, got {_kind(prompt)}"))
    else:
        problems += _check_embedding_input(body.get("input"))
    if "response_format" in body and endpoint != "embeddings":
        problems += check_response_format(body["response_format"], "body.response_format")
    if body.get("stream"):
        problems.append(("body.stream", "streaming is not available in a batch job; remove it"))
    problems += check_numbers(body, "body.")
    if body.get("logprobs") not in (None, False):
        problems.append(("body.logprobs", "logprobs are not supported yet; remove logprobs and top_logprobs"))
    elif body.get("top_logprobs") is not None:
        problems.append(
            ("body.top_logprobs", "logprobs are not supported yet (and need logprobs: true); remove top_logprobs")
        )
    problems += _check_fields(body, endpoint)
    n = body.get("n", 1)
    if n != 1:
        problems.append(("body.n", f"only one choice per row is produced; got n={json.dumps(n)}"))
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        problems.append(("body.chat_template_kwargs", f"must be an object, got {_kind(kwargs)}"))
    return problems


def _check_fields(body: dict[str, Any], endpoint: Endpoint) -> list[FieldProblem]:
    """The fields the endpoint does not take, and values of the wrong kind or out of range
    (see :mod:`anex_pipeline.request_fields`; integer ranges are :func:`check_numbers`')."""
    accepted = fields_of(endpoint)
    problems: list[FieldProblem] = []
    for name, value in body.items():  # runs for every row: a look-up and a type test per field
        spec = accepted.get(name)
        if spec is None:
            problems.append((f"body.{name}", unknown_field(name, endpoint)))
        elif not spec.kinds or (value is None and not spec.sampling):
            continue  # checked on its own, or an unset envelope field as OpenAI clients write them
        elif type(value) not in spec.kinds:
            wanted = " or ".join(KIND_WORDS[k] for k in spec.kinds if not (k is int and float in spec.kinds))
            problems.append((f"body.{name}", f"must be {wanted}, got {_kind(value)}"))
        elif type(value) is float and not math.isfinite(value):
            continue  # check_numbers says so
        elif type(value) in NUMBER and (why := spec.out_of_range(value)) is not None:
            problems.append((f"body.{name}", why))
    return problems


def check_numbers(values: dict[str, Any], prefix: str = "") -> list[FieldProblem]:
    """The number fields the engine cannot take: an infinity or NaN (Python's json reads 1e999,
    NaN and Infinity), an integer out of its field's range, a logit_bias that does not map token
    ids to biases from -100 to 100. Fields are named ``prefix + key``."""
    problems: list[FieldProblem] = []
    for key, value in values.items():  # runs for every row: the usual case is kept short
        if key not in NUMBER_FIELDS:
            continue
        if type(value) is float:
            if not math.isfinite(value):
                problems.append((prefix + key, _non_finite_message(value)))
        elif type(value) is int:
            low, high = INTEGER_RANGES.get(key, (value, value))
            if not low <= value <= high:
                message = f"is {value}, outside the range the engine takes ({low} to {high}); use a value within it"
                problems.append((prefix + key, message))
        elif key == "logit_bias" and value is not None:
            problems += _check_logit_bias(value, prefix + key)
    return problems


def _non_finite(value: Any, where: str) -> Iterator[FieldProblem]:
    """A problem for each infinite or NaN number inside a JSON value (walked without recursion:
    an option's value may be nested as deep as the JSON reader allows)."""
    stack = [(where, value)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            yield where, _non_finite_message(value)
        elif isinstance(value, dict):
            stack += [(f"{where}.{key}" if where else key, item) for key, item in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(f"{where}[{n}]", item) for n, item in reversed(list(enumerate(value)))]


def _non_finite_message(value: float) -> str:
    return f"is not a finite number (it reads as {value!r}); write a finite number or remove it"


def _check_logit_bias(bias: Any, where: str) -> list[FieldProblem]:
    if not isinstance(bias, dict):
        return [(where, f'must be an object of token ids and biases like {{"1234": -100}}, got {_kind(bias)}')]
    for token, value in bias.items():
        if not (token.isascii() and token.isdigit() and int(token) <= INT32_MAX):
            return [(f"{where}.{token}", f'{json.dumps(token)} is not a token id; keys must be token ids like "1234"')]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return [(f"{where}.{token}", f"must be a number from -100 to 100, got {_kind(value)}")]
        if not math.isfinite(value):
            return [(f"{where}.{token}", _non_finite_message(value))]
        if abs(value) > LOGIT_BIAS_LIMIT:
            return [(f"{where}.{token}", f"is {value}; a bias must be from -100 to 100")]
    return []


def _check_messages(messages: Any) -> list[FieldProblem]:
    if not isinstance(messages, list) or not messages:
        return [("body.messages", f"a chat row needs a non-empty list of messages, got {_kind(messages)}")]
    for n, msg in enumerate(messages):
        where = f"body.messages[{n}]"
        if not isinstance(msg, dict):
            return [(where, f"must be an object with role and content, got {_kind(msg)}")]
        if msg.get("role") not in ROLES:
            return [(f"{where}.role", f"must be one of {', '.join(ROLES)}; got {json.dumps(msg.get('role'))}")]
        content = msg.get("content")
        if content is None and msg.get("role") == "assistant" and msg.get("tool_calls"):
            continue
        if isinstance(content, str):
            continue
        if isinstance(content, list) and all(isinstance(p, dict) and "type" in p for p in content):
            continue
        return [(f"{where}.content", f"must be a string or a list of content parts, got {_kind(content)}")]
    return []


def _check_embedding_input(value: Any) -> list[FieldProblem]:
    if isinstance(value, str):
        return [] if value else [("body.input", "is an empty string; there is nothing to embed")]
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return []
    if isinstance(value, list):
        return [
            (
                "body.input",
                f"holds {len(value)} items; put one text per row (one row per custom_id)",
            )
        ]
    return [("body.input", f"an embeddings row needs a string input, got {_kind(value)}")]


def parse_options(raw: dict[str, Any]) -> JobOptions:
    """Builds JobOptions from a dict (options file + CLI flags), or raises JobRejected."""
    _reject_numbers(raw)  # NaN would otherwise meet a bound's check first, with a puzzling message
    try:
        options = JobOptions.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "options"
            msg = _unknown_option(err["loc"]) if err["type"] == "extra_forbidden" else err["msg"]
            problems.append(Problem(f"{msg} (options)", field=loc))
        raise JobRejected(problems) from None
    _reject_numbers(options.model_dump(exclude_none=True))  # values that were text, such as "inf"
    found = _check_fields(options.sampling_defaults(), "chat")  # the rows' defaults: a row's own ranges
    if found:
        raise JobRejected([Problem(f"{m} (options)", field=f.removeprefix("body.")) for f, m in found])
    if options.response_format is not None:
        found = check_response_format(options.response_format, "response_format")
        if found:
            raise JobRejected([Problem(m + " (options)", field=f) for f, m in found])
    if options.reasoning_parser is not None or options.tool_parser is not None:
        from anex_pipeline.engine.parsing import ParserChoiceError, check_parser_names  # imports vLLM

        try:
            check_parser_names(options.reasoning_parser, options.tool_parser)
        except ParserChoiceError as exc:
            raise JobRejected([Problem(f"{exc} (options)", field="reasoning_parser/tool_parser")]) from None
    return options


def _reject_numbers(raw: dict[str, Any]) -> None:
    """Raises JobRejected for the options' number fields the engine cannot take, and for an
    infinity or NaN in any other option (a time limit, a price, a media timeout)."""
    found = check_numbers(raw) + list(_non_finite({k: v for k, v in raw.items() if k not in NUMBER_FIELDS}, ""))
    if found:
        raise JobRejected([Problem(f"{m} (options)", field=f) for f, m in found])


def _unknown_option(loc: tuple[Any, ...]) -> str:
    """The message for an unknown key, with the closest known name when there is one."""
    model: Any = JobOptions
    for part in loc[:-1]:  # a nested option such as media.max_byte
        model = getattr(model.model_fields.get(str(part)), "annotation", None)
        if not isinstance(model, type) or not issubclass(model, BaseModel):
            return "is not a known option"
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return f"is not a known option; did you mean '{close[0]}'?" if close else "is not a known option"


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string" if value else "an empty string"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
