"""Thinking and tool-call parsing without an engine: which of vLLM's parsers a
model gets, how each family's exact output shapes split into answer, reasoning and tool calls,
how thinking tokens are counted, and how the thinking budget is estimated from a sample."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion

from anex_pipeline.engine.base import Engine, EngineRequest
from anex_pipeline.engine.completions import Generated, chat_completion
from anex_pipeline.engine.parsing import (
    BUDGET_NOTICE,
    FAMILIES,
    OutputParser,
    Parsed,
    ParserChoiceError,
    ParserNames,
    budget_cut,
    check_parser_names,
    choose_parsers,
    count_thinking_tokens,
    implicit_end,
    thinking_tags,
)
from anex_pipeline.engine.thinking import ThinkingIds
from anex_pipeline.spec import JobOptions, RowOutcome
from anex_pipeline.stages.estimate import estimate_lengths
from anex_pipeline.stages.estimate_length_bound import upper_bound
from anex_pipeline.stages.submit import prepare_job
from anex_pipeline.workdir.outputs import reusable_samples
from anex_pipeline_tests.harness.jobs import chat_row, write_jsonl
from anex_pipeline_tests.harness.tiny_models import build_tokenizer, write_config

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
BODY = {"messages": [{"role": "user", "content": "Weather in London?"}], "tools": [WEATHER_TOOL]}


# -- choosing parsers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "config", "expected"),
    [
        ("deepseek-ai/DeepSeek-R1", {"model_type": "deepseek_v3"}, ("deepseek_r1", "deepseek_v3")),
        ("deepseek-ai/DeepSeek-V3", {"model_type": "deepseek_v3"}, (None, None)),  # does not think
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", {"model_type": "qwen2"}, ("deepseek_r1", None)),
        ("openai/gpt-oss-120b", {"model_type": "gpt_oss"}, ("openai_gptoss", "openai")),
        (
            "my-org/finetune",
            {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]},
            ("openai_gptoss", "openai"),
        ),
        ("moonshotai/Kimi-K2-Thinking", {"model_type": "kimi_k2"}, ("kimi_k2", "kimi_k2")),
        ("my-org/k2-copy", {"model_type": "kimi_k2"}, ("kimi_k2", "kimi_k2")),
        ("zai-org/GLM-4.5", {"model_type": "glm4_moe"}, ("glm45", "glm45")),
        ("zai-org/GLM-4.7", {"model_type": "glm4_moe"}, ("glm47", "glm47")),
        ("zai-org/GLM-5", {"model_type": "glm_moe_dsa"}, ("glm47", "glm47")),
        ("MiniMaxAI/MiniMax-M2.5", {"model_type": "minimax_m2"}, ("minimax_m2", "minimax_m2")),
        ("Qwen/Qwen3-8B", {"model_type": "qwen3"}, ("qwen3", "hermes")),
        ("my-org/moe", {"architectures": ["Qwen3MoeForCausalLM"]}, ("qwen3", "hermes")),
        ("Qwen/Qwen3-Coder-30B-A3B-Instruct", {"model_type": "qwen3_moe"}, (None, "qwen3_coder")),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", {"model_type": "llama"}, (None, None)),
    ],
)
def test_parsers_follow_the_model_family(tmp_path: Path, name: str, config: dict[str, Any], expected: tuple) -> None:
    folder = write_config(tmp_path / "model", **config)
    assert choose_parsers(str(folder), name, JobOptions()) == ParserNames(*expected)


def test_a_local_folder_is_recognised_by_its_config_alone(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "checkpoint-500", model_type="minimax_m2")
    assert choose_parsers(str(folder), str(folder), JobOptions()) == ParserNames("minimax_m2", "minimax_m2")


def test_every_family_names_parsers_vllm_has() -> None:
    for family in FAMILIES:
        check_parser_names(family.reasoning, family.tool)  # raises if vLLM renamed one


def test_job_options_name_the_parsers(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "m", model_type="qwen3")
    options = JobOptions(reasoning_parser="deepseek_r1", tool_parser="qwen3_xml")
    assert choose_parsers(str(folder), "Qwen/Qwen3-8B", options) == ParserNames("deepseek_r1", "qwen3_xml")
    # A model with no family gets parsers only by name.
    plain = write_config(tmp_path / "p", model_type="llama")
    assert choose_parsers(str(plain), "x", JobOptions(reasoning_parser="qwen3")) == ParserNames("qwen3", None)


def test_an_unknown_parser_name_lists_the_valid_ones(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "m", model_type="qwen3")
    with pytest.raises(ParserChoiceError) as caught:
        choose_parsers(str(folder), "Qwen/Qwen3-8B", JobOptions(reasoning_parser="deepseek", tool_parser="json"))
    message = str(caught.value)
    assert "reasoning_parser 'deepseek'" in message and "tool_parser 'json'" in message
    assert "deepseek_r1" in message and "qwen3" in message and "hermes" in message


def test_parsing_asked_for_a_model_without_a_parser_is_an_error(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "m", model_type="llama")
    with pytest.raises(ParserChoiceError, match=r"parse_thinking is on .* reasoning_parser option"):
        choose_parsers(str(folder), "my-llama", JobOptions(parse_thinking=True))
    with pytest.raises(ParserChoiceError, match=r"parse_tool_calls is on .* tool_parser option"):
        choose_parsers(str(folder), "my-llama", JobOptions(parse_tool_calls=True))
    assert choose_parsers(str(folder), "my-llama", JobOptions(parse_thinking=False)) == ParserNames()


def test_a_hub_id_without_a_local_config_goes_by_its_name() -> None:
    assert choose_parsers("deepseek-ai/DeepSeek-R1", "deepseek-ai/DeepSeek-R1", JobOptions()) == ParserNames(
        "deepseek_r1", "deepseek_v3"
    )


# -- parsing each family's output ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm.tokenizers import get_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(folder)
    return get_tokenizer(str(folder))


def parse(
    tokenizer: Any,
    names: tuple[str | None, str | None],
    text: str,
    *,
    body: dict[str, Any] = BODY,
    kwargs: dict[str, Any] | None = None,
    ids: Sequence[int] | None = None,
    harmony: bool = False,
    **switches: bool,
) -> Parsed:
    parser = OutputParser(tokenizer, ParserNames(*names), harmony=harmony)
    output_ids = tokenizer.encode(text, add_special_tokens=False) if ids is None else ids
    return parser.parse(text, output_ids, [], body, kwargs or {}, **switches)


def assert_weather_call(parsed: Parsed, **arguments: Any) -> None:
    assert len(parsed.tool_calls) == 1
    call = parsed.tool_calls[0]
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(call["function"]["arguments"], str)
    assert json.loads(call["function"]["arguments"]) == arguments


def test_deepseek_r1(tokenizer: Any) -> None:
    names = ("deepseek_r1", "deepseek_v3")
    text = "<think>Let me reason step by step...</think>The answer is 42."
    assert parse(tokenizer, names, text) == Parsed("The answer is 42.", "Let me reason step by step...")
    # R1's template opens <think> in the prompt, so its output often starts inside the trace.
    assert parse(tokenizer, names, "Hmm.</think>The answer is 42.") == Parsed("The answer is 42.", "Hmm.")
    call = (
        "Hmm.</think>Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "London"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    parsed = parse(tokenizer, names, call)
    assert parsed.content == "Let me check." and parsed.reasoning == "Hmm."
    assert_weather_call(parsed, city="London")


def test_deepseek_v31_tool_call_shape(tokenizer: Any) -> None:
    text = (
        "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "London", "days": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    parsed = parse(tokenizer, (None, "deepseek_v31"), text)
    assert parsed.content == "Let me check." and parsed.reasoning is None
    assert_weather_call(parsed, city="London", days=2)


def test_gpt_oss_harmony_channels(tokenizer: Any) -> None:
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    names = ("openai_gptoss", "openai")
    answer = (
        "<|channel|>analysis<|message|>Let me think.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>The answer is 42.<|return|>"
    )
    ids = encoding.encode(answer, allowed_special="all")
    assert parse(tokenizer, names, answer, ids=ids, harmony=True) == Parsed("The answer is 42.", "Let me think.")
    call = (
        "<|channel|>analysis<|message|>I need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "London"}<|call|>'
    )
    parsed = parse(tokenizer, names, call, ids=encoding.encode(call, allowed_special="all"), harmony=True)
    assert parsed.content is None and parsed.reasoning == "I need the weather."
    assert_weather_call(parsed, city="London")
    # Off: the raw channels, as decoded.
    raw = parse(tokenizer, names, answer, ids=ids, harmony=True, thinking=False, tools=False)
    assert raw == Parsed(answer)


def test_kimi_k2(tokenizer: Any) -> None:
    names = ("kimi_k2", "kimi_k2")
    assert parse(tokenizer, names, "<think>Hmm.</think>The answer is 42.") == Parsed("The answer is 42.", "Hmm.")
    text = (
        "<think>Hmm.</think>Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "London"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    parsed = parse(tokenizer, names, text)
    assert parsed.content == "Let me check." and parsed.reasoning == "Hmm."
    assert_weather_call(parsed, city="London")
    assert parsed.tool_calls[0]["id"] == "functions.get_weather:0"  # Kimi's own call ids are kept


@pytest.mark.parametrize("names", [("glm45", "glm45"), ("glm47", "glm47")])
def test_glm(tokenizer: Any, names: tuple[str, str]) -> None:
    assert parse(tokenizer, names, "<think>Hmm.</think>The answer is 42.") == Parsed("The answer is 42.", "Hmm.")
    text = (
        "<think>Hmm.</think>Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>London</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    )
    parsed = parse(tokenizer, names, text)
    assert parsed.content == "Let me check." and parsed.reasoning == "Hmm."
    assert_weather_call(parsed, city="London", days=3)  # typed by the tool's schema


def test_minimax_m2(tokenizer: Any) -> None:
    names = ("minimax_m2", "minimax_m2")
    text = (
        '<think>Hmm.</think>Let me check.<minimax:tool_call><invoke name="get_weather">'
        '<parameter name="city">London</parameter><parameter name="days">3</parameter></invoke></minimax:tool_call>'
    )
    parsed = parse(tokenizer, names, text)
    assert parsed.content == "Let me check." and parsed.reasoning == "Hmm."
    assert_weather_call(parsed, city="London", days=3)


def test_qwen3(tokenizer: Any) -> None:
    names = ("qwen3", "hermes")
    thought = parse(tokenizer, names, "<think>\nLet me reason.\n</think>\n\nThe answer is 42.")
    assert thought.reasoning is not None and thought.reasoning.strip() == "Let me reason."
    assert thought.content is not None and thought.content.strip() == "The answer is 42."
    # Thinking switched off in the template: the answer is all content.
    quiet = parse(tokenizer, names, "The answer is 42.", kwargs={"enable_thinking": False})
    assert quiet == Parsed("The answer is 42.")
    text = (
        '<think>\nHmm.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "London"}}\n</tool_call>'
    )
    parsed = parse(tokenizer, names, text)
    assert parsed.content is None and parsed.reasoning is not None and parsed.reasoning.strip() == "Hmm."
    assert_weather_call(parsed, city="London")


def test_a_forced_call_is_held_and_read_in_the_models_own_format(tokenizer: Any) -> None:
    """As vLLM's server: hermes holds a forced call to its ``<tool_call>`` tags (which a thinking
    trace may open) and reads it back with its parser; a model without a tool parser gets the JSON."""
    named = {**BODY, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    required = {**BODY, "tool_choice": "required"}
    hermes = OutputParser(tokenizer, ParserNames("qwen3", "hermes"))
    for body in (named, required):
        held = hermes.forced_constraint(body, {})
        assert held.json is None and "<tool_call>" in held.structural_tag
        assert "get_weather" in held.structural_tag
    assert hermes.forced_constraint(BODY, {}) is None  # nothing forced
    plain = OutputParser(tokenizer, ParserNames()).forced_constraint(required, {})
    assert plain.structural_tag is None and plain.json["type"] == "array"

    answer = (
        '<think>\nHmm.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    for body in (named, required):
        parsed = parse(tokenizer, ("qwen3", "hermes"), answer, body=body)
        assert parsed.reasoning is not None and parsed.reasoning.strip() == "Hmm."
        assert_weather_call(parsed, city="Oslo")
        # read even where the job turned tool-call parsing off: the call was forced in that format
        assert_weather_call(parse(tokenizer, ("qwen3", "hermes"), answer, body=body, tools=False), city="Oslo")
    # the thinking trace's opening of the call ends it (qwen3's implicit end): the call is still read
    implicit = '<think>\nHmm.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert_weather_call(parse(tokenizer, ("qwen3", "hermes"), implicit, body=required), city="Oslo")
    json_answer = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert_weather_call(parse(tokenizer, (None, None), json_answer, body=required), city="Oslo")


def test_each_half_can_be_switched_off(tokenizer: Any) -> None:
    names = ("qwen3", "hermes")
    text = (
        '<think>\nHmm.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert parse(tokenizer, names, text, thinking=False, tools=False) == Parsed(text)
    calls_only = parse(tokenizer, names, text, thinking=False)
    assert calls_only.reasoning is None and calls_only.content is not None
    assert calls_only.content.startswith("<think>\nHmm.\n</think>")  # the trace stays, tags and all
    assert_weather_call(calls_only, city="Oslo")
    thinking_only = parse(tokenizer, names, text, tools=False)
    assert thinking_only.tool_calls == [] and "<tool_call>" in (thinking_only.content or "")
    # A row that offers no tools gets no tool calls, whatever the model wrote.
    no_tools = parse(tokenizer, names, text, body={"messages": BODY["messages"]})
    assert no_tools.tool_calls == [] and "<tool_call>" in (no_tools.content or "")


def test_a_tool_call_message_is_a_valid_openai_completion() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    g = Generated(None, "stop", 10, 5, reasoning="Hmm.", reasoning_tokens=2, tool_calls=[call])
    body = ChatCompletion.model_validate(chat_completion("r1", "m", g))
    choice = body.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls is not None and choice.message.tool_calls[0].function.name == "get_weather"
    message = body.model_dump()["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == "Hmm."  # vLLM 0.32 names it reasoning


# -- thinking tags and counts --------------------------------------------------------------------


def test_thinking_tags(tokenizer: Any) -> None:
    for name in ("deepseek_r1", "qwen3", "glm45", "kimi_k2", "minimax_m2"):
        tags = thinking_tags(name, tokenizer)
        assert tags is not None and (tags.start, tags.end, tags.closing) == ("<think>", "</think>", "</think>")
    harmony = thinking_tags("openai_gptoss", tokenizer)
    assert harmony is not None and harmony.start == "<|channel|>analysis<|message|>" and harmony.end == "<|end|>"
    assert harmony.closing == "<|end|><|start|>assistant<|channel|>final<|message|>"
    assert "\n" not in BUDGET_NOTICE  # one line


def test_where_the_budget_cut_a_trace() -> None:
    start, end = [1], [2]
    # Opened in the output: 3 thinking tokens, closed at index 4.
    assert budget_cut([7], [1, 5, 5, 5, 2, 9], start, end, 3) == 4
    assert budget_cut([7], [1, 5, 5, 5, 2, 9], start, end, 4) is None  # it ended before its budget
    # Opened by the prompt: the prompt's own thinking tokens count toward the budget, as in vLLM.
    assert budget_cut([7, 1, 5], [5, 5, 2, 9], start, end, 3) == 2
    assert budget_cut([7, 1, 5], [5, 5, 2, 9], start, end, 4) is None
    assert budget_cut([7, 1, 2], [5, 5, 2, 9], start, end, 1) is None  # the prompt switched thinking off
    assert budget_cut([7], [5, 5, 5], start, end, 1) is None  # never thought
    assert budget_cut([1], [5, 5, 5], start, end, 2) is None  # cut by max_tokens, not by the budget


def test_a_trace_the_model_ended_by_opening_its_answer_goes_on_without_the_notice(tokenizer: Any) -> None:
    """qwen3's reasoner ends a trace at a <tool_call>; vLLM's budget knows only </think> and forces
    it over the call: the answer goes on from the trace and the closing tag, no notice."""
    tags = thinking_tags("qwen3", tokenizer)
    assert tags is not None and tags.implicit_ends == ("<tool_call>",)
    t = ThinkingIds([1], [2], [2], [8, 8], implicit_ends=frozenset({6}))
    assert t.continuation([7], [1, 5, 6, 5, 2, 9], 3, None) == (2, [1, 5, 2])
    assert t.continuation([7, 1], [5, 6, 2], 2, 2) == (1, [5, 2])  # opened by the prompt
    assert t.continuation([7], [1, 5, 5, 5, 2, 6], 3, None) == (4, [1, 5, 5, 5, 8, 8, 2])  # after the trace
    assert t.continuation([7], [1, 6, 5, 2], 5, None) is None  # the budget closed nothing
    assert implicit_end([7], [6, 1, 5, 2], [1], [2], {6}) is None  # before the trace opened


def test_counting_thinking_tokens() -> None:
    start, end = [1], [2]
    assert count_thinking_tokens([7, 8], [1, 5, 5, 5, 2, 9, 9], start, end) == 3  # opened in the output
    assert count_thinking_tokens([7, 1], [5, 5, 2, 9], start, end) == 2  # opened by the prompt
    assert count_thinking_tokens([7, 1, 2], [9, 9, 9], start, end) == 0  # opened and closed by the prompt
    assert count_thinking_tokens([1], [5, 5, 5], start, end) == 3  # never closed (cut at the cap)
    assert count_thinking_tokens([], [9, 9], start, end) == 0
    assert count_thinking_tokens([], [3, 4, 5, 6, 3, 4], [3, 4], [6]) == 1  # multi-token tags


# -- estimating the thinking budget --------------------------------------------------------------


class ThinkingStubEngine(Engine):
    """Answers every row with a known number of thinking and answer tokens (row index based)."""

    model_name = "stub"

    def __init__(self) -> None:
        self.seen: list[EngineRequest] = []

    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        self.seen.extend(requests)
        outcomes = []
        for r in requests:
            thinking = 0 if r.chat_template_kwargs.get("enable_thinking") is False else 20 + (r.index * 7) % 50
            total = thinking + 10
            g = Generated("answer", "stop", 5, total, reasoning="..." if thinking else None, reasoning_tokens=thinking)
            usage = {"prompt_tokens": 5, "completion_tokens": total, "reasoning_tokens": thinking}
            outcomes.append(RowOutcome(r.index, r.key, 200, body=chat_completion(r.request_id, "stub", g), usage=usage))
        return outcomes


def submit(tmp_path: Path, options: dict[str, Any], rows: int = 40, **body: Any) -> Any:
    model = write_config(tmp_path / "qwen3-model", model_type="qwen3")
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"question {i}", **body) for i in range(rows)])
    return prepare_job(src, str(tmp_path / "out.jsonl"), JobOptions(model=str(model), **options), tmp_path / "work")


def test_the_thinking_budget_is_estimated_from_the_sample(tmp_path: Path) -> None:
    job = submit(tmp_path, {"max_tokens": 200, "estimate_sample_size": 30})
    engine = ThinkingStubEngine()
    report, stats = estimate_lengths(job, lambda: engine)
    assert report.sample_size == 30 and len(engine.seen) == 30
    assert all(r.max_tokens == 200 and r.reasoning_budget is None for r in engine.seen)  # the user's cap, no budget
    thinking = [20 + (r.index * 7) % 50 for r in engine.seen]
    assert report.reasoning_budget == upper_bound(thinking).value
    assert report.max_tokens is None  # set by the user, so reported as null
    assert report.method.startswith("max_tokens: set by user; reasoning_budget: upper 95% confidence bound")
    assert stats["sample_thinking_max"] == max(thinking)
    # Sample rows that thought less than the budget are reused; longer thinkers are generated again.
    reused = reusable_samples(job, report, 0, 40)
    assert set(reused) == {r.index for r, n in zip(engine.seen, thinking, strict=True) if n < report.reasoning_budget}


def test_both_figures_come_from_one_sample(tmp_path: Path) -> None:
    job = submit(tmp_path, {"estimate_sample_size": 30})
    engine = ThinkingStubEngine()
    report, _ = estimate_lengths(job, lambda: engine)
    assert len(engine.seen) == 30 and report.max_tokens is not None and report.reasoning_budget is not None
    assert report.method.count("upper 95% confidence bound") == 2


def test_a_budget_set_by_the_user_is_not_estimated(tmp_path: Path) -> None:
    job = submit(tmp_path, {"max_tokens": 64, "reasoning_budget": 16})
    report, _ = estimate_lengths(job, lambda: pytest.fail("no sample is needed"))
    assert report.reasoning_budget is None and report.method == "set by user"
    job = submit(tmp_path / "two", {"reasoning_budget": 16, "estimate_sample_size": 10})
    engine = ThinkingStubEngine()
    report, _ = estimate_lengths(job, lambda: engine)
    assert all(r.reasoning_budget == 16 for r in engine.seen)  # the sample runs under the user's budget
    assert report.reasoning_budget is None and report.method.endswith("reasoning_budget: set by user")


def test_rows_that_do_not_think_give_no_budget(tmp_path: Path) -> None:
    job = submit(
        tmp_path, {"max_tokens": 64, "estimate_sample_size": 10}, chat_template_kwargs={"enable_thinking": False}
    )
    report, _ = estimate_lengths(job, ThinkingStubEngine)
    assert report.reasoning_budget is None
    assert "reasoning_budget: only 0 sample rows thought" in report.method
