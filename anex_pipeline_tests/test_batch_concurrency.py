"""Several Batch API batches at once on one engine: they run together, each API key gets its
share, a cancel stops exactly its batch, and a small batch is not stuck behind a large one.

The fast test uses the slow fake engine; the engine test runs real vLLM with room for 16 rows at
once, so that a 200-row batch takes many waves of the engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from anex_pipeline.orchestration.resources import EngineResource, StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.testing import fake_engine
from anex_pipeline_tests.harness.batch_api import KEY_A, KEY_B, client, content, rows, serving, submit, wait
from anex_pipeline_tests.harness.fake_cli import SLOW_FAKE
from anex_pipeline_tests.harness.jobs import chat_row, local_instance, write_jsonl


def counts(sdk: object, batch_id: str) -> int:
    found = sdk.batches.retrieve(batch_id).request_counts  # type: ignore[attr-defined]
    return 0 if found is None else found.completed


@pytest.mark.slow
def test_two_keys_batches_run_together_and_a_cancel_stops_only_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANEX_FAKE_ROW_DELAY_S", "0.05")
    src = write_jsonl(tmp_path / "in.jsonl", rows(60))
    storage = StorageResource(work_root=str(tmp_path / "work"))
    with (
        local_instance(set_dagster_home=True) as instance,
        serving(JobRunner(instance, storage, fake_engine(SLOW_FAKE)), max_running_batches=2) as url,
    ):
        alice, bob = client(url, KEY_A), client(url, KEY_B)
        first = submit(alice, src, {"max_tokens": 8, "checkpoint_rows": 2})
        second = submit(bob, src, {"max_tokens": 8, "checkpoint_rows": 2})
        deadline = time.monotonic() + 60
        while not (counts(alice, first.id) >= 4 and counts(bob, second.id) >= 4):
            assert time.monotonic() < deadline, "the two batches did not generate at the same time"
            time.sleep(0.05)
        assert counts(alice, first.id) < 60 and counts(bob, second.id) < 60  # both under way at once

        alice.batches.cancel(first.id)
        cancelled = wait(alice, first.id)
        done = wait(bob, second.id)
        kept = content(alice, cancelled.output_file_id)
        delivered = content(bob, done.output_file_id)

    assert cancelled.status == "cancelled" and 4 <= len(kept) < 60
    assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 60
    assert [r["custom_id"] for r in delivered] == [f"r{i}" for i in range(60)]


def test_batches_sent_together_are_checked_together(
    tmp_path: Path, fake_runner: JobRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the check of one batch is held up, a malformed batch sent after it fails at once."""
    held, released = threading.Event(), threading.Event()
    check = fake_runner.submit

    def slow_first_check(input_path: str, *args: object, **kwargs: object) -> object:
        if not held.is_set():
            held.set()
            assert released.wait(60), "the test never let the first check go on"
        return check(input_path, *args, **kwargs)

    monkeypatch.setattr(fake_runner, "submit", slow_first_check)
    good = write_jsonl(tmp_path / "good.jsonl", rows(3))
    bad = write_jsonl(tmp_path / "bad.jsonl", [chat_row("a", "fine"), '{"custom_id": "b", "body": '])
    with serving(fake_runner, max_running_batches=2) as url:
        sdk = client(url)
        first = submit(sdk, good, {"max_tokens": 8})
        deadline = time.monotonic() + 30
        while not held.is_set():
            assert time.monotonic() < deadline, "the first batch was never checked"
            time.sleep(0.02)
        try:
            failed = wait(sdk, submit(sdk, bad).id, timeout=30)
        finally:
            released.set()
        done = wait(sdk, first.id)
    assert failed.status == "failed" and failed.errors is not None and failed.errors.data is not None
    assert [(e.line, e.code) for e in failed.errors.data] == [(2, "invalid_json")]
    assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 3


@pytest.fixture(scope="module")
def narrow_runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobRunner]:
    """Real vLLM that runs 16 rows at once, on an instance on disk (batches run in threads)."""
    storage = StorageResource(work_root=str(tmp_path_factory.mktemp("narrow-work")))
    with local_instance(set_dagster_home=True) as instance:
        runner = JobRunner(instance, storage, EngineResource(max_model_len=2048, engine_args={"max_num_seqs": 16}))
        yield runner
        runner.close()


@pytest.mark.engine
def test_a_small_batch_after_a_large_one_finishes_first(tmp_path: Path, narrow_runner: JobRunner) -> None:
    large = write_jsonl(tmp_path / "large.jsonl", [chat_row(f"L{i}", f"Count up from {i}.") for i in range(200)])
    small = write_jsonl(tmp_path / "small.jsonl", [chat_row(f"S{i}", f"Name a colour, {i}.") for i in range(5)])
    options = {"max_tokens": 16, "temperature": 0}
    with serving(narrow_runner, max_running_batches=4) as url:
        alice, bob = client(url, KEY_A), client(url, KEY_B)
        big = submit(alice, large, options)
        deadline = time.monotonic() + 300
        while counts(alice, big.id) < 16:  # the large batch is generating: its first wave is done
            assert time.monotonic() < deadline, "the large batch made no progress"
            time.sleep(0.1)
        little = submit(bob, small, options)
        little_done = wait(bob, little.id, timeout=300)
        big_when_little_done = alice.batches.retrieve(big.id)
        big_done = wait(alice, big.id, timeout=600)
        little_rows = content(bob, little_done.output_file_id)

    assert little_done.status == "completed" and big_done.status == "completed"
    assert big_when_little_done.status == "in_progress"  # the small one did not wait for it
    assert little_done.completed_at is not None and big_done.completed_at is not None
    assert little_done.completed_at <= big_done.completed_at
    assert [r["custom_id"] for r in little_rows] == [f"S{i}" for i in range(5)]
    assert all(r["response"]["status_code"] == 200 for r in little_rows)
