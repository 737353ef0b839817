"""The generation fields a row may carry reach the engine: the in-process engine's
``SamplingParams`` and chat-template arguments, and the HTTP engine's request body."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from anex_pipeline.engine.base import EngineRequest, resolve_request
from anex_pipeline.engine.config import EngineConfig
from anex_pipeline.engine.http.engine import request_body
from anex_pipeline.engine.loader import schedules_by_priority
from anex_pipeline.engine.parsing import OutputParser, ParserNames
from anex_pipeline.engine.structured import mark_completion
from anex_pipeline.engine.vllm.prompts import PromptRenderer, RequestProblem, TextPrompts
from anex_pipeline.engine.vllm.sampling import Sampler
from anex_pipeline.engine.vllm.stepping import Stepper
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
from anex_pipeline.validate import EngineTraits, check_body
from anex_pipeline_tests.harness.jobs import REPO, chat_row, write_jsonl

MESSAGES = [{"role": "user", "content": "hi"}]
ASSISTANT_LAST = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
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
    "prompt_logprobs": (3, "prompt_logprobs", 3),
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
    "add_generation_prompt",  # the template's arguments (below)
    "continue_final_message",
    "mm_processor_kwargs",  # the multimodal processor's arguments, on a media row
    "truncate_prompt_tokens",  # the prompt's tokens (below)
    "priority",  # the scheduler's order (below)
    "stream",  # refused when true
    "stream_options",
    "user",  # OpenAI's envelope: no bearing on the answer
    "metadata",
    "store",
    "service_tier",
}


def local_sampler() -> Sampler:
    """The in-process engine's sampling parameters, without a loaded model."""
    return Sampler(
        max_model_len=2048,
        defaults={},
        keep_special_tokens=False,
        thinking=None,
        parser=OutputParser(None, ParserNames()),
    )


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


def test_the_template_ends_with_a_new_turn_or_continues_the_last_message_on_both_engines() -> None:
    assert resolved(CHAT).template_arguments == {"add_generation_prompt": True, "continue_final_message": False}
    req = resolved(CHAT, messages=ASSISTANT_LAST, continue_final_message=True)
    assert req.template_arguments == {"add_generation_prompt": False, "continue_final_message": True}
    assert request_body(req, "m")["continue_final_message"] is True  # sent as it is
    bare = resolved(CHAT, add_generation_prompt=False, chat_template_kwargs={"x": 1})
    assert bare.template_arguments == {"add_generation_prompt": False, "continue_final_message": False, "x": 1}
    assert request_body(bare, "m")["add_generation_prompt"] is False


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ({"messages": MESSAGES, "continue_final_message": True}, "body.messages[0].role", "must be 'assistant'"),
        (
            {"messages": ASSISTANT_LAST, "continue_final_message": True, "add_generation_prompt": True},
            "body.continue_final_message",
            "cannot be true together with add_generation_prompt",
        ),
        ({"messages": MESSAGES, "prompt_logprobs": 21}, "body.prompt_logprobs", "outside the range"),
        ({"messages": MESSAGES, "truncate_prompt_tokens": -2}, "body.truncate_prompt_tokens", "outside the range"),
        ({"messages": MESSAGES, "priority": 1.5}, "body.priority", "integer"),
        ({"messages": MESSAGES, "mm_processor_kwargs": []}, "body.mm_processor_kwargs", "object"),
        ({"prompt": "x", "continue_final_message": True}, "body.continue_final_message", "only of chat"),
    ],
)
def test_vllms_extras_are_refused_at_submit_with_their_field(body: dict[str, Any], field: str, says: str) -> None:
    endpoint = COMPLETIONS if "prompt" in body else CHAT
    problems = check_body(body, endpoint, frozenset({"m"}))  # type: ignore[arg-type]
    assert [p.field for p in problems] == [field] and says in problems[0].message, problems


def renderer(side: str | None, context: int = 8) -> TextPrompts:
    """The in-process engine's text rendering over a tokenizer that truncates on ``side``."""
    return TextPrompts(SimpleNamespace(truncation_side=side), "m", context)


def test_truncate_prompt_tokens_cuts_the_prompt_the_in_process_engine_sends() -> None:
    ids = list(range(10))
    cut = resolved(COMPLETIONS, truncate_prompt_tokens=3)
    assert renderer("left")._truncated(cut, ids) == [7, 8, 9]  # the last tokens, as vLLM keeps them
    assert renderer("right")._truncated(cut, ids) == [0, 1, 2]
    assert renderer("left")._truncated(resolved(COMPLETIONS, truncate_prompt_tokens=-1), ids) == ids[2:]
    assert renderer("left")._truncated(resolved(COMPLETIONS), ids) == ids
    with pytest.raises(RequestProblem) as refused:
        renderer("left")._truncated(resolved(COMPLETIONS, truncate_prompt_tokens=9), ids)
    assert refused.value.param == "truncate_prompt_tokens" and "at most 8" in refused.value.message
    assert request_body(cut, "m")["truncate_prompt_tokens"] == 3


def test_mm_processor_kwargs_reach_the_multimodal_processor_with_the_templates_arguments() -> None:
    """A media row on a multimodal model goes through vLLM's chat renderer: the row's processor
    arguments and template arguments are what it is handed."""
    seen: list[Any] = []

    def render_chat(conversations: list[Any], params: Any) -> tuple[None, list[dict[str, Any]]]:
        seen.append(params)
        return None, [{"prompt_token_ids": [1, 2, 3]}]

    found = object.__new__(PromptRenderer)
    found.llm = SimpleNamespace(renderer=SimpleNamespace(render_chat=render_chat))
    found.multimodal, found.modalities, found.audio_rate = True, frozenset({"image"}), None
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]
    size = {"size": {"longest_edge": 64}}
    req = resolved(CHAT, messages=messages, mm_processor_kwargs=size, add_generation_prompt=False)
    assert found.prompt(req)[1] == [1, 2, 3]
    (params,) = seen
    assert params.mm_processor_kwargs == size
    assert params.chat_template_kwargs["add_generation_prompt"] is False
    assert request_body(req, "m")["mm_processor_kwargs"] == size


def stepping(policy: str) -> Stepper:
    loop = object.__new__(Stepper)
    config = SimpleNamespace(scheduler_config=SimpleNamespace(policy=policy))
    loop.llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config))
    return loop


def test_priority_reaches_a_priority_scheduled_engine_and_is_refused_by_another() -> None:
    req = resolved(CHAT, priority=-3)
    assert stepping("priority")._priority(req) == -3
    assert stepping("fcfs")._priority(resolved(CHAT)) == 0
    assert stepping("fcfs")._priority(resolved(CHAT, priority=0)) == 0
    with pytest.raises(RequestProblem) as refused:
        stepping("fcfs")._priority(req)
    assert refused.value.param == "priority" and "scheduling_policy=priority" in refused.value.message
    assert request_body(req, "m")["priority"] == -3


def test_priority_is_refused_at_submit_on_an_engine_that_does_not_schedule_by_it() -> None:
    body = {"messages": MESSAGES, "priority": 5}
    (problem,) = check_body(body, "chat", frozenset(), EngineTraits(priority=False))
    assert problem.field == "body.priority" and "scheduling_policy=priority" in problem.message
    assert check_body(body, "chat", frozenset(), EngineTraits(priority=True)) == []
    assert check_body(body, "chat", frozenset(), EngineTraits(priority=None)) == []  # a model server decides
    assert check_body({**body, "priority": 0}, "chat", frozenset(), EngineTraits(priority=False)) == []
    assert schedules_by_priority(EngineConfig(engine_args={})) is False
    assert schedules_by_priority(EngineConfig(engine_args={"scheduling_policy": "priority"})) is True
    assert schedules_by_priority(EngineConfig(base_url="http://127.0.0.1:9")) is None


@pytest.mark.subprocess
def test_the_command_refuses_a_priority_row_before_its_engine_loads(tmp_path: Path) -> None:
    rows = [chat_row("plain", "Hi"), chat_row("urgent", "Hi", priority=-1)]
    src, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "ANEX_WORK_DIR": str(tmp_path / "work")}
    argv = [sys.executable, "-m", "anex_pipeline.cli", "run", str(src), "-o", str(out)]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "line 2" in done.stderr and "body.priority" in done.stderr, done.stderr
    assert "--engine-arg scheduling_policy=priority" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists() and "loading" not in done.stderr


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
