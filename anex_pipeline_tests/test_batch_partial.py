"""A running batch's finished rows through the Batch API: ``partial_output_file_id`` on the batch
while it runs, read with the SDK's ``files.content``; another key gets a 404, and the final output
file is OpenAI's as before."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import openai
import pytest

from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.testing import fake_engine
from anex_pipeline_tests.harness.batch_api import KEY_B, client, content, rows, serving, submit, wait, wait_for_rows
from anex_pipeline_tests.harness.jobs import write_jsonl
from anex_pipeline_tests.harness.stepping import STEPPING, StepGate, SteppingEngine, stepping


def _partial(sdk: openai.OpenAI, file_id: str) -> tuple[list[str], str]:
    got = sdk.files.content(file_id)
    lines = got.text.split("\n")
    assert lines[-1] == ""  # whole lines only
    return [json.loads(line)["custom_id"] for line in lines[:-1]], got.response.headers["anex-partial"]


def test_a_running_batch_shows_its_finished_rows_as_a_file_the_sdk_reads(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(40))
    gate = StepGate()
    stepping[0] = SteppingEngine(gate=gate)
    runner = JobRunner(instance, StorageResource(work_root=str(tmp_path / "work")), fake_engine(STEPPING))
    with serving(runner) as url:
        sdk = client(url)
        batch = submit(sdk, src, {"max_tokens": 8, "checkpoint_rows": 1})
        running = wait(sdk, batch.id, until={"in_progress"})
        partial_id = (running.model_extra or {}).get("partial_output_file_id")
        assert partial_id == f"file-partial-{batch.id}"
        gate.release(5)
        wait_for_rows(sdk, batch.id, 5)
        first, marked = _partial(sdk, partial_id)
        assert marked == "true" and first == [f"r{i}" for i in range(len(first))] and len(first) >= 5
        gate.release(10)
        wait_for_rows(sdk, batch.id, 15)
        second, _ = _partial(sdk, partial_id)
        assert second[: len(first)] == first and len(second) >= 15
        assert second == [f"r{i}" for i in range(len(second))]
        with pytest.raises(openai.NotFoundError):  # another key's batch: as for every batch route
            client(url, KEY_B).files.content(partial_id)
        with pytest.raises(openai.NotFoundError):
            sdk.files.content("file-partial-batch_nosuchbatch")
        gate.open()
        done = wait(sdk, batch.id)
        assert done.status == "completed"
        assert "partial_output_file_id" not in (done.model_extra or {})
        output = content(sdk, done.output_file_id)
        assert [r["custom_id"] for r in output] == [f"r{i}" for i in range(40)]
        assert set(output[0]) == {"id", "custom_id", "response", "error"}  # OpenAI's lines, nothing added
        after, marked = _partial(sdk, partial_id)  # read late: every row, no longer partial
        assert marked == "false" and after == [f"r{i}" for i in range(40)]
