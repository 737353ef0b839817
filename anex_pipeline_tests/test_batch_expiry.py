"""A batch's completion window is a deadline the service keeps: its ``expires_at`` is when the
job stops, the finished rows are delivered in the output file and the rest are answered in the
error file with ``batch_expired``, as OpenAI's Batch API does."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import openai
import pytest

from anex_pipeline.cli.parser import window_seconds
from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.batch_api import (
    client,
    content,
    rows,
    serve_process,
    serving,
    submit,
    wait,
    wait_for_rows,
)
from anex_pipeline_tests.harness.jobs import write_jsonl

WINDOW_S = 10


@pytest.mark.subprocess
def test_a_batch_still_running_at_the_end_of_its_window_ends_expired_with_its_finished_rows(tmp_path: Path) -> None:
    """300 rows of 0.1 s each outlast a window the operator cut to 10 s."""
    src = write_jsonl(tmp_path / "in.jsonl", rows(300))
    with serve_process(tmp_path, "--max-completion-window", f"{WINDOW_S}s") as (_, url):
        sdk = client(url)
        batch = submit(sdk, src, {"max_tokens": 4, "checkpoint_rows": 1})
        assert batch.expires_at == batch.created_at + WINDOW_S  # the deadline shown is the one kept
        ended = wait(sdk, batch.id, timeout=120)
        assert ended.status == "expired", ended.errors
        assert ended.expired_at is not None and ended.expired_at >= batch.expires_at
        delivered = content(sdk, ended.output_file_id)
        unrun = content(sdk, ended.error_file_id)
    assert delivered, "no row finished inside the window"
    assert all(line["error"] is None and line["response"]["status_code"] == 200 for line in delivered)
    assert {line["error"]["code"] for line in unrun} == {"batch_expired"}
    # every row once, in input order across the two files
    seen = sorted([*delivered, *unrun], key=lambda line: int(line["custom_id"][1:]))
    assert [line["custom_id"] for line in seen] == [f"r{i}" for i in range(300)]
    assert ended.request_counts is not None and ended.request_counts.completed == len(delivered)


def test_a_window_is_24h_or_a_longer_whole_number_of_hours_up_to_a_week(tmp_path: Path, slow_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(2))
    with serving(slow_runner) as url:
        sdk = client(url)
        uploaded = sdk.files.create(file=src.open("rb"), purpose="batch")
        week = sdk.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="168h",  # type: ignore[arg-type]
        )
        assert week.expires_at == week.created_at + 168 * 3600
        for window in ("1h", "169h", "24 h", "1d"):
            with pytest.raises(openai.BadRequestError) as refused:
                sdk.batches.create(
                    input_file_id=uploaded.id,
                    endpoint="/v1/chat/completions",
                    completion_window=window,  # type: ignore[arg-type]
                )
            error = refused.value.body
            assert isinstance(error, dict) and error["param"] == "completion_window", error
            assert "'168h'" in error["message"]
        assert wait(sdk, week.id).status == "completed"


@pytest.mark.subprocess
def test_the_window_holds_across_a_restart_of_the_service(tmp_path: Path) -> None:
    """serve stops (SIGTERM: the batch stays in progress) and starts again after the batch's
    expires_at: the batch does not get a new window, it ends expired with the rows it had."""
    src = write_jsonl(tmp_path / "in.jsonl", rows(300))
    with serve_process(tmp_path, "--max-completion-window", f"{WINDOW_S}s") as (_, url):
        sdk = client(url)
        batch = submit(sdk, src, {"max_tokens": 4, "checkpoint_rows": 1})
        wait_for_rows(sdk, batch.id, 1)
        assert sdk.batches.retrieve(batch.id).status == "in_progress"
    while time.time() < batch.expires_at + 1:  # the window ends while the service is down
        time.sleep(0.2)
    with serve_process(tmp_path, "--max-completion-window", f"{WINDOW_S}s") as (_, url):
        sdk = client(url)
        ended = wait(sdk, batch.id, timeout=120)
        assert ended.status == "expired" and ended.expires_at == batch.expires_at
        delivered = content(sdk, ended.output_file_id)
        unrun = content(sdk, ended.error_file_id)
    assert delivered and {line["error"]["code"] for line in unrun} == {"batch_expired"}
    assert len(delivered) + len(unrun) == 300


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("30m", 1800), ("12h", 43200)])
def test_the_operators_window_is_a_duration(text: str, seconds: int) -> None:
    assert window_seconds(text) == seconds


@pytest.mark.parametrize("text", ["5x", "0s", "1.5h", "h", "-3m", "١٢h"])
def test_a_window_that_is_not_a_whole_duration_is_refused_with_examples(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="such as 90s, 30m or 12h"):
        window_seconds(text)
