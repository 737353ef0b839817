"""The check every constrained answer goes through after generation.

Generation is already constrained by vLLM's structured outputs; this is the second line: the
answer must be exactly one JSON object (no array, bare value, surrounding text or code fence)
and, for ``json_schema``, valid against the schema. Answers are never repaired.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from anex_pipeline.errors import RowErrorType
from anex_pipeline.request_fields import AUDIO, POOLING
from anex_pipeline.spec import RowOutcome


def answer_problem(text: str | None, response_format: dict[str, Any]) -> str | None:
    """Why an answer fails its response_format, or None when it passes."""
    if text is None:
        return "the answer is empty"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not a JSON object: {exc.msg} at column {exc.colno}"
    if not isinstance(value, dict):
        return f"the answer is JSON but not an object (a {type(value).__name__})"
    if response_format.get("type") != "json_schema":
        return None
    schema = response_format["json_schema"]["schema"]
    try:
        validator = _validator(json.dumps(schema, sort_keys=True))
    except Exception as exc:  # an unusable schema cannot pass anything
        return f"the schema cannot be used for validation: {exc}"
    error = next(iter(validator.iter_errors(value)), None)
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return f"does not match the schema at {where}: {error.message}"


@lru_cache(maxsize=64)
def _validator(schema_json: str) -> Any:
    import jsonschema

    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def mark_completion(outcome: RowOutcome, response_format: dict[str, Any] | None, endpoint: str) -> RowOutcome:
    """Sets the outcome's flags: ``length`` for an answer cut at the cap, ``format_error`` for one
    that fails its response_format (a cut constrained answer is both, and marked ``length``). With
    several choices (``n``), one choice cut or failing flags the row."""
    if outcome.body is None or outcome.error is not None or endpoint in POOLING | AUDIO:
        return outcome
    choices = outcome.body["choices"]
    cut = any(choice.get("finish_reason") == "length" for choice in choices)
    if response_format is not None:
        outcome.format_error = any(_fails(choice, response_format, endpoint) for choice in choices)
    if cut:
        outcome.completion_flag = RowErrorType.LENGTH
    elif outcome.format_error:
        outcome.completion_flag = RowErrorType.FORMAT
    return outcome


def _fails(choice: dict[str, Any], response_format: dict[str, Any], endpoint: str) -> bool:
    """Whether one choice misses its response_format: cut at the cap, or not a valid answer (a
    choice that called tools is judged by its calls, not its text)."""
    if (choice.get("message") or {}).get("tool_calls"):
        return False
    text = choice.get("text") if endpoint == "completions" else choice["message"].get("content")
    return choice.get("finish_reason") == "length" or answer_problem(text, response_format) is not None
