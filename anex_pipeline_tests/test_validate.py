"""The submit-time checks of one request body (anex_pipeline.validate), called directly: each
problem names its field, says what to change and carries OpenAI's code."""

from __future__ import annotations

from typing import Any

import pytest

from anex_pipeline.spec import INVALID_TYPE, INVALID_VALUE, MISSING_PARAMETER, UNKNOWN_PARAMETER
from anex_pipeline.validate import check_body
from anex_pipeline.validate.answers import check_response_format
from anex_pipeline.validate.inputs import check_prompt_shape
from anex_pipeline.validate.numbers import check_numbers, deeper_than
from anex_pipeline.validate.problems import FieldProblem, pydantic_code

MODELS = frozenset({"m"})
HELLO = [{"role": "user", "content": "hello"}]


def chat(**body: Any) -> list[FieldProblem]:
    return check_body({"messages": HELLO, **body}, "chat", MODELS)


def fields(problems: list[FieldProblem]) -> list[str]:
    return [p.field for p in problems]


def test_a_plain_chat_row_and_its_usual_fields_pass() -> None:
    assert chat(model="m", temperature=0.7, top_p=1, max_tokens=16, seed=-1, stop=["\n"], user="u") == []


def test_the_body_must_be_an_object_and_name_the_jobs_model() -> None:
    assert check_body(["x"], "chat", MODELS) == [
        FieldProblem("body", "must be an object with the request, got a list", INVALID_TYPE)
    ]
    (other,) = chat(model="gpt-4o-mini")
    assert other.field == "body.model" and "this job runs 'm'" in other.message
    (kind,) = chat(model=3)
    assert kind.code == INVALID_TYPE


def test_an_unknown_field_gets_the_nearest_name_and_its_code() -> None:
    (problem,) = chat(temprature=0.5)
    assert problem == FieldProblem("body.temprature", "unknown field; did you mean 'temperature'?", UNKNOWN_PARAMETER)


@pytest.mark.parametrize(
    ("body", "field", "code"),
    [
        ({"temperature": "hot"}, "body.temperature", INVALID_TYPE),
        ({"temperature": 3}, "body.temperature", INVALID_VALUE),
        ({"top_p": 0}, "body.top_p", INVALID_VALUE),
        ({"max_tokens": 0}, "body.max_tokens", INVALID_VALUE),
        ({"max_tokens": True}, "body.max_tokens", INVALID_TYPE),
        ({"n": 129}, "body.n", INVALID_VALUE),
        ({"stream": True}, "body.stream", INVALID_VALUE),
        ({"reasoning_effort": "huge"}, "body.reasoning_effort", INVALID_VALUE),
        ({"chat_template_kwargs": []}, "body.chat_template_kwargs", INVALID_TYPE),
        ({"bad_words": [1]}, "body.bad_words", INVALID_TYPE),
        ({"allowed_token_ids": [-1]}, "body.allowed_token_ids", INVALID_TYPE),
    ],
)
def test_a_wrong_value_is_one_problem_naming_its_field(body: dict[str, Any], field: str, code: str) -> None:
    problems = chat(**body)
    assert fields(problems) == [field], problems
    assert problems[0].code == code


def test_chat_rows_need_messages() -> None:
    (missing,) = check_body({}, "chat", MODELS)
    assert missing.field == "body.messages" and missing.code == MISSING_PARAMETER
    (wrong,) = check_body({"messages": "hi"}, "chat", MODELS)
    assert wrong.code == INVALID_TYPE


def test_non_finite_numbers_and_out_of_range_integers_are_named() -> None:
    problems = check_numbers({"temperature": float("inf"), "seed": 2**63, "top_k": -2, "name": 1e999}, "body.")
    assert fields(problems) == ["body.temperature", "body.seed", "body.top_k"]  # only number fields
    assert "not a finite number" in problems[0].message
    assert "outside the range the engine takes" in problems[1].message


@pytest.mark.parametrize(
    ("bias", "field"),
    [({"12": 101}, "body.logit_bias.12"), ({"x": 1}, "body.logit_bias.x"), ([1], "body.logit_bias")],
)
def test_logit_bias_maps_token_ids_to_biases_within_100(bias: Any, field: str) -> None:
    assert fields(check_numbers({"logit_bias": bias}, "body.")) == [field]
    assert check_numbers({"logit_bias": {"12": -100, "7": 0.5}}, "body.") == []


@pytest.mark.parametrize(
    ("rf", "field"),
    [
        ("json", "rf"),
        ({"type": "yaml"}, "rf.type"),
        ({"type": "json_object", "json_schema": {}}, "rf.json_schema"),
        ({"type": "json_schema"}, "rf.json_schema"),
        ({"type": "json_schema", "json_schema": {"type": "object"}}, "rf.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": 1, "schema": {}}}, "rf.json_schema.name"),
    ],
)
def test_response_format_shapes(rf: Any, field: str) -> None:
    assert fields(check_response_format(rf, "rf")) == [field]


def test_a_good_response_format_passes() -> None:
    assert check_response_format({"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}, "rf") == []
    assert check_response_format({"type": "text"}, "rf") == []


@pytest.mark.parametrize(
    ("value", "field", "says"),
    [
        ("", "p", "empty string"),
        ([], "p", "must be a string"),
        (["a", [1]], "p[1]", "use one shape"),
        (["a", ""], "p[1]", "empty string"),
        ([0, 2**31], "p[1]", "not a token id"),
        (list(range(8193)), "p", "at most 8192"),
        (["a"] * 3, "p", "at most 2 go in one row"),
        ([{"text": "a"}], "p[0]", "must be a string or a non-empty list of token ids"),
    ],
)
def test_prompt_shapes_refused(value: Any, field: str, says: str) -> None:
    (problem,) = check_prompt_shape(value, "p", 2, "embed")
    assert problem.field == field and says in problem.message


@pytest.mark.parametrize("value", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_the_four_prompt_shapes_pass(value: Any) -> None:
    assert check_prompt_shape(value, "p", 2, "embed") == []


def test_depth_counts_the_outer_value_as_the_first_level_without_recursion() -> None:
    assert not deeper_than([[1]], 2)
    assert deeper_than([[[1]]], 2)
    assert not deeper_than("flat", 0)
    very_deep: Any = []
    for _ in range(100_000):  # deeper than Python's recursion limit
        very_deep = [very_deep]
    assert deeper_than(very_deep, 100)


@pytest.mark.parametrize(
    ("error_type", "code"),
    [
        ("missing", MISSING_PARAMETER),
        ("extra_forbidden", UNKNOWN_PARAMETER),
        ("int_parsing", INVALID_TYPE),
        ("string_type", INVALID_TYPE),
        ("greater_than", INVALID_VALUE),
    ],
)
def test_pydantic_error_types_map_to_openais_codes(error_type: str, code: str) -> None:
    assert pydantic_code(error_type) == code


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image", "image": "https://example.com/a.png"},  # Ray Data's spelling
        {"type": "input_image", "image_url": "https://example.com/a.png"},  # the Responses API's, not chat's
        {"type": "image_pil", "image_pil": "x"},
        {"type": "file", "file": {"file_id": "f"}},
    ],
)
def test_a_content_part_of_a_type_chat_rows_do_not_take_is_refused_at_submit(part: dict[str, Any]) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]}
    found = check_body(body, "chat", frozenset({"m"}))
    assert [p.field for p in found] == ["body.messages[0].content[1].type"]
    assert "image_url" in found[0].message and part["type"] in found[0].message
