"""Embeddings rows that give one conversation as ``messages``, as vLLM's ``/v1/embeddings`` takes
them: their checks at submit, their rendering for the in-process engine (the model's chat template,
no generation prompt, no special tokens but the template's) and a job on the fake engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.engine.vllm.prompts import RequestProblem, TextPrompts
from anex_pipeline.runner import JobRunner
from anex_pipeline.validate import check_body
from anex_pipeline_tests.harness.jobs import answers, write_jsonl
from anex_pipeline_tests.harness.tiny_models import build_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris is in France."}]


def fields(body: dict[str, Any]) -> list[str]:
    return [p.field for p in check_body(body, "embeddings", frozenset({"m"}))]


def test_messages_rows_pass_and_their_problems_name_their_field() -> None:
    assert fields({"messages": MESSAGES}) == []
    assert fields({"messages": MESSAGES, "add_generation_prompt": True, "chat_template_kwargs": {"x": 1}}) == []
    assert fields({"messages": MESSAGES, "input": "x"}) == ["body.input"]
    assert fields({"messages": []}) == ["body.messages"]
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    assert fields({"messages": [{"role": "user", "content": [image]}]}) == ["body.messages[0].content[0].type"]
    assert fields({"messages": MESSAGES, "continue_final_message": True}) == ["body.messages[1].role"]


def renderer(tokenizer: Any) -> TextPrompts:
    return TextPrompts(tokenizer, "m")


def test_messages_are_rendered_with_the_template_and_no_generation_prompt(tmp_path: Path) -> None:
    tokenizer = build_tokenizer(tmp_path / "tok")
    req = EngineRequest(index=0, key="k", request_id="r", endpoint="embeddings", body={"messages": MESSAGES})
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert renderer(tokenizer).conversation_ids(req) == tokenizer.encode(text, add_special_tokens=False)
    assert "<|im_start|>assistant" not in text
    asked = EngineRequest(
        index=0,
        key="k",
        request_id="r",
        endpoint="embeddings",
        body={"messages": MESSAGES, "add_generation_prompt": True},
    )
    assert len(renderer(tokenizer).conversation_ids(asked)) > len(renderer(tokenizer).conversation_ids(req))
    tokenizer.chat_template = None
    with pytest.raises(RequestProblem, match="has no chat template"):
        renderer(tokenizer).conversation_ids(req)


def test_an_embeddings_job_of_messages_runs(tmp_path: Path, fake_runner: JobRunner) -> None:
    rows = [{"custom_id": "c", "url": "/v1/embeddings", "body": {"messages": MESSAGES}}]
    report = fake_runner.run(
        fake_runner.submit(str(write_jsonl(tmp_path / "in.jsonl", rows)), str(tmp_path / "o.jsonl"), {})
    )
    assert report.request_counts.completed == 1
    [line] = answers(tmp_path / "o.jsonl").values()
    assert len(line["response"]["body"]["data"]) == 1
