"""What the tenants of one Batch API service share (the engine, its prefix cache, the threads that
check and run batches) and what they never share (stored answers, the engine's settings).

Each test here is an attack one tenant could make on another: probing the answer store for
another tenant's requests, swapping the shared engine out from under another tenant's batch,
or holding every thread of the service.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from openai import BadRequestError

from anex_pipeline.batch_api.fair_queue import FairQueue
from anex_pipeline.engine import loader
from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobReport
from anex_pipeline_tests.harness.batch_api import (
    KEY_A,
    KEY_B,
    client,
    content,
    serve_process,
    serving,
    submit,
    wait,
    wait_for_rows,
)
from anex_pipeline_tests.harness.fake_cli import slow_fake_engine
from anex_pipeline_tests.harness.jobs import chat_row, write_jsonl

SECRET_ROW = chat_row("q", "Summarise the account of contract 4471.", temperature=0, max_tokens=12)


def report_of(work: Path, batch_id: str) -> JobReport:
    path = work / "batch-api" / "batches" / f"{batch_id}.results.report.json"
    return JobReport.model_validate_json(path.read_text(encoding="utf-8"))


@pytest.mark.subprocess
def test_a_tenant_gets_no_answer_another_tenant_stored(tmp_path: Path) -> None:
    """Tenant B asks exactly what tenant A asked: B's row is generated for B, so B learns nothing of
    A's traffic; A asking again gets its own stored answer, made at its own time."""
    secret = write_jsonl(tmp_path / "secret.jsonl", [SECRET_ROW])
    probe = write_jsonl(
        tmp_path / "probe.jsonl", [SECRET_ROW, chat_row("control", "Nobody asked this.", temperature=0, max_tokens=12)]
    )
    with serve_process(tmp_path, env={"ANEX_FAKE_ROW_DELAY_S": "0"}) as (_, url):
        alice, bob = client(url, KEY_A), client(url, KEY_B)
        first = wait(alice, submit(alice, secret).id)
        probed = wait(bob, submit(bob, probe).id)
        again = wait(alice, submit(alice, secret).id)
        probed_rows = content(bob, probed.output_file_id)
        again_rows = content(alice, again.output_file_id)
        first_id = content(alice, first.output_file_id)[0]["response"]["body"]["id"]
    work = tmp_path / "work"
    assert first.status == probed.status == again.status == "completed"
    assert report_of(work, probed.id).reused_from_earlier_jobs == 0, "B's row was answered from A's stored answer"
    assert report_of(work, again.id).reused_from_earlier_jobs == 1, "a tenant's own answers are still stored"
    assert probed_rows[0]["response"]["body"]["created"] >= probed.created_at
    copied = again_rows[0]["response"]["body"]
    assert copied["created"] >= again.created_at, "a copied answer is made at its own time"
    assert copied["id"] != first_id


def test_a_batch_cannot_choose_the_shared_engines_parsers(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("r", "hello", max_tokens=4)])
    with serving(fake_runner) as url:
        sdk = client(url)
        for name in ("tool_parser", "reasoning_parser"):
            with pytest.raises(BadRequestError) as refused:
                submit(sdk, src, {name: "hermes" if name == "tool_parser" else "qwen3"})
            error = refused.value.body
            assert isinstance(error, dict) and error["param"] == f"anex_options.{name}", error
            assert "operator" in error["message"] and "\n" not in error["message"]
    with serving(fake_runner, parsers={"tool_parser": "hermes"}) as url:
        sdk = client(url)
        assert wait(sdk, submit(sdk, src, {"tool_parser": "hermes"}).id).status == "completed"  # the same one
        with pytest.raises(BadRequestError, match="runs hermes"):
            submit(sdk, src, {"tool_parser": "llama3_json"})


def test_batches_that_need_other_engines_take_turns(tmp_path: Path, slow_runner: JobRunner) -> None:
    """A chat batch and an embeddings batch on one model need two engines (the model loaded to
    generate, and loaded to embed): the second waits for the first, never swapping the engine
    under it. (Each row is its own engine call here, so rows of batches running at once interleave.)"""
    chat = write_jsonl(tmp_path / "chat.jsonl", [chat_row(f"c{i}", f"question {i}", max_tokens=4) for i in range(20)])
    embed = write_jsonl(
        tmp_path / "embed.jsonl",
        [{"custom_id": f"e{i}", "url": "/v1/embeddings", "body": {"input": f"text {i}"}} for i in range(20)],
    )
    one_row_calls = {"anex_options": json.dumps({"checkpoint_rows": 1})}
    engine = slow_fake_engine(DEFAULT_CHAT_MODEL)
    before = len(engine.seen)
    with serving(slow_runner, models=[DEFAULT_CHAT_MODEL]) as url:
        alice, bob = client(url, KEY_A), client(url, KEY_B)
        batches = []
        for sdk, path, endpoint in ((alice, chat, "/v1/chat/completions"), (bob, embed, "/v1/embeddings")):
            with path.open("rb") as f:
                uploaded = sdk.files.create(file=f, purpose="batch")
            batches.append(
                sdk.batches.create(
                    input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h", metadata=one_row_calls
                )
            )
        finished = [wait(sdk, batch.id) for sdk, batch in zip((alice, bob), batches, strict=True)]
        assert [b.status for b in finished] == ["completed", "completed"], [b.errors for b in finished]
    order = [key[0] for key in engine.seen[before:]]
    assert sorted(order) == ["c"] * 20 + ["e"] * 20
    assert order in (["c"] * 20 + ["e"] * 20, ["e"] * 20 + ["c"] * 20), f"the two engines' batches interleaved: {order}"


def test_a_row_may_name_the_bundled_model_by_its_short_name(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("r", "hello", max_tokens=4, model="SmolLM2-135M-Instruct")])
    with serving(fake_runner) as url:
        sdk = client(url)
        batch = wait(sdk, submit(sdk, src).id)
    assert batch.status == "completed", batch.errors


# -- threads shared fairly -------------------------------------------------------------------------


def test_a_key_with_nothing_in_progress_always_finds_a_thread() -> None:
    queue = FairQueue(threads=3)
    for n in range(6):
        queue.put("alice", f"a{n}")
    taken = [queue.get() for _ in range(3)]
    assert taken == [("alice", "a0"), ("alice", "a1"), ("alice", "a2")], "one key alone may use every thread"

    got: list[Any] = []
    fourth = threading.Thread(target=lambda: got.append(queue.get()))
    fourth.start()
    fourth.join(0.2)
    assert fourth.is_alive(), "alice's fourth batch took the thread kept for other keys"
    queue.put("bob", "b0")
    fourth.join(5)
    assert got == [("bob", "b0")]

    # Alice 2 and Bob 1 in progress: taking a3 would leave no thread for a third key.
    queue.done("alice")
    got.clear()
    fifth = threading.Thread(target=lambda: got.append(queue.get()))
    fifth.start()
    fifth.join(0.2)
    assert fifth.is_alive(), "the thread kept for a key with nothing in progress went to alice"
    queue.done("bob")
    fifth.join(5)
    assert got == [("alice", "a3")]


def test_the_key_with_fewest_batches_in_progress_goes_first() -> None:
    queue = FairQueue(threads=8)
    for n in range(3):
        queue.put("alice", f"a{n}")
    assert queue.get() == ("alice", "a0")
    queue.put("bob", "b0")
    queue.put("carol", "c0")
    assert [queue.get() for _ in range(3)] == [("bob", "b0"), ("carol", "c0"), ("alice", "a1")]
    queue.done("alice")
    queue.close()
    assert queue.get() is None


# -- the real engine -------------------------------------------------------------------------------


@pytest.mark.engine
def test_a_batch_naming_another_parser_leaves_the_running_batch_and_its_engine_alone(
    tmp_path: Path, real_runner: JobRunner
) -> None:
    rows = [chat_row(f"r{i}", f"Count to {i + 3}.", max_tokens=24, temperature=0) for i in range(32)]
    big = write_jsonl(tmp_path / "big.jsonl", rows)
    small = write_jsonl(tmp_path / "small.jsonl", [chat_row("s", "Say hi.", max_tokens=8)])
    with serving(real_runner) as url:
        alice, bob = client(url, KEY_A), client(url, KEY_B)
        running = submit(alice, big)
        wait_for_rows(alice, running.id, 1)
        engines = list(loader._loaded.values())
        with pytest.raises(BadRequestError) as refused:
            submit(bob, small, {"tool_parser": "hermes"})
        assert json.loads(refused.value.response.text)["error"]["param"] == "anex_options.tool_parser"
        done = wait(alice, running.id, timeout=600)
        assert list(loader._loaded.values()) == engines, "the engine was loaded again"
        output = content(alice, done.output_file_id)
    assert done.status == "completed" and len(output) == 32 and done.error_file_id is None
