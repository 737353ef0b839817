"""Identical deterministic rows are generated once per job and every row still gets its answer.

The fake engine writes the row's key into its answer, so a copied answer is told apart from one
generated for the row itself.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL
from anex_pipeline.responses import response_object
from anex_pipeline.spec import JobReport, RowOutcome
from anex_pipeline.stages.generate_answer_book import copy_for, fingerprint
from anex_pipeline.testing import shared_fake_engine
from anex_pipeline_tests.harness.jobs import chat_row, read_jsonl, run_job, write_jsonl


def _answer(row: dict) -> str:
    return row["response"]["body"]["choices"][0]["message"]["content"]


def _run(runner, tmp_path: Path, rows: list[dict], options: dict | None = None) -> tuple[JobReport, list[str], Path]:
    """Runs the rows as a job; returns its report, the keys the engine generated, and the result."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, rows)
    engine = shared_fake_engine(DEFAULT_CHAT_MODEL)
    seen_before = len(engine.seen)
    report = run_job(runner, src, out, options)
    return report, engine.seen[seen_before:], out


def test_identical_greedy_rows_are_generated_once_and_delivered_to_each(fake_runner, tmp_path: Path) -> None:
    rows = [chat_row(f"r{i}", "Name a colour.", temperature=0, max_tokens=8) for i in range(5)]
    rows += [chat_row("other", "Name a fruit.", temperature=0, max_tokens=8)]

    report, generated, out = _run(fake_runner, tmp_path, rows)

    assert sorted(generated) == ["other", "r0"]
    result = read_jsonl(out)
    assert [r["custom_id"] for r in result] == ["r0", "r1", "r2", "r3", "r4", "other"]
    assert {_answer(r) for r in result[:5]} == {_answer(result[0])}
    ids = [r["response"]["body"]["id"] for r in result]
    assert len(set(ids)) == len(ids)  # each row keeps its own response id
    assert all(i.startswith("chatcmpl-") for i in ids)
    assert report.request_counts.completed == 6
    assert report.reused_answer_rows == 4


def test_sampled_rows_are_all_generated(fake_runner, tmp_path: Path) -> None:
    rows = [chat_row(f"s{i}", "Tell me a story.", temperature=0.8, max_tokens=8) for i in range(3)]

    report, generated, _ = _run(fake_runner, tmp_path, rows)

    assert sorted(generated) == ["s0", "s1", "s2"]
    assert report.reused_answer_rows == 0


def test_answers_cross_shards(fake_runner, tmp_path: Path) -> None:
    rows = [chat_row(f"x{i}", "Same question.", seed=7, max_tokens=8) for i in range(8)]

    report, generated, out = _run(fake_runner, tmp_path, rows, {"shards": 4})

    assert generated == ["x0"]
    assert len(read_jsonl(out)) == 8
    assert report.reused_answer_rows == 7


def test_a_refused_row_is_not_booked_and_its_twins_share_the_refusal(fake_runner, tmp_path: Path) -> None:
    long_prompt = " ".join(["word"] * 300)  # over the fake engine's context
    rows = [chat_row(f"l{i}", long_prompt, temperature=0) for i in range(3)]

    report, _, out = _run(fake_runner, tmp_path, rows)

    assert report.request_counts.failed == 3
    assert all(r["response"]["status_code"] == 400 for r in read_jsonl(out))
    book = fake_runner.storage.job(report.job_id).root / "answers" / "answers.sqlite3"
    with sqlite3.connect(book) as db:
        assert db.execute("SELECT count(*) FROM answers").fetchone() == (0,)


def test_fingerprint_sees_every_difference_that_shapes_the_answer() -> None:
    def req(**changes) -> EngineRequest:
        fields = {
            "index": 0,
            "key": "a",
            "request_id": "id-a",
            "endpoint": "chat",
            "body": {"messages": [{"role": "user", "content": "hi"}]},
            "sampling": {"temperature": 0},
            "max_tokens": 16,
        }
        return EngineRequest(**{**fields, **changes})

    base = fingerprint(req())
    assert base is not None
    assert fingerprint(req(index=5, key="b", request_id="id-b")) == base  # identity does not shape the answer
    assert fingerprint(req(max_tokens=17)) != base
    assert fingerprint(req(body={"messages": [{"role": "user", "content": "hi!"}]})) != base
    assert fingerprint(req(sampling={"temperature": 0, "top_p": 0.5})) != base
    assert fingerprint(req(response_format={"type": "json_object"})) != base
    assert fingerprint(req(chat_template_kwargs={"enable_thinking": False})) != base
    assert fingerprint(req(reasoning_budget=64)) != base
    assert fingerprint(req(sampling={"temperature": 0.7})) is None
    assert fingerprint(req(sampling={"temperature": 0.7, "seed": 3})) is not None
    assert fingerprint(req(endpoint="embeddings", body={"input": "x"}, sampling={})) is not None


def test_reuse_can_be_switched_off(fake_runner, tmp_path: Path) -> None:
    rows = [chat_row(f"n{i}", "Name a colour.", temperature=0, max_tokens=8) for i in range(3)]

    _, generated, _ = _run(fake_runner, tmp_path, rows, {"reuse_answers": False})

    assert sorted(generated) == ["n0", "n1", "n2"]


def test_a_copy_is_made_now_with_its_own_echo_and_no_cached_tokens() -> None:
    """A copied answer tells nothing of the row that was generated: not when (its ``created``),
    not what of its prompt a cache held, nor (a Responses object) the settings its request echoed."""
    completion = {
        "id": "chatcmpl-first",
        "object": "chat.completion",
        "created": 1_000,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "4471"}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": 9,
            "completion_tokens": 1,
            "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
    }
    first_request = {
        "input": "contract?",
        "instructions": "You are the first tenant's assistant.",
        "metadata": {"t": "a"},
    }
    stored = RowOutcome(0, "a", 200, body=response_object(completion, first_request), usage={"cached_prompt_tokens": 8})
    own = {"input": [{"role": "user", "content": "contract?"}], "metadata": {"t": "b"}}
    req = EngineRequest(index=3, key="b", request_id="idb", endpoint="chat", body={}, respond=own)

    before = int(time.time())
    body = copy_for(stored, req).body
    assert body is not None and body["id"] == "resp_idb" and body["output"][0]["id"] == "msg_idb"
    assert body["created_at"] >= before and body["completed_at"] == body["created_at"]
    assert body["instructions"] is None and body["metadata"] == {"t": "b"}
    assert body["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert copy_for(stored, req).usage["cached_prompt_tokens"] == 0

    chat = copy_for(RowOutcome(0, "a", 200, body=completion), EngineRequest(3, "b", "idb", "chat", {}))
    assert chat.body is not None and chat.body["created"] >= before and chat.body["id"] == "chatcmpl-idb"
    assert chat.body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert completion["created"] == 1_000, "the stored answer itself is left as it was"
