"""Generation request fields on the real vLLM engine (the CPU build here, the embedded model):
logprobs (a Parquet job's logprobs column too), several choices per row and the chat template's
reasoning effort, each as OpenAI's (or vLLM's) API documents it. The jobs share the session's
runner and its loaded engine."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobRejected
from anex_pipeline_tests.harness.batch_api import client, content, serving, submit, wait
from anex_pipeline_tests.harness.jobs import chat_row, read_jsonl, run_job, write_jsonl

pytestmark = pytest.mark.engine


def completion_row(cid: str, prompt: str | list[int], **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, **body}}


def bodies(out: Path) -> dict[str, dict[str, Any]]:
    lines = read_jsonl(out)
    assert all(line["error"] is None for line in lines), [line["error"] for line in lines]
    return {line["custom_id"]: line["response"]["body"] for line in lines}


def test_chat_logprobs_cover_every_token_and_greedy_tokens_top_their_alternatives(
    tmp_path: Path, real_runner: JobRunner
) -> None:
    question = "Name a colour."
    rows = [
        chat_row("top3", question, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3),
        chat_row("again", question, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3),
        chat_row("bare", question, max_tokens=12, temperature=0, logprobs=True),
        chat_row("none", question, max_tokens=12, temperature=0),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    assert run_job(real_runner, src, tmp_path / "out.jsonl").status == "completed"
    got = bodies(tmp_path / "out.jsonl")

    body = ChatCompletion.model_validate(got["top3"])
    content = body.choices[0].logprobs.content
    assert body.usage is not None and len(content) == body.usage.completion_tokens > 0
    assert "".join(t.token for t in content) == body.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].token == token.token  # greedy: each token is its best alternative
        assert math.isclose(token.top_logprobs[0].logprob, token.logprob, abs_tol=1e-4)
        assert token.logprob <= 0 and token.bytes == list(token.token.encode())
    # the twin is a copy of the same answer, logprobs and all; a row that asked for none has none
    assert got["again"]["choices"][0]["logprobs"] == got["top3"]["choices"][0]["logprobs"]
    bare = ChatCompletion.model_validate(got["bare"]).choices[0].logprobs.content
    assert [t.token for t in bare] == [t.token for t in content] and all(t.top_logprobs == [] for t in bare)
    assert got["none"]["choices"][0]["logprobs"] is None
    assert got["none"]["choices"][0]["message"]["content"] == got["top3"]["choices"][0]["message"]["content"]


def test_answer_reuse_never_hands_a_logprobs_row_an_answer_without_them(tmp_path: Path, real_runner: JobRunner) -> None:
    """The row without logprobs runs first and its answer is kept for reuse; its twins that ask
    for logprobs (as they may in a later shard) must be generated with them."""
    rows = [
        chat_row("plain", "Say yes.", max_tokens=4, temperature=0),
        chat_row("asks", "Say yes.", max_tokens=4, temperature=0, logprobs=True, top_logprobs=1),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    assert run_job(real_runner, src, tmp_path / "out.jsonl", {"shards": 2}).status == "completed"
    got = bodies(tmp_path / "out.jsonl")
    assert got["plain"]["choices"][0]["logprobs"] is None
    asked = got["asks"]["choices"][0]["logprobs"]["content"]
    assert len(asked) == got["asks"]["usage"]["completion_tokens"]


def test_completions_logprobs_are_four_lists_of_one_length(tmp_path: Path, real_runner: JobRunner) -> None:
    rows = [
        completion_row("k2", "The capital of France is", max_tokens=6, temperature=0, logprobs=2),
        completion_row("k0", "The capital of France is", max_tokens=6, temperature=0, logprobs=0),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    assert run_job(real_runner, src, tmp_path / "out.jsonl").status == "completed"
    got = bodies(tmp_path / "out.jsonl")

    body = Completion.model_validate(got["k2"])
    lp = body.choices[0].logprobs
    assert body.usage is not None
    lengths = {len(lp.tokens), len(lp.token_logprobs), len(lp.top_logprobs), len(lp.text_offset)}
    assert lengths == {body.usage.completion_tokens}
    assert "".join(lp.tokens) == body.choices[0].text
    offsets = [0, *[sum(len(t) for t in lp.tokens[: i + 1]) for i in range(len(lp.tokens) - 1)]]
    assert lp.text_offset == offsets
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 2 <= len(top) <= 3  # the sampled token and the two best (OpenAI's legacy shape)
        assert max(top, key=top.get) == token and math.isclose(top[token], logprob, abs_tol=1e-4)
    k0 = got["k0"]["choices"][0]["logprobs"]
    assert k0["tokens"] == lp.tokens and all(logprob is not None for logprob in k0["token_logprobs"])


def test_n_choices_are_indexed_summed_and_reproducible_with_a_seed(tmp_path: Path, real_runner: JobRunner) -> None:
    ask = {"max_tokens": 10, "temperature": 1.0, "seed": 7, "n": 3, "logprobs": True}
    rows = [chat_row("a", "Invent a word.", **ask), chat_row("b", "Invent a word.", **ask)]
    rows.append(completion_row("c", "Once upon a time", max_tokens=6, temperature=0.9, seed=3, n=2, logprobs=0))
    chat_src = write_jsonl(tmp_path / "chat.jsonl", rows[:2])
    # no answer reuse: the twin is generated again, and its seed must give it the same choices
    assert run_job(real_runner, chat_src, tmp_path / "chat.out.jsonl", {"reuse_answers": False}).status == "completed"
    got = bodies(tmp_path / "chat.out.jsonl")

    body = ChatCompletion.model_validate(got["a"])
    assert [c.index for c in body.choices] == [0, 1, 2]
    assert body.usage is not None
    assert body.usage.completion_tokens == sum(len(c.logprobs.content) for c in body.choices)
    texts = [c.message.content for c in body.choices]
    assert len(set(texts)) > 1  # each choice is sampled on its own (vLLM seeds choice i with seed + i)
    assert [c.message.content for c in ChatCompletion.model_validate(got["b"]).choices] == texts
    report = read_report(tmp_path / "chat.out.report.json")
    assert report["usage"]["completion_tokens"] == 2 * body.usage.completion_tokens

    completions_src = write_jsonl(tmp_path / "completions.jsonl", rows[2:])
    assert run_job(real_runner, completions_src, tmp_path / "completions.out.jsonl").status == "completed"
    completion = Completion.model_validate(bodies(tmp_path / "completions.out.jsonl")["c"])
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.usage is not None
    assert completion.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in completion.choices)


def read_report(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def test_the_batch_api_gives_the_sdk_logprobs_and_choices(tmp_path: Path, real_runner: JobRunner) -> None:
    """Logprobs and ``n`` through the Batch API, read back with the ``openai`` SDK's types."""
    rows = [
        chat_row("logprobs", "Name a colour.", max_tokens=8, temperature=0, logprobs=True, top_logprobs=2),
        chat_row("three", "Invent a word.", max_tokens=8, temperature=1.0, seed=5, n=3),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    with serving(real_runner) as url:
        sdk = client(url)
        batch = wait(sdk, submit(sdk, src).id, timeout=300)
        output = {line["custom_id"]: line["response"]["body"] for line in content(sdk, batch.output_file_id)}
    assert batch.status == "completed" and batch.error_file_id is None
    assert batch.request_counts is not None and batch.request_counts.completed == 2

    body = ChatCompletion.model_validate(output["logprobs"])
    tokens = body.choices[0].logprobs.content
    assert body.usage is not None and len(tokens) == body.usage.completion_tokens > 0
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in tokens)
    three = ChatCompletion.model_validate(output["three"])
    assert [c.index for c in three.choices] == [0, 1, 2] and all(c.message.content for c in three.choices)


def test_one_job_of_logprobs_choices_forced_calls_and_a_choice_constraint(
    tmp_path: Path, real_runner: JobRunner
) -> None:
    """Rows asking for different things share one job, and so the engine's batches. Forced tool
    calls: the embedded model has no tool parser and would answer in text, so a forced choice
    holds its generation to the call's JSON, as vLLM's server does."""
    import jsonschema

    ask = {"tools": [WEATHER, TIME], "max_tokens": 80, "temperature": 0}
    named = {"type": "function", "function": {"name": "get_time"}}
    colours = ["red", "green", "blue"]
    rows = [
        chat_row("logprobs", "Name a colour.", max_tokens=12, temperature=0, logprobs=True, top_logprobs=2),
        chat_row("three", "Invent a word.", max_tokens=10, temperature=1.0, seed=5, n=3),
        chat_row("named", "What is the weather in Paris?", tool_choice=named, **ask),
        chat_row("required", "What is the weather in Paris?", tool_choice="required", **ask),
        chat_row("one", "Weather in Paris and Rome?", tool_choice="required", parallel_tool_calls=False, **ask),
        chat_row("auto", "What is the weather in Paris?", **ask),
        chat_row("choice", "Pick a colour.", max_tokens=8, temperature=0, structured_outputs={"choice": colours}),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    assert run_job(real_runner, src, tmp_path / "out.jsonl").status == "completed"
    got = {cid: ChatCompletion.model_validate(body) for cid, body in bodies(tmp_path / "out.jsonl").items()}

    logprobs = got["logprobs"]
    content = logprobs.choices[0].logprobs.content
    assert logprobs.usage is not None and len(content) == logprobs.usage.completion_tokens > 0
    assert all(t.top_logprobs[0].token == t.token for t in content)  # greedy: each token its best alternative
    assert [c.index for c in got["three"].choices] == [0, 1, 2]
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for cid in ("named", "required", "one"):
        message = got[cid].choices[0].message
        assert message.tool_calls, (cid, message)
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
    assert [c.function.name for c in got["named"].choices[0].message.tool_calls] == ["get_time"]
    assert len(got["one"].choices[0].message.tool_calls) == 1
    assert got["auto"].choices[0].message.tool_calls is None  # no parser, nothing forced: text
    assert got["choice"].choices[0].message.content in colours


def test_structured_outputs_hold_the_answer_and_a_bad_grammar_fails_its_row_alone(
    tmp_path: Path, real_runner: JobRunner
) -> None:
    colours = ["red", "green", "blue"]
    rows = [
        chat_row("choice", "Pick a colour.", max_tokens=8, temperature=0, structured_outputs={"choice": colours}),
        chat_row("regex", "Give a year.", max_tokens=8, temperature=0, structured_outputs={"regex": "19[0-9]{2}"}),
        chat_row("bad", "Hi.", max_tokens=8, temperature=0, structured_outputs={"grammar": "root ::= ("}),
        completion_row("json", "A person:", max_tokens=40, temperature=0, structured_outputs={"json": SCHEMA}),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows[:3])
    assert run_job(real_runner, src, tmp_path / "out.jsonl").status == "completed"
    lines = {line["custom_id"]: line for line in read_jsonl(tmp_path / "out.jsonl")}
    assert lines["choice"]["response"]["body"]["choices"][0]["message"]["content"] in colours
    year = lines["regex"]["response"]["body"]["choices"][0]["message"]["content"]
    assert len(year) == 4 and year.startswith("19") and year.isdigit()
    bad = lines["bad"]
    assert bad["response"]["status_code"] == 400 and bad["error"]["param"] == "structured_outputs", bad["error"]

    src = write_jsonl(tmp_path / "completions.jsonl", rows[3:])
    assert run_job(real_runner, src, tmp_path / "completions.out.jsonl").status == "completed"
    text = bodies(tmp_path / "completions.out.jsonl")["json"]["choices"][0]["text"]
    assert set(json.loads(text)) <= {"name", "age"}


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name"],
    "additionalProperties": False,
}


def test_vllms_extras_continue_a_message_cut_a_prompt_and_give_prompt_logprobs(
    tmp_path: Path, real_runner: JobRunner
) -> None:
    from transformers import AutoTokenizer

    from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL, local_model_path

    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    tokenizer = AutoTokenizer.from_pretrained(local_model_path(DEFAULT_CHAT_MODEL))
    continued = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    ids = tokenizer.encode(continued, add_special_tokens=False)
    greedy = {"max_tokens": 4, "temperature": 0}
    chat = {"method": "POST", "url": "/v1/chat/completions"}
    rows = [
        {**chat, "custom_id": "continue", "body": {"messages": messages, "continue_final_message": True, **greedy}},
        {**chat, "custom_id": "new-turn", "body": {"messages": messages, **greedy}},
        {**chat, "custom_id": "prompt-lp", "body": {"messages": messages[:1], "prompt_logprobs": 2, **greedy}},
    ]
    src = write_jsonl(tmp_path / "chat.jsonl", rows)
    # the session's engine schedules first come, first served: a priority is refused at submit
    late = {**chat, "custom_id": "priority", "body": {"messages": messages[:1], "priority": 5, **greedy}}
    with pytest.raises(JobRejected) as refused:
        real_runner.submit(str(write_jsonl(tmp_path / "priority.jsonl", [*rows, late])), str(tmp_path / "p.out"), {})
    (problem,) = refused.value.problems
    assert (problem.line, problem.field) == (4, "body.priority") and "scheduling_policy=priority" in problem.message
    assert run_job(real_runner, src, tmp_path / "chat.out.jsonl").status == "completed"
    got = {line["custom_id"]: line for line in read_jsonl(tmp_path / "chat.out.jsonl")}
    # the prompt is the template's continuation of the assistant's words, token for token
    cont = ChatCompletion.model_validate(got["continue"]["response"]["body"])
    assert cont.usage is not None and cont.usage.prompt_tokens == len(ids)
    turn = ChatCompletion.model_validate(got["new-turn"]["response"]["body"])
    assert turn.usage is not None and turn.usage.prompt_tokens > len(ids)  # the turn closed, a new one opened
    # prompt logprobs at the body's top level, as vLLM's server has them: none for the first token
    body = got["prompt-lp"]["response"]["body"]
    per_token = body["prompt_logprobs"]
    assert len(per_token) == body["usage"]["prompt_tokens"] and per_token[0] is None
    assert all(2 <= len(alts) <= 3 and all(a["logprob"] <= 0 for a in alts.values()) for alts in per_token[1:])

    completions = [
        completion_row("same", ids, **greedy),
        completion_row("cut", "one two three four five six seven eight nine ten", truncate_prompt_tokens=3, **greedy),
    ]
    src = write_jsonl(tmp_path / "completions.jsonl", completions)
    assert run_job(real_runner, src, tmp_path / "completions.out.jsonl").status == "completed"
    done = bodies(tmp_path / "completions.out.jsonl")
    assert Completion.model_validate(done["same"]).choices[0].text == cont.choices[0].message.content
    cut = Completion.model_validate(done["cut"])
    assert cut.usage is not None and cut.usage.prompt_tokens == 3


def test_a_parquet_job_with_logprobs_gets_an_entry_per_token_each_its_own_best_alternative(
    tmp_path: Path, real_runner: JobRunner
) -> None:
    """The job options reach the engine as a JSONL row's fields do, for chat and completions."""
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["Name a colour.", "The capital of France is"]}), src)
    options = {"logprobs": True, "top_logprobs": 2, "temperature": 0, "max_tokens": 8}
    for endpoint in ("chat", "completions"):
        out = tmp_path / f"{endpoint}.parquet"
        assert run_job(real_runner, src, out, {**options, "endpoint": endpoint}).status == "completed"
        for row in pq.read_table(out).to_pylist():
            tokens = row["logprobs"]
            assert len(tokens) == row["completion_tokens"] > 0, (endpoint, row)
            assert "".join(t["token"] for t in tokens) == row["output"]
            for t in tokens:
                best = t["top_logprobs"][0]
                assert 2 <= len(t["top_logprobs"]) <= (2 if endpoint == "chat" else 3)
                assert best["token"] == t["token"] and math.isclose(best["logprob"], t["logprob"], abs_tol=1e-4)
                assert all(a["logprob"] <= best["logprob"] for a in t["top_logprobs"])


def test_a_labels_job_holds_each_answer_to_a_label_and_gives_its_probability(
    tmp_path: Path, real_runner: JobRunner
) -> None:
    """The labels option on the real engine: the answer is one label, and its probability is the
    product of the probabilities of the label's tokens as the model gave them (their logprobs)."""
    from anex_pipeline.engine.labels import label_tokens

    labels = ["positive", "negative", "mixed feelings"]
    reviews = ["I loved every minute of it.", "Terrible food and slow service.", "Good seats, bad sound."]
    rows = [chat_row(f"r{n}", f"Classify the review: {text}") for n, text in enumerate(reviews)]
    rows += [chat_row(f"asks{n}", f"Classify the review: {text}", logprobs=True) for n, text in enumerate(reviews)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    options = {"labels": labels, "temperature": 0}
    assert run_job(real_runner, src, tmp_path / "out.jsonl", options).status == "completed"
    got = bodies(tmp_path / "out.jsonl")
    for n in range(len(reviews)):
        plain, asked = got[f"r{n}"], got[f"asks{n}"]
        label = asked["choices"][0]["message"]["content"]
        assert label in labels and asked["anex"]["label"] == label
        assert plain["anex"] == asked["anex"] and plain["choices"][0]["logprobs"] is None
        spelt = label_tokens(asked["choices"][0]["logprobs"]["content"], label)
        assert "".join(t["token"] for t in spelt) == label
        assert math.isclose(sum(t["logprob"] for t in spelt), math.log(asked["anex"]["label_prob"]), abs_tol=1e-9)
        assert 0 < asked["anex"]["label_prob"] < 1

    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"Classify the review: {text}" for text in reviews]}), src)
    assert run_job(real_runner, src, tmp_path / "out.parquet", options).status == "completed"
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column("label").to_pylist() == [got[f"r{n}"]["anex"]["label"] for n in range(len(reviews))]
    for prob, n in zip(table.column("label_prob").to_pylist(), range(len(reviews)), strict=True):
        assert math.isclose(prob, got[f"r{n}"]["anex"]["label_prob"], rel_tol=1e-6)
