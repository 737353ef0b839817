"""The fields that shape a row's answer rather than its prompt: response formats (chat's
``response_format`` and the responses API's ``text.format``), vLLM's structured outputs, forced
tool calls, ``n`` choices and logprobs."""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator
from typing import Any

from anex_pipeline.request_fields import (
    CAP_FIELDS,
)
from anex_pipeline.spec import INVALID_TYPE, UNKNOWN_PARAMETER, Endpoint, JobOptions, Problem
from anex_pipeline.validate.numbers import (
    MAX_CHOICES,
    MAX_JOB_TOKENS,
    MAX_LOGPROBS,
    MAX_ROW_LOGPROBS,
    MAX_ROW_TOKENS,
    UNCAPPED_ROW_TOKENS,
)
from anex_pipeline.validate.problems import FieldProblem, kind_of, wrong_kind

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


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


def check_text_format(fmt: Any) -> list[FieldProblem]:
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


TOOL_CHOICES = ("none", "auto", "required")


# vLLM's structured outputs a row may ask for, and their size bounds: a constraint is compiled
# for its row alone, so its size bounds the compile's time and memory.
STRUCTURED_OUTPUTS = ("choice", "regex", "grammar", "json")


MAX_CHOICE_ITEMS = 1024


MAX_CONSTRAINT_CHARS = 16 * 1024  # a regex, a grammar, a choice, or a schema written as JSON


def check_structured_outputs(body: dict[str, Any]) -> list[FieldProblem]:
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


COMPILE_CHECKED = ("regex", "grammar")  # besides their size, their compile time is bounded at submit


class Constraints:
    """The regexes and grammars a job's accepted rows give vLLM to compile, each once with the
    lines that ask for it; the file readers add each row they accept, and the submit step times
    their compiles (:mod:`anex_pipeline.engine.constraint_check`).

    With ``most``, only the first ``most`` distinct ones are kept: a line asking for another is
    counted in :attr:`past_most` (its line and kind, compactly, as a huge file may hold millions),
    and its text is not kept."""

    def __init__(self, most: int | None = None) -> None:
        self.lines: dict[tuple[str, str], list[int]] = {}
        self.most = most
        self._past_lines = array("q")
        self._past_kinds = bytearray()  # the position in COMPILE_CHECKED of each one's kind

    def add(self, body: dict[str, Any], line: int) -> None:
        spec = body.get("structured_outputs")
        if type(spec) is dict:
            for kind in COMPILE_CHECKED:
                if type(text := spec.get(kind)) is str:
                    lines = self.lines.get((kind, text))
                    if lines is None and self.most is not None and len(self.lines) >= self.most:
                        self._past_lines.append(line)
                        self._past_kinds.append(COMPILE_CHECKED.index(kind))
                    elif lines is None:
                        self.lines[(kind, text)] = [line]
                    else:
                        lines.append(line)

    def past_most(self) -> Iterator[tuple[int, str]]:
        """The lines (and their kind) asking for a regex or grammar past the first ``most``
        distinct ones, in file order."""
        for line, kind in zip(self._past_lines, self._past_kinds, strict=True):
            yield line, COMPILE_CHECKED[kind]

    def __bool__(self) -> bool:
        return bool(self.lines) or bool(self._past_lines)


# The labels job option: how many labels, and how long each may be.
MAX_LABELS = 256
MAX_LABEL_CHARS = 256
# Row fields that would hold a labels job's answer to something else, or give it several.
LABELS_CONFLICTS = ("structured_outputs", "response_format", "tool_choice", "n")


def check_labels(labels: list[str]) -> list[FieldProblem]:
    """The labels option: 2 to MAX_LABELS distinct non-empty strings of at most MAX_LABEL_CHARS."""
    if not 2 <= len(labels) <= MAX_LABELS:
        return [FieldProblem("labels", f"holds {len(labels)} labels; give 2 to {MAX_LABELS}")]
    for n, label in enumerate(labels):
        if not label or len(label) > MAX_LABEL_CHARS:
            return [FieldProblem(f"labels[{n}]", f"must be 1 to {MAX_LABEL_CHARS} characters, got {len(label)}")]
    if len(set(labels)) < len(labels):
        twice = next(label for label in labels if labels.count(label) > 1)
        return [FieldProblem("labels", f"names {json.dumps(twice)} twice; each label once")]
    return []


def labels_problems(endpoint: Endpoint, options: JobOptions) -> list[Problem]:
    """Why the job's labels option cannot apply: it holds chat answers, to labels alone."""
    if not options.labels:
        return []
    if endpoint != "chat":
        message = f"hold chat answers to one label each; a {endpoint} job cannot take them, so run the prompts as chat"
        return [Problem(message, field="labels")]
    if options.response_format is not None:
        return [
            Problem("cannot go with response_format: the labels are the answer's format; remove one", field="labels")
        ]
    return []


def check_labelled_row(body: dict[str, Any]) -> list[FieldProblem]:
    """A row of a labels job: nothing of its own that holds its answer to something else or asks
    for several answers."""
    for name in LABELS_CONFLICTS:
        value = body.get(name)
        if (
            value is not None
            and not (name == "tool_choice" and value in ("none", "auto"))
            and not (name == "n" and value == 1)
        ):
            message = f"cannot go with the job's labels, which hold the answer to one label; remove {name}"
            return [FieldProblem(f"body.{name}", message)]
    return []


def check_tool_choice(body: dict[str, Any]) -> list[FieldProblem]:
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


def check_choices(body: dict[str, Any]) -> list[FieldProblem]:
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


def several_prompts(prompt: Any) -> bool:
    """Whether a completions ``prompt`` is a list of prompts (texts or token-id lists), not one."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


def answers_asked(body: dict[str, Any]) -> int:
    """The answers a row asks for, each under its cap: its choices (``n``), times its prompts on
    completions."""
    n = body.get("n")
    return (n if type(n) is int else 1) * (len(body["prompt"]) if several_prompts(body.get("prompt")) else 1)


class TokenBudget:
    """The output tokens a job's accepted rows ask for together, against its budget (the job's
    ``max_job_tokens``, or MAX_JOB_TOKENS). A row asks for its choices (``n``, times its prompts
    on completions) times its cap: its own, else the job's ``max_tokens``, else what the length
    estimate may give it (UNCAPPED_ROW_TOKENS). The file readers add each row they accept."""

    def __init__(self, options: JobOptions):
        self.limit = options.max_job_tokens or MAX_JOB_TOKENS
        self.job_cap = options.max_tokens or UNCAPPED_ROW_TOKENS
        self.asked = 0

    def add(self, body: dict[str, Any]) -> FieldProblem | None:
        """Counts an accepted row; a problem when the logprobs it asks for are more than a row may
        hold (MAX_ROW_LOGPROBS: each token's and its alternatives', over every answer, under its cap)."""
        caps = (body.get(name) for name in (*CAP_FIELDS, "max_output_tokens"))
        cap = next((c for c in caps if type(c) is int), self.job_cap)
        tokens = answers_asked(body) * cap
        self.asked += tokens
        logprobs = body.get("logprobs")
        alternatives = (body.get("top_logprobs") or 0) if logprobs is True else logprobs
        if type(alternatives) is not int or tokens * (alternatives + 1) <= MAX_ROW_LOGPROBS:
            return None
        field = "body.top_logprobs" if logprobs is True else "body.logprobs"
        return FieldProblem(
            field,
            f"asks for the logprobs of up to {tokens:,} tokens ({answers_asked(body)} answer(s) of up to {cap:,}) "
            f"with {alternatives} alternatives each, {tokens * (alternatives + 1):,} entries; a row may ask for at "
            f"most {MAX_ROW_LOGPROBS:,}: lower max_tokens, n or {field.removeprefix('body.')}",
        )

    def add_plain(self, rows: int) -> None:
        """Rows of one choice each under the job's cap (a Parquet file's prompts)."""
        self.asked += rows * self.job_cap

    def problem(self) -> Problem | None:
        if self.asked <= self.limit:
            return None
        message = (
            f"the rows ask for up to {self.asked:,} output tokens in all (each row n x its max_tokens, times "
            f"its prompts on completions; {UNCAPPED_ROW_TOKENS:,} for a row with no cap), more than the job's "
            f"budget of {self.limit:,}; "
            "split the file, lower n or max_tokens, or set max_job_tokens higher"
        )
        return Problem(message, field="max_job_tokens")


def check_logprobs(body: dict[str, Any], endpoint: Endpoint) -> list[FieldProblem]:
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
