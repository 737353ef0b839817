"""The check of constrained answers after generation (anex_pipeline.engine.structured), pure."""

from __future__ import annotations

from typing import Any

import pytest

from anex_pipeline.engine.structured import answer_problem, mark_completion
from anex_pipeline.errors import RowErrorType
from anex_pipeline.spec import RowError, RowOutcome

JSON_OBJECT = {"type": "json_object"}
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "a",
        "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
    },
}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (None, "the answer is empty"),
        ("", "not a JSON object"),
        ('```json\n{"n": 1}\n```', "not a JSON object"),
        ('{"n": 1} and more', "not a JSON object"),
        ("[1, 2]", "not an object (a list)"),
        ("3", "not an object (a int)"),
    ],
)
def test_only_exactly_one_json_object_passes(text: str | None, says: str) -> None:
    problem = answer_problem(text, JSON_OBJECT)
    assert problem is not None and says in problem


def test_json_object_takes_any_object_and_json_schema_checks_the_schema() -> None:
    assert answer_problem('{"anything": true}', JSON_OBJECT) is None
    assert answer_problem('{"n": 3}', SCHEMA) is None
    missing = answer_problem('{"m": 3}', SCHEMA)
    assert missing is not None and "at (root)" in missing and "'n' is a required property" in missing
    wrong = answer_problem('{"n": "three"}', SCHEMA)
    assert wrong is not None and "at n:" in wrong


def test_an_unusable_schema_passes_nothing() -> None:
    broken = {"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}}
    problem = answer_problem('{"n": 1}', broken)
    assert problem is not None and problem.startswith("the schema cannot be used for validation")


def chat_outcome(*choices: dict[str, Any]) -> RowOutcome:
    body = {"choices": [{"index": i, **c} for i, c in enumerate(choices)]}
    return RowOutcome(0, "k", 200, body=body, usage={})


def answer(content: str, finish: str = "stop") -> dict[str, Any]:
    return {"message": {"role": "assistant", "content": content}, "finish_reason": finish}


def test_a_cut_answer_is_length_and_a_failing_one_format_error() -> None:
    ok = mark_completion(chat_outcome(answer('{"n": 1}')), SCHEMA, "chat")
    assert not ok.format_error and ok.completion_flag is None
    bad = mark_completion(chat_outcome(answer('{"n": 1}'), answer("nope")), SCHEMA, "chat")
    assert bad.format_error and bad.completion_flag is RowErrorType.FORMAT
    cut = mark_completion(chat_outcome(answer('{"n": ', "length")), SCHEMA, "chat")
    assert cut.format_error and cut.completion_flag is RowErrorType.LENGTH  # both, marked length
    plain_cut = mark_completion(chat_outcome(answer("once upon", "length")), None, "chat")
    assert not plain_cut.format_error and plain_cut.completion_flag is RowErrorType.LENGTH


def test_a_choice_that_called_tools_is_judged_by_its_calls_and_completions_by_their_text() -> None:
    called = {"message": {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}, "finish_reason": "stop"}
    assert not mark_completion(chat_outcome(called), JSON_OBJECT, "chat").format_error
    body = {"choices": [{"index": 0, "text": "not json", "finish_reason": "stop"}]}
    completion = mark_completion(RowOutcome(0, "k", 200, body=body, usage={}), JSON_OBJECT, "completions")
    assert completion.format_error and completion.completion_flag is RowErrorType.FORMAT


def test_failed_rows_and_embeddings_are_left_as_they_are() -> None:
    failed = RowOutcome(0, "k", 400, error=RowError("no", RowErrorType.INVALID_REQUEST))
    assert mark_completion(failed, JSON_OBJECT, "chat") is failed and not failed.format_error
    embedded = RowOutcome(0, "k", 200, body={"data": []}, usage={})
    assert mark_completion(embedded, JSON_OBJECT, "embeddings").completion_flag is None
