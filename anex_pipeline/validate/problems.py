"""What a check finds wrong with a field (:class:`FieldProblem`), and the words and OpenAI codes
its messages use."""

from __future__ import annotations

from typing import Any, NamedTuple

from anex_pipeline.spec import INVALID_TYPE, INVALID_VALUE, MISSING_PARAMETER, UNKNOWN_PARAMETER


class FieldProblem(NamedTuple):
    """One thing wrong with a field: where, what, and OpenAI's code for that kind of problem."""

    field: str
    message: str
    code: str = INVALID_VALUE


def wrong_kind(where: str, value: Any, message: str) -> FieldProblem:
    """A field of the wrong kind: a missing one (``None``) is a missing parameter."""
    return FieldProblem(where, message, MISSING_PARAMETER if value is None else INVALID_TYPE)


# How a kind of JSON value is named in a message.
KIND_WORDS = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    list: "a list",
    dict: "an object",
}


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
