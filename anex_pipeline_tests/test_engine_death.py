"""vLLM's engine process killed in the middle of a shard: the shard fails within seconds (vLLM
alone would wait for ever), the rows finished before stay in the checkpoint, the dead engine is
replaced on the next load, and the rerun (by hand, or Dagster's retry of the step) finishes the
shard without generating them again. Each test owns its engine (settings no other test uses)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from anex_pipeline.engine import loader
from anex_pipeline.engine.config import EngineConfig, EngineSettings
from anex_pipeline.engine.engine_args import canonical
from anex_pipeline.engine.loader import load_engine, release_engines
from anex_pipeline.engine.models import local_model_path, resolve_model
from anex_pipeline.engine.vllm.watchdog import engine_processes
from anex_pipeline.errors import EngineProcessDied
from anex_pipeline.options import job_options
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.stages.generate import run_shard
from anex_pipeline.stages.merge import merge_job
from anex_pipeline.stages.submit import prepare_job
from anex_pipeline_tests.harness.jobs import chat_row, local_instance, read_jsonl, write_jsonl

pytestmark = pytest.mark.engine

ROWS = 24
CHUNK = 4
KILL_AFTER = 8  # rows in the checkpoint when the engine process is killed


def own_settings() -> EngineSettings:
    """The default chat model with settings no other test uses, so this test owns its engine."""
    model, name = resolve_model(None, "chat")
    return EngineSettings(
        model=str(local_model_path(model)),
        model_name=name,
        max_model_len=512,
        engine_args=canonical({"max_num_seqs": 4}),
    )


def checkpoint_lines(path: Path) -> list[str]:
    """The checkpoint's lines (split on "\n" alone: generated text may hold other line breaks)."""
    return path.read_text(encoding="utf-8").split("\n")[:-1] if path.exists() else []


def error_text(error: Any) -> str:
    """A Dagster error's message with those of its causes (ours is the cause of Dagster's own)."""
    parts = []
    while error is not None:
        parts.append(error.message)
        error = error.cause
    return "\n".join(parts)


def test_killed_engine_process_fails_the_shard_fast_and_the_rerun_resumes(tmp_path: Path) -> None:
    rows = [chat_row(f"r{i}", f"List animals, number {i}.", temperature=0, ignore_eos=True) for i in range(ROWS)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    options = job_options({"max_tokens": 40, "shards": 1, "checkpoint_rows": CHUNK})
    job = prepare_job(src, str(tmp_path / "out.jsonl"), options, tmp_path / "work")
    checkpoint = job.checkpoint_path(0)
    settings = own_settings()
    try:
        engine = load_engine(settings)
        (core,) = engine_processes(engine.llm)
        raised: list[BaseException] = []

        def first_run() -> None:
            try:
                run_shard(job, 0, lambda: load_engine(settings))
            except BaseException as exc:  # handed to the test thread
                raised.append(exc)

        # The shard runs in a thread so that a hang fails this test instead of blocking the suite.
        shard = threading.Thread(target=first_run, daemon=True)
        shard.start()
        deadline = time.monotonic() + 1200  # engine start takes minutes on a busy machine
        while len(checkpoint_lines(checkpoint)) < KILL_AFTER and shard.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(core.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        shard.join(timeout=60)
        assert not shard.is_alive(), "the shard was still blocked 60 s after the engine process was killed"
        failed_after = time.monotonic() - killed_at
        (failure,) = raised
        assert isinstance(failure, EngineProcessDied), repr(failure)
        assert str(failure) == (
            "the vLLM engine process died (signal 9) during generation; finished rows are kept, rerun to resume"
        )
        assert failed_after < 10, f"the shard took {failed_after:.1f} s to fail after the kill"
        assert engine.dead

        kept = checkpoint_lines(checkpoint)
        assert KILL_AFTER <= len(kept) < ROWS
        assert all(json.loads(line)["error"] is None for line in kept)

        summary = run_shard(job, 0, lambda: load_engine(settings))
        assert load_engine(settings) is not engine  # the dead engine was replaced
        assert summary.kept_from_earlier_runs == len(kept)
        assert summary.generated == ROWS - len(kept)
        assert summary.completed == ROWS and summary.failed == 0
        after = checkpoint_lines(checkpoint)
        assert after[: len(kept)] == kept and len(after) == ROWS  # nothing finished was generated again

        report = merge_job(job)
        assert report.status == "completed" and report.request_counts.completed == ROWS
        assert [r["custom_id"] for r in read_jsonl(job.result_path)] == [f"r{i}" for i in range(ROWS)]
    finally:
        release_engines()


def test_dagster_retries_the_shard_on_a_new_engine_after_the_engine_process_dies(tmp_path: Path) -> None:
    rows = [chat_row(f"r{i}", f"Name fruits, number {i}.", temperature=0, ignore_eos=True) for i in range(ROWS)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    options = {"max_tokens": 40, "shards": 1, "checkpoint_rows": CHUNK}
    killed: list[tuple[object, int]] = []
    with local_instance() as instance:
        runner = JobRunner(
            instance,
            StorageResource(work_root=str(tmp_path / "work")),
            EngineConfig(max_model_len=512, engine_args={"max_num_seqs": 4}),
        )
        try:
            job = runner.submit(str(src), str(tmp_path / "out.jsonl"), options)
            checkpoint = job.checkpoint_path(0)

            def kill_mid_shard() -> None:
                deadline = time.monotonic() + 1200  # engine start takes minutes on a busy machine
                while len(checkpoint_lines(checkpoint)) < KILL_AFTER and time.monotonic() < deadline:
                    time.sleep(0.02)
                (engine,) = loader._loaded.values()
                os.kill(engine_processes(engine.llm)[0].pid, signal.SIGKILL)
                killed.append((engine, len(checkpoint_lines(checkpoint))))

            killer = threading.Thread(target=kill_mid_shard, daemon=True)
            killer.start()
            report = runner.run(job)
            killer.join()
            (replacement,) = loader._loaded.values()
        finally:
            runner.close()
        retried = [
            error_text(event.dagster_event.event_specific_data.error)
            for run in instance.get_runs(filters=dg.RunsFilter(job_name="shard_job"))
            for event in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_UP_FOR_RETRY)
        ]

    ((dead, finished_then),) = killed
    assert finished_then < ROWS and replacement is not dead  # killed mid-shard, then replaced
    assert len(retried) == 1 and "the vLLM engine process died (signal 9) during generation" in retried[0], retried
    assert report.status == "completed" and report.request_counts.completed == ROWS, report.failure_reason
    assert len(checkpoint_lines(checkpoint)) == ROWS  # the retry generated only the rows that were missing
