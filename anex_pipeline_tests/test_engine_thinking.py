"""Thinking through the real engine and the real pipeline, on a tiny random Qwen3
built offline (see tiny_models.py).

Its text is noise, so the tests steer it: the chat template opens <think> in the generation
prompt (the model thinks from its first token), every row ignores EOS, and a logit bias keeps the
model from writing special tokens itself, so the only tags in an answer are the ones the engine
forced. One engine load serves the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion

from anex_pipeline.engine.config import EngineConfig
from anex_pipeline.engine.loader import release_engines
from anex_pipeline.engine.parsing import BUDGET_NOTICE
from anex_pipeline.engine.server.machine_server import stop_server
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.jobs import answers, chat_row, local_instance, read_jsonl, run_job, write_jsonl
from anex_pipeline_tests.harness.tiny_models import SPECIAL_TOKENS, build_tiny_model

pytestmark = pytest.mark.engine

QUESTION = "What is the weather in London?"
MESSAGES = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture(scope="module")
def tokenizer(tiny: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[JobRunner]:
    storage = StorageResource(work_root=str(tmp_path_factory.mktemp("thinking-work")))
    with local_instance() as inst:
        # keep_loaded given here: Dagster rebuilds a resource from its constructor arguments, so
        # the runner's own model_copy(update=...) of it does not reach the steps.
        job_runner = JobRunner(inst, storage, EngineConfig(max_model_len=512))
        yield job_runner
        job_runner.close()


def noise_row(cid: str, tokenizer: Any, seed: int, end_bias: float = -100, **body: Any) -> dict[str, Any]:
    """A row the random model answers with plain noise: no EOS, and no special tokens of its own
    except, with a positive ``end_bias``, the end of its thinking."""
    bias = {str(tokenizer.convert_tokens_to_ids(t)): -100 for t in SPECIAL_TOKENS}
    bias[str(tokenizer.convert_tokens_to_ids("</think>"))] = end_bias
    return chat_row(cid, QUESTION, seed=seed, ignore_eos=True, logit_bias=bias, **body)


def message(line: dict[str, Any]) -> dict[str, Any]:
    assert line["error"] is None, line["error"]
    ChatCompletion.model_validate(line["response"]["body"])
    return line["response"]["body"]["choices"][0]["message"]


def given(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields that hold something (vLLM's server also writes the empty ones, as None)."""
    return {k: v for k, v in fields.items() if v is not None}


def shape_of(entry: dict[str, Any]) -> tuple[Any, ...]:
    """A chat logprobs entry without its numbers: its token, bytes and alternatives."""
    return entry["token"], entry["bytes"], [(t["token"], t["bytes"]) for t in entry["top_logprobs"]]


def reasoning_tokens(line: dict[str, Any]) -> int:
    return line["response"]["body"]["usage"]["completion_tokens_details"]["reasoning_tokens"]


def prompt_length(tokenizer: Any, **kwargs: Any) -> int:
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **kwargs)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_the_budget_closes_the_trace_with_the_notice(
    tmp_path: Path, tiny: Path, tokenizer: Any, runner: JobRunner
) -> None:
    rows = [noise_row(f"t{i}", tokenizer, seed=i) for i in range(3)]
    rows.append(noise_row("quiet", tokenizer, seed=9, chat_template_kwargs={"enable_thinking": False}))
    rows.append(noise_row("ends-early", tokenizer, seed=3, end_bias=6))  # closes its own trace at once
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    options = {"model": str(tiny), "reasoning_budget": 8, "max_tokens": 48, "temperature": 1.0}

    report = run_job(runner, src, tmp_path / "parsed.jsonl", options)
    lines = read_jsonl(tmp_path / "parsed.jsonl")
    notice_tokens = len(tokenizer.encode(f"\n{BUDGET_NOTICE}\n", add_special_tokens=False))
    for line in lines[:3]:
        msg = message(line)
        assert msg["reasoning_content"].endswith(f"\n{BUDGET_NOTICE}\n")
        assert msg["reasoning"] == msg["reasoning_content"]  # vLLM 0.32's own key, as its run_batch tests read it
        assert msg["content"] and "</think>" not in msg["content"]  # the answer follows the forced end
        # The budget and the notice are thinking, and output tokens like any other.
        assert 8 <= reasoning_tokens(line) <= 8 + notice_tokens
        assert line["response"]["body"]["usage"]["completion_tokens"] == 48
    quiet = message(lines[3])
    assert quiet.get("reasoning_content") is None and BUDGET_NOTICE not in quiet["content"]
    assert reasoning_tokens(lines[3]) == 0
    # A trace that ended within its budget gets no notice, in the trace or in the answer after it.
    early = message(lines[4])
    assert reasoning_tokens(lines[4]) < 8
    assert BUDGET_NOTICE not in (early.get("reasoning_content") or "") + (early["content"] or "")
    assert report.usage.reasoning_tokens == sum(reasoning_tokens(line) for line in lines)
    assert report.estimate.reasoning_budget is None and report.estimate.method == "set by user"

    # parse_thinking off: the raw text, with the forced end and its tag, stays in content.
    run_job(runner, src, tmp_path / "raw.jsonl", {**options, "parse_thinking": False})
    for line in read_jsonl(tmp_path / "raw.jsonl")[:3]:
        msg = message(line)
        assert f"\n{BUDGET_NOTICE}\n</think>" in msg["content"] and msg.get("reasoning_content") is None


def test_row_thinking_switch_wins_and_budget_zero_does_not_cap(
    tmp_path: Path, tiny: Path, tokenizer: Any, runner: JobRunner
) -> None:
    rows = [
        noise_row("row-on", tokenizer, seed=1, chat_template_kwargs={"enable_thinking": True, "mood": "calm"}),
        noise_row("job-off", tokenizer, seed=2),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    options = {"model": str(tiny), "reasoning": False, "reasoning_budget": 0, "max_tokens": 32, "temperature": 1.0}
    run_job(runner, src, tmp_path / "out.jsonl", options)
    on, off = read_jsonl(tmp_path / "out.jsonl")

    # The row's enable_thinking beat the job's reasoning=false, and its other argument arrived.
    assert prompt_length(tokenizer, enable_thinking=True, mood="calm") > prompt_length(tokenizer, enable_thinking=True)
    assert on["response"]["body"]["usage"]["prompt_tokens"] == prompt_length(
        tokenizer, enable_thinking=True, mood="calm"
    )
    msg = message(on)
    assert msg["reasoning_content"] and BUDGET_NOTICE not in msg["reasoning_content"]
    assert reasoning_tokens(on) == 32  # budget 0: thinking ran to the output cap, never cut short
    # The row without its own switch follows the job: no thinking.
    assert off["response"]["body"]["usage"]["prompt_tokens"] == prompt_length(tokenizer, enable_thinking=False)
    assert message(off).get("reasoning_content") is None and reasoning_tokens(off) == 0


def test_an_unset_budget_is_estimated_from_the_sample(
    tmp_path: Path, tiny: Path, tokenizer: Any, runner: JobRunner
) -> None:
    rows = [noise_row(f"e{i}", tokenizer, seed=i) for i in range(6)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    options = {"model": str(tiny), "max_tokens": 24, "estimate_sample_size": 4, "temperature": 1.0}
    report = run_job(runner, src, tmp_path / "out.jsonl", options)

    estimate = report.estimate
    assert estimate.sample_size == 4 and estimate.max_tokens is None  # max_tokens was set by the user
    # Every sampled row thought through all its 24 tokens, so every bound of the sample is 24.
    assert estimate.reasoning_budget == 24
    assert "reasoning_budget: upper 95% confidence bound" in estimate.method
    assert report.request_counts.completed == 6 and report.usage.reasoning_tokens > 0


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def forced_rows() -> list[dict[str, Any]]:
    """Forced calls at temperature 1 with thinking on and off: the seeds where the random trace
    writes ``<tool_call>`` itself (seed 1, seven tokens in) included."""
    ask = {"tools": [WEATHER_TOOL], "max_tokens": 48, "temperature": 1.0}
    rows = [chat_row(f"req-on-{s}", QUESTION, seed=s, tool_choice="required", **ask) for s in range(8)]
    off = {"enable_thinking": False}
    rows += [
        chat_row(f"req-off-{s}", QUESTION, seed=s, tool_choice="required", chat_template_kwargs=off, **ask)
        for s in range(3)
    ]
    rows += [chat_row(f"named-on-{s}", QUESTION, seed=s, tool_choice=NAMED, **ask) for s in range(2)]
    rows.append(chat_row("single", QUESTION, seed=3, tool_choice="required", parallel_tool_calls=False, **ask))
    rows.append(chat_row("greedy", QUESTION, tool_choice="required", **{**ask, "temperature": 0}))
    return rows


def calls_of(line: dict[str, Any]) -> list[tuple[str, str]]:
    """A row's tool calls without their random ids."""
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message(line).get("tool_calls") or []]


def test_a_forced_call_after_thinking_holds_in_the_models_own_format(
    tmp_path: Path, tiny: Path, tokenizer: Any, runner: JobRunner
) -> None:
    """A trace that writes ``<tool_call>`` ends thinking there, and that token is the grammar's
    first: held in hermes' own format (as vLLM's server holds it) it opens the call instead of
    failing the row. Then with a budget of 8 that closes the traces."""
    src = write_jsonl(tmp_path / "in.jsonl", forced_rows())
    out = tmp_path / "free.jsonl"
    report = run_job(runner, src, out, {"model": str(tiny), "reasoning_budget": 0})
    assert report.request_counts.failed == 0, report.error_counts
    lines = answers(out)
    for key, line in lines.items():
        msg = message(line)
        assert all(name == "get_weather" for name, _ in calls_of(line)), key
        # after the trace only the call: whole (read as a call) or cut at the cap (its raw text)
        assert msg["content"] == "" or msg["content"].startswith("<tool_call>"), (key, msg["content"])
    # the trace that opened the call itself: thinking ended there and the call followed
    assert message(lines["req-on-1"])["reasoning_content"]
    assert message(lines["req-on-1"])["content"].startswith('<tool_call>{"name": "get_weather"')
    assert message(lines["named-on-1"]) == message(lines["req-on-1"])  # same trace, same one tool
    for key in ("req-off-0", "req-off-1", "req-off-2"):  # no trace: the call comes first
        assert message(lines[key]).get("reasoning_content") is None, key
    assert calls_of(lines["req-off-1"]) == [("get_weather", '"lou{"')]  # as vLLM's own run_batch gives it
    assert len(calls_of(lines["single"])) <= 1

    report = run_job(runner, src, tmp_path / "budget.jsonl", {"model": str(tiny), "reasoning_budget": 8})
    closed = answers(tmp_path / "budget.jsonl")
    for key in ("req-on-0", "req-on-2", "req-on-3", "named-on-0", "single", "greedy"):
        msg = message(closed[key])  # each trace closed with the notice, the call after it
        assert msg["reasoning_content"].endswith(f"\n{BUDGET_NOTICE}\n"), key
        assert msg["content"].startswith("<tool_call>"), key
    # The trace that opened the call at its 7th token, which the budget then closed over the call:
    # it goes on from the trace and </think>, and the call is made again after them.
    msg = message(closed["named-on-1"])
    assert BUDGET_NOTICE not in msg["reasoning_content"] and msg["content"].startswith("<tool_call>")


@pytest.mark.vllm_serve
def test_the_shared_server_continues_a_cut_trace_as_the_in_process_engine_does(
    tmp_path: Path, tiny: Path, tokenizer: Any, runner: JobRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The machine's shared server (``vllm serve``) ends a trace at its budget with the end tag
    alone; the HTTP engine continues the row after the notice, so each row gets the answer the
    in-process engine gives it. The last test of the module: its engine is released for the server."""
    rows = [
        noise_row("cut", tokenizer, seed=0),
        noise_row("logprobs", tokenizer, seed=1, logprobs=True, top_logprobs=2),
        noise_row("head-only", tokenizer, seed=2, max_tokens=12),  # the cap falls inside the notice
        noise_row("ends-early", tokenizer, seed=3, end_bias=6),  # never cut: the server's answer as it is
        noise_row("quiet", tokenizer, seed=4, chat_template_kwargs={"enable_thinking": False}),
        noise_row("json", tokenizer, seed=6, response_format={"type": "json_object"}),  # constrained after the trace
    ]
    text = {k: v for k, v in noise_row("text", tokenizer, seed=5)["body"].items() if k != "messages"}
    text_row = {"custom_id": "text", "method": "POST", "url": "/v1/completions", "body": text}
    text_row["body"].update(prompt=f"{QUESTION}<think>\n", logprobs=2)  # a prompt that opens a trace
    text_src = write_jsonl(tmp_path / "text.jsonl", [text_row])
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    options = {"model": str(tiny), "reasoning_budget": 8, "max_tokens": 40, "temperature": 1.0}
    forced_src = write_jsonl(tmp_path / "forced.jsonl", forced_rows())
    forced_options = {"model": str(tiny), "reasoning_budget": 0}
    run_job(runner, src, tmp_path / "own.jsonl", options)
    run_job(runner, text_src, tmp_path / "own-text.jsonl", options)
    run_job(runner, forced_src, tmp_path / "own-forced.jsonl", forced_options)
    release_engines()  # its memory and cores go to the server

    folder = tmp_path / "machine-server"
    monkeypatch.setenv("ANEX_MACHINE_SERVER_DIR", str(folder))
    storage = StorageResource(work_root=str(tmp_path / "served-work"))
    try:
        with local_instance() as inst:
            served = JobRunner(inst, storage, EngineConfig(max_model_len=512, warm_server=True, keep_warm=True))
            report = run_job(served, src, tmp_path / "served.jsonl", options)
            run_job(served, text_src, tmp_path / "served-text.jsonl", options)
            run_job(served, forced_src, tmp_path / "served-forced.jsonl", forced_options)
            served.close()
    finally:
        stop_server(folder)
    assert report.engine["kind"] == "machine_server"

    own, theirs = answers(tmp_path / "own.jsonl"), answers(tmp_path / "served.jsonl")
    own_text, served_text = (
        answers(tmp_path / name)["text"]["response"]["body"] for name in ("own-text.jsonl", "served-text.jsonl")
    )
    text_choice, own_text_choice = served_text["choices"][0], own_text["choices"][0]
    assert text_choice["text"] == own_text_choice["text"] and BUDGET_NOTICE in text_choice["text"]
    assert text_choice["logprobs"]["tokens"] == own_text_choice["logprobs"]["tokens"]
    assert text_choice["logprobs"]["text_offset"] == own_text_choice["logprobs"]["text_offset"]
    forced = [lp is None for lp in text_choice["logprobs"]["token_logprobs"]]
    assert forced == [lp is None for lp in own_text_choice["logprobs"]["token_logprobs"]] and any(forced)
    assert served_text["usage"] == own_text["usage"]
    for key in own:
        mine, server = own[key]["response"]["body"], theirs[key]["response"]["body"]
        assert given(message(theirs[key])) == given(message(own[key])), key
        assert server["choices"][0]["finish_reason"] == mine["choices"][0]["finish_reason"], key
        if key in ("cut", "logprobs", "head-only", "json"):  # the answers made here count as the engine counts
            assert server["usage"] == mine["usage"], key
    for key in ("cut", "json"):
        assert message(theirs[key])["reasoning_content"].endswith(f"\n{BUDGET_NOTICE}\n"), key
    assert message(theirs["json"])["content"].lstrip().startswith("{")
    assert message(theirs["head-only"])["content"] is None or not message(theirs["head-only"])["content"]
    assert theirs["head-only"]["response"]["body"]["choices"][0]["finish_reason"] == "length"
    entries = theirs["logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    mine = own["logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(entries) == len(mine) == 40
    assert sum(e["logprob"] == -9999.0 for e in entries) == sum(e["logprob"] == -9999.0 for e in mine) > 0
    for theirs_entry, own_entry in zip(entries, mine, strict=True):  # the notice's tokens were forced: no logprob
        assert shape_of(theirs_entry) == shape_of(own_entry)
        assert theirs_entry["logprob"] == pytest.approx(own_entry["logprob"], abs=1e-3)
    assert "token_ids" not in theirs["cut"]["response"]["body"]["choices"][0]  # asked for by the engine alone
    quiet = message(theirs["quiet"])
    assert quiet.get("reasoning_content") is None and BUDGET_NOTICE not in quiet["content"]
    # Forced calls: the server holds them in hermes' format as the in-process engine now does, so
    # the answers are the same token for token (the calls' ids are random).
    own_forced, served_forced = answers(tmp_path / "own-forced.jsonl"), answers(tmp_path / "served-forced.jsonl")
    assert set(own_forced) == set(served_forced)
    for key, line in served_forced.items():
        mine, server = message(own_forced[key]), message(line)
        assert calls_of(line) == calls_of(own_forced[key]), key
        assert server["content"] == mine["content"] and server.get("reasoning") == mine.get("reasoning"), key
        assert server.get("reasoning_content") == mine.get("reasoning_content") == mine.get("reasoning"), key
        finish = [a["response"]["body"]["choices"][0]["finish_reason"] for a in (line, own_forced[key])]
        assert finish[0] == finish[1], key
    assert message(served_forced["req-on-1"])["reasoning"]  # ended by the <tool_call> it wrote
