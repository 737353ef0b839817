"""Submit-time checks that do not depend on the input's file format.

Each check returns a list of ``(field, message)`` pairs; the format readers add the line number
and turn them into :class:`~anex_pipeline.spec.Problem` objects.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from anex_pipeline.media.refs import part_reference, reference_problem
from anex_pipeline.request_fields import (
    CAP_FIELDS,
    MAX_SCORE_TEXT_CHARS,
    MAX_SCORE_TEXTS,
    NUMBER,
    fields_of,
    unknown_field,
)
from anex_pipeline.responses import EFFORTS, IMAGE_PART, ITEM_ROLES, TEXT_PARTS
from anex_pipeline.spec import (
    INVALID_TYPE,
    INVALID_VALUE,
    MISSING_PARAMETER,
    UNKNOWN_PARAMETER,
    Endpoint,
)


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


class FieldProblem(NamedTuple):
    """One thing wrong with a field: where, what, and OpenAI's code for that kind of problem."""

    field: str
    message: str
    code: str = INVALID_VALUE


def wrong_kind(where: str, value: Any, message: str) -> FieldProblem:
    """A field of the wrong kind: a missing one (``None``) is a missing parameter."""
    return FieldProblem(where, message, MISSING_PARAMETER if value is None else INVALID_TYPE)


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
# The most alternatives a token's logprobs may list: OpenAI's limit for chat, and vLLM's default
# max_logprobs, above which the engine would refuse the row.
MAX_LOGPROBS = 20
# The most choices a row may ask for (``n``), and the most tokens its choices may ask for together
# (``n`` x its own max_tokens): a row is one request to the engine, whose batch it would fill.
MAX_CHOICES = 128
MAX_ROW_TOKENS = 2**20
# Integer request fields and job options with the values the engine can take: (lowest, highest).
INTEGER_RANGES = {
    "seed": (INT64_MIN, INT64_MAX),
    "max_tokens": (1, INT32_MAX),
    "max_completion_tokens": (1, INT32_MAX),
    "max_output_tokens": (1, INT32_MAX),
    "min_tokens": (0, INT32_MAX),
    "top_k": (-1, INT32_MAX),
    "reasoning_budget": (0, INT32_MAX),
    "truncate_prompt_tokens": (-1, INT32_MAX),  # -1: the model's context
    "prompt_logprobs": (0, MAX_LOGPROBS),
    "priority": (INT64_MIN, INT64_MAX),
    "dimensions": (1, INT32_MAX),
    "top_n": (0, INT32_MAX),  # rerank: 0 returns every document
    "n": (1, MAX_CHOICES),
    "top_logprobs": (0, MAX_LOGPROBS),
    "logprobs": (0, MAX_LOGPROBS),  # completions' count; chat's is true or false
}
LOGIT_BIAS_LIMIT = 100.0
MAX_PROMPTS = 2048  # OpenAI's limit of inputs in one embeddings request; completions prompts too
MAX_INPUT_TOKEN_IDS = 8192  # OpenAI's limit of tokens in one embedding input, here for token-id inputs
ENCODING_FORMATS = ("float", "base64")
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
        "logit_bias",
    }
)


def _check_format_type(fmt: Any, where: str) -> list[FieldProblem]:
    """The outer shape of a structured-output format: an object of one of the known types."""
    if not isinstance(fmt, dict):
        return [wrong_kind(where, fmt, f'must be an object like {{"type": "json_object"}}, got {kind_of(fmt)}')]
    if fmt.get("type") not in RESPONSE_FORMAT_TYPES:
        allowed = ", ".join(RESPONSE_FORMAT_TYPES)
        return [FieldProblem(f"{where}.type", f"must be one of {allowed}; got {json.dumps(fmt.get('type'))}")]
    return []


def check_response_format(rf: Any, where: str) -> list[FieldProblem]:
    """Structural check of a response_format: the type, and the nested json_schema.schema object."""
    if found := _check_format_type(rf, where):
        return found
    kind = rf["type"]
    spec = rf.get("json_schema")
    if kind != "json_schema":
        if spec is not None:
            return [FieldProblem(f"{where}.json_schema", f"is only allowed with type 'json_schema', not '{kind}'")]
        return []
    if not isinstance(spec, dict):
        return [
            wrong_kind(
                f"{where}.json_schema",
                spec,
                'is required for type \'json_schema\' and must be an object {"name": ..., "schema": {...}}',
            )
        ]
    if not isinstance(spec.get("schema"), dict):
        return [
            wrong_kind(
                f"{where}.json_schema.schema",
                spec.get("schema"),
                "must be a JSON Schema object; the schema sits one level down, at "
                f"json_schema.schema (got {kind_of(spec.get('schema'))})",
            )
        ]
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        return [FieldProblem(f"{where}.json_schema.name", "must be a string", INVALID_TYPE)]
    return []


def check_body(
    body: Any,
    endpoint: Endpoint,
    model_names: frozenset[str],
    shortening: tuple[bool, list[int] | None] | None = None,
) -> list[FieldProblem]:
    """Checks a request body for what the pipeline needs before anything runs. ``shortening``:
    for an embeddings job, whether its model can shorten vectors and to which lengths (see
    :func:`anex_pipeline.engine.models.matryoshka_dimensions`); None when that is not known here."""
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
        problems += _check_messages(body.get("messages"))
    elif endpoint == "responses":
        problems += _check_responses_request(body)
    elif endpoint == "completions":
        problems += check_prompt_shape(body.get("prompt"), "body.prompt", MAX_PROMPTS, "complete")
    elif endpoint == "score":
        problems += _check_score_request(body)
    elif endpoint == "rerank":
        problems += _check_rerank_request(body)
    else:
        problems += _check_embedding_request(body, model_names, shortening)
    if "response_format" in body and endpoint != "embeddings":
        problems += check_response_format(body["response_format"], "body.response_format")
    if body.get("stream"):
        problems.append(FieldProblem("body.stream", "streaming is not available in a batch job; remove it"))
    problems += check_numbers(body, "body.")
    problems += check_fields(body, endpoint)
    problems += _check_logprobs(body, endpoint)
    problems += _check_choices(body)
    if endpoint == "chat":
        problems += _check_tool_choice(body)
    if isinstance(body.get("structured_outputs"), dict):
        problems += _check_structured_outputs(body)
    for name, kind, words in (("bad_words", str, "strings"), ("allowed_token_ids", int, "token ids")):
        items = body.get(name)
        if isinstance(items, list) and not all(type(i) is kind and (kind is str or 0 <= i <= INT32_MAX) for i in items):
            problems.append(FieldProblem(f"body.{name}", f"must be a list of {words}", INVALID_TYPE))
    effort = body.get("reasoning_effort")
    if endpoint == "chat" and isinstance(effort, str) and effort not in EFFORTS:
        message = f"must be one of {', '.join(EFFORTS)}; got {json.dumps(effort)}"
        problems.append(FieldProblem("body.reasoning_effort", message))
    if endpoint == "chat" and body.get("continue_final_message") is True:
        problems += _check_continuation(body)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        problems.append(
            FieldProblem("body.chat_template_kwargs", f"must be an object, got {kind_of(kwargs)}", INVALID_TYPE)
        )
    return problems


def _check_continuation(body: dict[str, Any]) -> list[FieldProblem]:
    """A row that continues its last message: vLLM's template takes that message as the start of
    the answer, so it must be the assistant's, and the prompt then gets no new assistant turn."""
    if body.get("add_generation_prompt") is True:
        message = "cannot be true together with add_generation_prompt; set add_generation_prompt to false or remove it"
        return [FieldProblem("body.continue_final_message", message)]
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    if isinstance(last, dict) and last.get("role") != "assistant":
        message = (
            "must be 'assistant' when continue_final_message is true (the answer continues that "
            "message); end the messages with the assistant's start, or remove continue_final_message"
        )
        return [FieldProblem(f"body.messages[{len(messages) - 1}].role", message)]
    return []


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


TOOL_CHOICES = ("none", "auto", "required")
# vLLM's structured outputs a row may ask for, and their size bounds: a constraint is compiled
# for its row alone, so its size bounds the compile's time and memory.
STRUCTURED_OUTPUTS = ("choice", "regex", "grammar", "json")
MAX_CHOICE_ITEMS = 1024
MAX_CONSTRAINT_CHARS = 16 * 1024  # a regex, a grammar, a choice, or a schema written as JSON


def _check_structured_outputs(body: dict[str, Any]) -> list[FieldProblem]:
    """One of vLLM's structured outputs, of the right kind and within its size bound."""
    where = "body.structured_outputs"
    spec = body["structured_outputs"]
    if body.get("response_format") is not None:
        return [FieldProblem(where, "and response_format both constrain the answer; keep one of them")]
    kinds = [k for k in STRUCTURED_OUTPUTS if spec.get(k) is not None]
    others = sorted(set(spec) - set(STRUCTURED_OUTPUTS))
    if others or len(kinds) != 1:
        found = f"; {', '.join(others)} {'is' if len(others) == 1 else 'are'} not taken" if others else ""
        return [FieldProblem(where, f"must hold exactly one of {', '.join(STRUCTURED_OUTPUTS)}{found}")]
    kind, value = kinds[0], spec[kinds[0]]
    at = f"{where}.{kind}"
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            return [FieldProblem(at, "must be a non-empty list of non-empty strings", INVALID_TYPE)]
        if len(value) > MAX_CHOICE_ITEMS:
            return [FieldProblem(at, f"holds {len(value)} choices; at most {MAX_CHOICE_ITEMS} are taken")]
        size = sum(len(v) for v in value)
    elif kind == "json":
        if not isinstance(value, (dict, str)):
            return [FieldProblem(at, "must be a JSON Schema object (or its JSON text)", INVALID_TYPE)]
        size = len(value if isinstance(value, str) else json.dumps(value))
    else:
        if not isinstance(value, str) or not value:
            return [FieldProblem(at, f"must be the {kind} as a non-empty string", INVALID_TYPE)]
        size = len(value)
    if size > MAX_CONSTRAINT_CHARS:
        return [FieldProblem(at, f"is {size:,} characters; at most {MAX_CONSTRAINT_CHARS:,} are taken")]
    return []


def _check_tool_choice(body: dict[str, Any]) -> list[FieldProblem]:
    """A tool_choice generation can be held to: one of the words, or a function the row offers."""
    choice, tools = body.get("tool_choice"), body.get("tools")
    where = "body.tool_choice"
    if choice is None or choice in ("none", "auto"):
        return []
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        return [
            FieldProblem(where, f"must be one of {', '.join(TOOL_CHOICES)} or a function; got {json.dumps(choice)}")
        ]
    names = [
        t["function"].get("name") for t in tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)
    ]
    if not names:
        return [
            FieldProblem(where, "forces a tool call but the row offers no function in tools; add tools or remove it")
        ]
    if choice == "required":
        return []
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        message = 'must name a function like {"type": "function", "function": {"name": "get_weather"}}'
        return [FieldProblem(where, message)]
    if name not in names:
        return [
            FieldProblem(
                f"{where}.function.name", f"is {json.dumps(name)}, which is not in tools ({', '.join(map(str, names))})"
            )
        ]
    return []


def _check_choices(body: dict[str, Any]) -> list[FieldProblem]:
    """``n`` above 1 with sampling that can differ, and times the row's own cap within the row's
    token budget (n's own range is :func:`check_numbers`')."""
    n = body.get("n")
    if type(n) is not int or not 1 < n <= MAX_CHOICES:
        return []
    if body.get("temperature") == 0:  # vLLM refuses it: greedy choices would all be the same
        return [
            FieldProblem(
                "body.n", f"is {n} but temperature is 0, which gives one answer; set n to 1 or raise temperature"
            )
        ]
    cap = next((body[name] for name in CAP_FIELDS if body.get(name) is not None), None)
    if type(cap) is not int or n * cap <= MAX_ROW_TOKENS:
        return []
    message = (
        f"asks for {n} choices of up to {cap} tokens, {n * cap:,} in all; a row may ask for at most "
        f"{MAX_ROW_TOKENS:,} (n x max_tokens): lower n or max_tokens"
    )
    return [FieldProblem("body.n", message)]


def _check_logprobs(body: dict[str, Any], endpoint: Endpoint) -> list[FieldProblem]:
    """Chat asks for logprobs with ``logprobs: true`` and ``top_logprobs`` alternatives (which
    need it), completions with ``logprobs: k``; the counts' range is :func:`check_numbers`'."""
    logprobs = body.get("logprobs")
    if endpoint == "chat":
        if logprobs is not None and type(logprobs) is not bool:
            message = f"must be true or false in a chat request (top_logprobs sets the count), got {kind_of(logprobs)}"
            return [FieldProblem("body.logprobs", message, INVALID_TYPE)]
        if body.get("top_logprobs") is not None and logprobs is not True:
            return [FieldProblem("body.top_logprobs", "needs logprobs: true; set it or remove top_logprobs")]
    elif endpoint == "completions" and type(logprobs) is bool:
        message = f"must be the number of alternatives per token (0 to {MAX_LOGPROBS}) in a completions request"
        return [FieldProblem("body.logprobs", message, INVALID_TYPE)]
    return []


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
                problems.append(FieldProblem(prefix + key, _non_finite_message(value)))
        elif type(value) is int:
            low, high = INTEGER_RANGES.get(key, (value, value))
            if not low <= value <= high:
                message = f"is {value}, outside the range the engine takes ({low} to {high}); use a value within it"
                problems.append(FieldProblem(prefix + key, message))
        elif key == "logit_bias" and value is not None:
            problems += _check_logit_bias(value, prefix + key)
    return problems


def non_finite_problems(value: Any, where: str) -> Iterator[FieldProblem]:
    """A problem for each infinite or NaN number inside a JSON value (walked without recursion:
    an option's value may be nested as deep as the JSON reader allows)."""
    stack = [(where, value)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            yield FieldProblem(where, _non_finite_message(value))
        elif isinstance(value, dict):
            stack += [(f"{where}.{key}" if where else key, item) for key, item in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(f"{where}[{n}]", item) for n, item in reversed(list(enumerate(value)))]


def deeper_than(value: Any, levels: int) -> bool:
    """True when a JSON value nests lists and objects more than ``levels`` deep (the value itself,
    if a list or an object, is the first level); walked without recursion."""
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        if depth > levels:
            return True
        stack += [(child, depth + 1) for child in children if isinstance(child, (dict, list))]
    return False


def _non_finite_message(value: float) -> str:
    return f"is not a finite number (it reads as {value!r}); write a finite number or remove it"


def _check_logit_bias(bias: Any, where: str) -> list[FieldProblem]:
    if not isinstance(bias, dict):
        message = f'must be an object of token ids and biases like {{"1234": -100}}, got {kind_of(bias)}'
        return [FieldProblem(where, message, INVALID_TYPE)]
    for token, value in bias.items():
        if not (token.isascii() and token.isdigit() and int(token) <= INT32_MAX):
            return [
                FieldProblem(
                    f"{where}.{token}", f'{json.dumps(token)} is not a token id; keys must be token ids like "1234"'
                )
            ]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return [
                FieldProblem(
                    f"{where}.{token}", f"must be a number from -100 to 100, got {kind_of(value)}", INVALID_TYPE
                )
            ]
        if not math.isfinite(value):
            return [FieldProblem(f"{where}.{token}", _non_finite_message(value))]
        if abs(value) > LOGIT_BIAS_LIMIT:
            return [FieldProblem(f"{where}.{token}", f"is {value}; a bias must be from -100 to 100")]
    return []


def _check_messages(messages: Any) -> list[FieldProblem]:
    if not isinstance(messages, list) or not messages:
        message = f"a chat row needs a non-empty list of messages, got {kind_of(messages)}"
        return [FieldProblem("body.messages", message, MISSING_PARAMETER if not messages else INVALID_TYPE)]
    for n, msg in enumerate(messages):
        where = f"body.messages[{n}]"
        if not isinstance(msg, dict):
            return [FieldProblem(where, f"must be an object with role and content, got {kind_of(msg)}", INVALID_TYPE)]
        if msg.get("role") not in ROLES:
            return [
                FieldProblem(f"{where}.role", f"must be one of {', '.join(ROLES)}; got {json.dumps(msg.get('role'))}")
            ]
        content = msg.get("content")
        if content is None and msg.get("role") == "assistant" and msg.get("tool_calls"):
            continue
        if isinstance(content, str):
            continue
        if isinstance(content, list) and all(isinstance(p, dict) and "type" in p for p in content):
            for p, part in enumerate(content):  # media URLs the media stage would never fetch
                url = part_reference(part)
                if url is not None and (why := reference_problem(url)) is not None:
                    return [FieldProblem(f"{where}.content[{p}].{part['type']}", why)]
            continue
        message = f"must be a string or a list of content parts, got {kind_of(content)}"
        return [wrong_kind(f"{where}.content", content, message)]
    return []


def _check_responses_request(body: dict[str, Any]) -> list[FieldProblem]:
    """The parts of a /v1/responses request that have a shape of their own: input, text.format,
    reasoning.effort."""
    problems = _check_response_input(body.get("input"))
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        message = f'must be an object like {{"format": {{"type": "json_object"}}}}, got {kind_of(text)}'
        problems.append(FieldProblem("body.text", message, INVALID_TYPE))
    elif text is not None and text.get("format") is not None:
        problems += _check_text_format(text["format"])
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        message = f'must be an object like {{"effort": "low"}}, got {kind_of(reasoning)}'
        problems.append(FieldProblem("body.reasoning", message, INVALID_TYPE))
    elif reasoning is not None and reasoning.get("effort") not in (None, *EFFORTS):
        message = f"must be one of {', '.join(EFFORTS)}; got {json.dumps(reasoning['effort'])}"
        problems.append(FieldProblem("body.reasoning.effort", message))
    return problems


def _check_response_input(value: Any) -> list[FieldProblem]:
    where = "body.input"
    if isinstance(value, str):
        return [] if value.strip() else [FieldProblem(where, "is empty; there is no prompt to send")]
    if not isinstance(value, list) or not value:
        message = f"a responses row needs a string input or a non-empty list of input items, got {kind_of(value)}"
        return [FieldProblem(where, message, MISSING_PARAMETER if value is None else INVALID_TYPE)]
    for n, item in enumerate(value):
        at = f"{where}[{n}]"
        if not isinstance(item, dict):
            return [
                FieldProblem(
                    at, f"must be an input item object with role and content, got {kind_of(item)}", INVALID_TYPE
                )
            ]
        if item.get("type", "message") != "message":
            message = f"is a {json.dumps(item['type'])} item; batch rows take message items only (role and content)"
            return [FieldProblem(f"{at}.type", message)]
        if item.get("role") not in ITEM_ROLES:
            return [
                FieldProblem(
                    f"{at}.role", f"must be one of {', '.join(ITEM_ROLES)}; got {json.dumps(item.get('role'))}"
                )
            ]
        content = item.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            message = f"must be a string or a list of content parts, got {kind_of(content)}"
            return [wrong_kind(f"{at}.content", content, message)]
        for p, part in enumerate(content):
            if (found := _check_input_part(part, f"{at}.content[{p}]")) is not None:
                return [found]
    return []


def _check_input_part(part: Any, where: str) -> FieldProblem | None:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS:
        text = part.get("text")
        return (
            None
            if isinstance(text, str)
            else wrong_kind(f"{where}.text", text, f"must be a string, got {kind_of(text)}")
        )
    if kind == IMAGE_PART:
        url = part.get("image_url")
        if isinstance(url, str):
            why = reference_problem(url)
            return None if why is None else FieldProblem(f"{where}.image_url", why)
        message = "must be the image's URL (https: or data:) as a string; images by file_id are not supported"
        return wrong_kind(f"{where}.image_url", url, message)
    wanted = ", ".join((*TEXT_PARTS, IMAGE_PART))
    return FieldProblem(f"{where}.type", f"must be one of {wanted}; got {json.dumps(kind)}")


def _check_text_format(fmt: Any) -> list[FieldProblem]:
    """text.format of a responses request: chat's response_format with the schema one level up."""
    where = "body.text.format"
    if found := _check_format_type(fmt, where):
        return found
    if fmt["type"] != "json_schema":
        return []
    if "json_schema" in fmt:
        message = (
            'in a responses request the schema goes straight in text.format: {"type": "json_schema", '
            '"name": ..., "schema": {...}}'
        )
        return [FieldProblem(f"{where}.json_schema", message, UNKNOWN_PARAMETER)]
    if not isinstance(fmt.get("name"), str):
        return [wrong_kind(f"{where}.name", fmt.get("name"), "is required for type 'json_schema': the schema's name")]
    if not isinstance(fmt.get("schema"), dict):
        message = f"must be a JSON Schema object (got {kind_of(fmt.get('schema'))})"
        return [wrong_kind(f"{where}.schema", fmt.get("schema"), message)]
    return []


def _check_embedding_request(
    body: dict[str, Any], model_names: frozenset[str], shortening: tuple[bool, list[int] | None] | None
) -> list[FieldProblem]:
    """An embeddings row's input, encoding_format, and dimensions against what its model can do."""
    problems = check_prompt_shape(body.get("input"), "body.input", MAX_PROMPTS, "embed")
    fmt = body.get("encoding_format")
    if isinstance(fmt, str) and fmt not in ENCODING_FORMATS:
        message = f"must be one of {', '.join(ENCODING_FORMATS)}; got {json.dumps(fmt)}"
        problems.append(FieldProblem("body.encoding_format", message))
    dims = body.get("dimensions")
    if type(dims) is not int or shortening is None:
        return problems
    matryoshka, allowed = shortening
    model = sorted(model_names)[0]
    if not matryoshka:
        message = (
            f"model '{model}' cannot shorten its vectors (it is not a Matryoshka model: its config.json "
            "has no matryoshka_dimensions or is_matryoshka); remove dimensions or run the job on a model that can"
        )
        problems.append(FieldProblem("body.dimensions", message))
    elif allowed and dims not in allowed:
        message = f"is {dims}, but model '{model}' makes vectors of {', '.join(map(str, allowed))} dimensions only"
        problems.append(FieldProblem("body.dimensions", message))
    return problems


def _check_score_request(body: dict[str, Any]) -> list[FieldProblem]:
    """A score row's ``text_1`` and ``text_2``, paired as vLLM pairs them: one to one, one to each
    of N, or N to N in order."""
    problems = _check_score_texts(body.get("text_1"), "body.text_1") + _check_score_texts(
        body.get("text_2"), "body.text_2"
    )
    first, second = body.get("text_1"), body.get("text_2")
    if not problems and isinstance(first, list) and len(first) > 1:
        count = len(second) if isinstance(second, list) else 1
        if count != len(first):
            message = (
                f"holds {len(first)} texts but body.text_2 holds {count}; give one text_1 for all of "
                "text_2, or as many as text_2 has, in order"
            )
            problems.append(FieldProblem("body.text_1", message))
    return problems


def _check_rerank_request(body: dict[str, Any]) -> list[FieldProblem]:
    """A rerank row's one ``query`` and its ``documents`` (``top_n`` is a plain integer field)."""
    query = body.get("query")
    if isinstance(query, list):
        problems = [FieldProblem("body.query", "must be one string; score several queries in /v1/score rows")]
    else:
        problems = _check_score_texts(query, "body.query")
    return problems + _check_score_texts(body.get("documents"), "body.documents")


def _check_score_texts(value: Any, where: str) -> list[FieldProblem]:
    """A string or a list of strings to score, none empty, within the count and size bounds."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts:
        return [wrong_kind(where, value, f"must be a string or a non-empty list of strings, got {kind_of(value)}")]
    if len(texts) > MAX_SCORE_TEXTS:
        return [FieldProblem(where, f"holds {len(texts)} texts; at most {MAX_SCORE_TEXTS} go in one row, split it")]
    for n, text in enumerate(texts):
        at = where if isinstance(value, str) else f"{where}[{n}]"
        if not isinstance(text, str):
            return [wrong_kind(at, text, f"must be a string, got {kind_of(text)}")]
        if not text:
            return [FieldProblem(at, "is an empty string; there is nothing to score")]
        if len(text) > MAX_SCORE_TEXT_CHARS:
            return [FieldProblem(at, f"is {len(text):,} characters; at most {MAX_SCORE_TEXT_CHARS:,} are taken")]
    return []


def check_prompt_shape(value: Any, where: str, most: int, task: str) -> list[FieldProblem]:
    """A prompt or embedding input in one of OpenAI's four shapes: a string, a list of strings,
    a list of token ids, or a list of token-id lists; at most ``most`` prompts, none empty, and
    each token-id prompt within OpenAI's token limit. ``task``: what is done with it ("embed")."""
    if isinstance(value, str):
        return [] if value else [FieldProblem(where, f"is an empty string; there is nothing to {task}")]
    shapes = "a string, a list of strings, a list of token ids or a list of token-id lists"
    if not isinstance(value, list) or not value:
        return [wrong_kind(where, value, f"must be {shapes}, got {kind_of(value)}")]
    if all(type(v) is int for v in value):
        return _check_token_ids(value, where)
    if len(value) > most:
        return [FieldProblem(where, f"holds {len(value)} prompts; at most {most} go in one row, split it")]
    kind = type(value[0])
    for n, item in enumerate(value):
        at = f"{where}[{n}]"
        if type(item) is not kind:
            return [FieldProblem(at, f"is {kind_of(item)} but {where}[0] is {kind_of(value[0])}; use one shape")]
        if isinstance(item, str) and not item:
            return [FieldProblem(at, f"is an empty string; there is nothing to {task}")]
        if isinstance(item, list) and item and all(type(t) is int for t in item):
            if found := _check_token_ids(item, at):
                return found
        elif not isinstance(item, str):
            return [wrong_kind(at, item, f"must be a string or a non-empty list of token ids, got {kind_of(item)}")]
    return []


def _check_token_ids(ids: list[int], where: str) -> list[FieldProblem]:
    if len(ids) > MAX_INPUT_TOKEN_IDS:
        return [FieldProblem(where, f"holds {len(ids)} token ids; at most {MAX_INPUT_TOKEN_IDS} go in one prompt")]
    bad = next((n for n, t in enumerate(ids) if not 0 <= t <= INT32_MAX), None)
    if bad is not None:
        return [FieldProblem(f"{where}[{bad}]", f"is {ids[bad]}, which is not a token id (0 to {INT32_MAX})")]
    return []


def pydantic_code(error_type: str) -> str:
    """OpenAI's code for a pydantic validation error's type (``missing``, ``int_parsing``, ...)."""
    if error_type == "missing":
        return MISSING_PARAMETER
    if error_type == "extra_forbidden":
        return UNKNOWN_PARAMETER
    if error_type.endswith(("_type", "_parsing")):
        return INVALID_TYPE
    return INVALID_VALUE


def kind_of(value: Any) -> str:
    """What a JSON value is, in words for a problem's message ("a string", "an empty list")."""
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
