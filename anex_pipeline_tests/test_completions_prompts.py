"""Completions prompts in every OpenAI shape: a string, a list of strings, token ids, a list of
token-id lists; a row of several prompts gets one choice per prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from openai.types import Completion

from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.jobs import read_jsonl, run_job, write_jsonl

FIRST, SECOND = "The capital of Italy is", "One, two, three,"


def completion(cid: str, prompt: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    return {"custom_id": cid, "url": "/v1/completions", "body": body}


def results(runner: JobRunner, tmp_path: Path, rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    run_job(runner, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl")
    return {line["custom_id"]: line for line in read_jsonl(tmp_path / "out.jsonl")}


def test_a_row_of_several_prompts_gets_one_choice_per_prompt(tmp_path: Path, fake_runner: JobRunner) -> None:
    got = results(fake_runner, tmp_path, [completion("one", FIRST), completion("two", [FIRST, SECOND, "a b c"])])

    one = Completion.model_validate(got["one"]["response"]["body"])
    two = Completion.model_validate(got["two"]["response"]["body"])
    assert [c.index for c in two.choices] == [0, 1, 2]
    # the fake engine answers with the row's key and its prompt's last three words
    assert [c.text for c in two.choices] == [
        "answer to two: of Italy is",
        "answer to two: One, two, three,",
        "answer to two: a b c",
    ]
    assert two.usage is not None and one.usage is not None
    assert two.usage.prompt_tokens == len(f"{FIRST} {SECOND} a b c".split())  # summed over the prompts
    assert two.usage.total_tokens == two.usage.prompt_tokens + two.usage.completion_tokens
    assert two.id.startswith("cmpl-") and two.id != one.id


def test_one_prompt_over_the_context_fails_its_row_naming_the_prompt(tmp_path: Path, fake_runner: JobRunner) -> None:
    got = results(fake_runner, tmp_path, [completion("ok", FIRST), completion("bad", [FIRST, "word " * 300])])

    assert got["ok"]["error"] is None
    error = got["bad"]["error"]
    assert got["bad"]["response"]["body"] is None
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt[1]")


@pytest.mark.engine
def test_every_prompt_shape_on_the_real_engine(tmp_path: Path, real_runner: JobRunner) -> None:
    from transformers import AutoTokenizer

    from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL, local_model_path

    tokenizer = AutoTokenizer.from_pretrained(local_model_path(DEFAULT_CHAT_MODEL))
    ids = [tokenizer.encode(FIRST), tokenizer.encode(SECOND)]
    rows = [
        completion("first", FIRST),
        completion("second", SECOND),
        completion("list", [FIRST, SECOND]),
        completion("one-in-a-list", [SECOND]),
        completion("token-ids", ids[0]),
        completion("token-id-lists", ids),
    ]
    got = {k: Completion.model_validate(v["response"]["body"]) for k, v in results(real_runner, tmp_path, rows).items()}

    texts = [got["first"].choices[0].text, got["second"].choices[0].text]
    assert all(texts)
    assert [c.index for c in got["list"].choices] == [0, 1]
    assert [c.text for c in got["list"].choices] == texts  # temperature 0: each prompt's own answer
    assert [c.text for c in got["token-id-lists"].choices] == texts
    assert [c.text for c in got["one-in-a-list"].choices] == texts[1:]
    assert got["token-ids"].choices[0].text == texts[0]
    usage = {k: c.usage for k, c in got.items()}
    assert all(u is not None for u in usage.values())
    assert usage["list"].prompt_tokens == usage["first"].prompt_tokens + usage["second"].prompt_tokens  # type: ignore[union-attr]
    assert usage["token-ids"].prompt_tokens == len(ids[0]) == usage["first"].prompt_tokens  # type: ignore[union-attr]
