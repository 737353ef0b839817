"""The generation fields a row may carry reach the engine: the in-process engine's
``SamplingParams`` and chat-template arguments, and the HTTP engine's request body."""

from __future__ import annotations

from typing import Any

import pytest

from anex_pipeline.engine.base import EngineRequest, resolve_request
from anex_pipeline.engine.http.engine import request_body
from anex_pipeline.engine.structured import mark_completion
from anex_pipeline.engine.vllm.sampling import Sampler
from anex_pipeline.errors import RowErrorType
from anex_pipeline.request_fields import (
    ALL,
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    NON_SAMPLING_FIELDS,
    PROMPT_FIELDS,
    RESPONSES,
    SAMPLING_FIELDS,
    BodyField,
    fields_of,
    unknown_field,
)
from anex_pipeline.spec import InputRow, JobOptions, RowOutcome
from anex_pipeline.validate import check_body

MESSAGES = [{"role": "user", "content": "hi"}]
# A value for each field that goes to the sampler, and the SamplingParams attribute and value it
# must give there (the attribute is the field's name unless given).
SAMPLED: dict[str, tuple[Any, str, Any]] = {
    "temperature": (0.5, "temperature", 0.5),
    "top_p": (0.9, "top_p", 0.9),
    "top_k": (5, "top_k", 5),
    "min_p": (0.1, "min_p", 0.1),
    "seed": (11, "seed", 11),
    "stop": (["END"], "stop", ["END"]),
    "stop_token_ids": ([7], "stop_token_ids", [7]),
    "presence_penalty": (0.5, "presence_penalty", 0.5),
    "frequency_penalty": (0.5, "frequency_penalty", 0.5),
    "repetition_penalty": (1.2, "repetition_penalty", 1.2),
    "min_tokens": (2, "min_tokens", 2),
    "ignore_eos": (True, "ignore_eos", True),
    "include_stop_str_in_output": (True, "include_stop_str_in_output", True),
    "skip_special_tokens": (False, "skip_special_tokens", False),
    "logit_bias": ({"5": 1.0}, "logit_bias", {5: 1.0}),
    "bad_words": (["zebra"], "bad_words", ["zebra"]),
    "allowed_token_ids": ([5, 6, 7], "allowed_token_ids", [5, 6, 7]),
    "max_tokens": (9, "max_tokens", 9),
    "max_completion_tokens": (8, "max_tokens", 8),
    "n": (3, "n", 3),
}
# Fields whose effect is elsewhere than in a SamplingParams attribute of the same meaning.
APPLIED_ELSEWHERE = {
    "model",  # the job's model (checked at submit)
    "messages",  # the prompt
    "prompt",
    "response_format",  # structured outputs (test_engine_chat_structured.py)
    "thinking_token_budget",  # the thinking budget, on a model that thinks (test_engine_thinking.py)
    "tools",  # the chat template and the tool parser
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",  # the chat template's arguments (below)
    "reasoning_effort",
    "stream",  # refused when true
    "stream_options",
    "user",  # OpenAI's envelope: no bearing on the answer
    "metadata",
    "store",
    "service_tier",
}


def local_sampler() -> Sampler:
    """The in-process engine's sampling parameters, without a loaded model."""
    return Sampler(max_model_len=2048, defaults={}, keep_special_tokens=False, thinking=None)


def resolved(endpoint: str, **fields: Any) -> EngineRequest:
    body = {"messages": MESSAGES} if endpoint == CHAT else {"prompt": "Once"}
    body.update(fields)
    assert check_body(body, endpoint, frozenset({"m"})) == []  # type: ignore[arg-type]
    return resolve_request(InputRow(0, "r", body), "job", endpoint, JobOptions(), None, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_every_accepted_generation_field_reaches_both_engines(endpoint: str) -> None:
    sampler = local_sampler()
    logprobs = {"logprobs": True, "top_logprobs": 4} if endpoint == CHAT else {"logprobs": 4}
    accepted = set(fields_of(endpoint))
    # every field is either shown here to reach the sampler, or says where else it acts
    assert accepted <= set(SAMPLED) | APPLIED_ELSEWHERE | {"logprobs", "top_logprobs", "structured_outputs"}
    for name in sorted(accepted & set(SAMPLED)):
        value, attribute, expected = SAMPLED[name]
        extra = {"temperature": 0.7} if name == "n" else {}
        req = resolved(endpoint, **{name: value}, **extra)
        params = sampler.params(req, prompt_len=5)
        assert getattr(params, attribute) == expected, name
        sent = request_body(req, "m")
        assert sent["max_tokens" if attribute == "max_tokens" else name] == value, name
    req = resolved(endpoint, **logprobs)
    assert sampler.params(req, prompt_len=5).logprobs == 4
    assert {k: request_body(req, "m")[k] for k in logprobs} == logprobs
    req = resolved(endpoint, structured_outputs={"choice": ["yes", "no"]})
    assert sampler.params(req, prompt_len=5).structured_outputs.choice == ["yes", "no"]
    assert request_body(req, "m")["structured_outputs"] == {"choice": ["yes", "no"]}


def test_chat_reasoning_effort_is_the_templates_argument_on_both_engines() -> None:
    """As vLLM's server renders it: the effort goes to the template, and so does thinking on,
    unless the effort is "none" or the row's own template arguments say otherwise."""
    req = resolved(CHAT, reasoning_effort="low")
    assert req.chat_template_kwargs == {"reasoning_effort": "low", "enable_thinking": True}
    assert request_body(req, "m")["chat_template_kwargs"] == req.chat_template_kwargs
    assert resolved(CHAT, reasoning_effort="none").chat_template_kwargs["enable_thinking"] is False
    own = resolved(CHAT, reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    assert own.chat_template_kwargs == {"reasoning_effort": "high", "enable_thinking": False}
    problems = check_body({"messages": MESSAGES, "reasoning_effort": "huge"}, "chat", frozenset())
    assert [(p.field, "low" in p.message) for p in problems] == [("body.reasoning_effort", True)]


def choice(text: str, finish: str = "stop") -> dict[str, Any]:
    return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}


@pytest.mark.parametrize(
    ("choices", "flag"),
    [
        ([choice('{"a": 1}'), choice('{"b": 2}')], None),
        ([choice('{"a": 1}'), choice("not json")], RowErrorType.FORMAT),
        ([choice('{"a": 1}'), choice('{"a"', "length")], RowErrorType.LENGTH),
    ],
)
def test_every_choice_is_checked_against_the_format(choices: list[dict[str, Any]], flag: RowErrorType | None) -> None:
    outcome = RowOutcome(0, "r", 200, body={"choices": choices})
    marked = mark_completion(outcome, {"type": "json_object"}, "chat")
    assert marked.completion_flag == flag
    assert marked.format_error is (flag is not None)


# -- the table itself ---------------------------------------------------------------------------


def test_each_endpoint_takes_its_own_fields() -> None:
    assert "messages" in fields_of(CHAT) and "messages" not in fields_of(COMPLETIONS)
    assert "prompt" in fields_of(COMPLETIONS) and "dimensions" in fields_of(EMBEDDINGS)
    assert "max_output_tokens" in fields_of(RESPONSES) and "max_tokens" not in fields_of(RESPONSES)
    assert set(PROMPT_FIELDS) == ALL
    assert SAMPLING_FIELDS.isdisjoint(NON_SAMPLING_FIELDS) and "temperature" in SAMPLING_FIELDS


@pytest.mark.parametrize(
    ("spec", "value", "says"),
    [
        (BodyField((float,), low=0, high=2), 2.5, "is 2.5; it must be at least 0 and at most 2"),
        (BodyField((float,), low=0, high=1, low_open=True), 0, "is 0; it must be above 0 and at most 1"),
        (BodyField((float,), low=0, low_open=True), -1, "is -1; it must be above 0"),
        (BodyField((float,), high=2), 3, "is 3; it must be at most 2"),
    ],
)
def test_a_number_out_of_its_range_says_the_range(spec: BodyField, value: float, says: str) -> None:
    assert spec.out_of_range(value) == says


def test_numbers_at_the_closed_ends_of_a_range_pass() -> None:
    spec = BodyField((float,), low=0, high=1, low_open=True)
    assert spec.out_of_range(1) is None and spec.out_of_range(0.001) is None
    assert BodyField((float,)).out_of_range(-1e9) is None  # no range: anything finite


def test_an_unknown_field_gets_the_nearest_name_or_where_it_belongs() -> None:
    assert unknown_field("temprature", CHAT) == "unknown field; did you mean 'temperature'?"
    assert unknown_field("zzzzzz", CHAT) == "unknown field; remove it"
    elsewhere = unknown_field("dimensions", CHAT)
    assert elsewhere.startswith("is not a field of chat requests (only of embeddings ones)")
    # a responses row names chat's fields otherwise: the hint is the responses name
    assert unknown_field("max_tokens", RESPONSES).endswith("did you mean 'max_output_tokens'?")
