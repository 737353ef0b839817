"""Stopping a job, on a fake engine that works in steps like vLLM's scheduler: a stop is seen at the
next engine step (not at the next checkpoint), the rows in flight are dropped, the finished rows
are kept, and progress follows every row as it finishes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from anex_pipeline import stopping
from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.errors import EngineProcessDied, JobStopped
from anex_pipeline.options import job_options
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import RowOutcome
from anex_pipeline.stages.generate import live_progress, run_shard
from anex_pipeline.stages.merge import merge_job
from anex_pipeline.stages.submit import prepare_job
from anex_pipeline.stopping import request_stop, stopping_on_signals
from anex_pipeline.testing import fake_engine
from anex_pipeline.workdir.manifest import JobDir
from anex_pipeline_tests.harness.jobs import chat_row, local_instance, write_jsonl
from anex_pipeline_tests.harness.stepping import STEPPING, StepGate, SteppingEngine, stepping

ROWS = 40


def new_job(tmp_path: Path, rows: int = ROWS, **options: Any) -> JobDir:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(rows)])
    return prepare_job(src, str(tmp_path / "out.jsonl"), job_options({"max_tokens": 8, **options}), tmp_path / "w")


def checkpointed(job: JobDir) -> list[str]:
    return [o.key for o in job.outcomes(0)]


def test_a_stop_is_seen_at_the_next_engine_step_not_at_the_next_checkpoint(tmp_path: Path) -> None:
    job = new_job(tmp_path)  # default checkpoint_rows (256): no checkpoint is due before the end
    engine = SteppingEngine()
    seen: list[tuple[int, int, int]] = []

    def progress(done: int, total: int, tokens: int) -> None:
        seen.append((done, total, tokens))
        live = live_progress(job, 0)
        assert live is not None and (live.done, live.total) == (done, total)
        if done == 5:
            request_stop(job, "cancelled in the test")

    with pytest.raises(JobStopped, match="cancelled in the test"):
        run_shard(job, 0, lambda: engine, progress=progress)
    assert engine.steps == 5, "the engine took no further step after the stop"
    assert checkpointed(job) == [f"r{i}" for i in range(5)], "the finished rows were checkpointed"
    assert engine.aborted, "the rows in flight were dropped"
    assert [s[0] for s in seen] == list(range(6)), "progress followed every row"
    assert all(s[1] == ROWS for s in seen) and seen[-1][2] > 0  # completion tokens so far
    assert live_progress(job, 0) is None


def test_a_stop_file_written_by_another_process_is_seen_within_a_fraction_of_a_second(tmp_path: Path) -> None:
    job = new_job(tmp_path, checkpoint_rows=1000)
    engine = SteppingEngine(step_s=0.02)
    asked = {}

    def progress(done: int, total: int, tokens: int) -> None:
        if done == 3 and not asked:
            job.record_stop("cancelled elsewhere")  # the file alone, as another process writes it
            asked["at"] = time.monotonic()

    with pytest.raises(JobStopped, match="cancelled elsewhere"):
        run_shard(job, 0, lambda: engine, progress=progress)
    assert time.monotonic() - asked["at"] < stopping.DISK_CHECK_S + 0.2
    assert engine.steps < ROWS and len(checkpointed(job)) == engine.steps


def test_the_time_limit_stops_the_job_at_an_engine_step(tmp_path: Path) -> None:
    job = new_job(tmp_path)
    engine = SteppingEngine(step_s=0.01)
    job.start_clock(0.15)
    with pytest.raises(JobStopped, match="time limit"):
        run_shard(job, 0, lambda: engine)
    assert 0 < len(checkpointed(job)) == engine.steps < ROWS
    assert "time limit" in json.loads(job.stop_path.read_text())["reason"]


def test_a_torn_stop_file_stops_the_job_and_the_report_says_it_was_asked_to_stop(tmp_path: Path) -> None:
    job = new_job(tmp_path, checkpoint_rows=1)
    gate = StepGate()
    gate.release(3)  # then the engine waits, looking for a stop, until the torn file is read
    engine = SteppingEngine(gate=gate)
    assert job.stop_reason() is None and job.report() is None

    def progress(done: int, total: int, tokens: int) -> None:
        if done == 3:
            job.stop_path.write_text('{"reason": "cancelled by')  # cut short by a writer that died

    with pytest.raises(JobStopped, match="asked to stop"):
        run_shard(job, 0, lambda: engine, progress=progress)
    report = merge_job(job)
    assert report.status == "stopped_early" and report.failure_reason == "the job was asked to stop"
    assert report.request_counts.completed == len(checkpointed(job)) > 0
    assert job.report() == report
    job.report_path.write_text(job.report_path.read_text()[:40])
    with pytest.raises(ValueError):
        job.report()


def test_a_signal_asks_the_job_to_stop_and_says_a_second_one_quits(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    job = new_job(tmp_path)
    engine = SteppingEngine()

    def progress(done: int, total: int, tokens: int) -> None:
        if done == 4:
            os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(JobStopped, match=r"cancelled by the user \(SIGINT\)"), stopping_on_signals(job):
        run_shard(job, 0, lambda: engine, progress=progress)
    assert signal.getsignal(signal.SIGINT) is before, "the previous handler is back"
    assert len(checkpointed(job)) == engine.steps == 4
    err = capfd.readouterr().err
    assert "Ctrl-C again" in err and err.count("\n") == 1


def test_an_engine_death_that_comes_with_a_stop_is_the_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = new_job(tmp_path)
    monkeypatch.setattr(stopping, "ENGINE_DEATH_GRACE_S", 0.3)
    with pytest.raises(EngineProcessDied), stopping_on_signals(job):
        raise EngineProcessDied("killed")  # no stop: a fault of the engine, which a retry may fix
    with pytest.raises(JobStopped, match="the user"), stopping_on_signals(job):
        request_stop(job, "the user")
        raise EngineProcessDied("killed by the same Ctrl-C")


def test_a_stopped_shard_is_not_retried_and_the_report_says_why(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(ROWS)])
    gate = StepGate()
    stepping[0] = SteppingEngine(gate=gate)
    with local_instance() as instance:
        runner = JobRunner(instance, StorageResource(work_root=str(tmp_path / "w")), fake_engine(STEPPING))
        job = runner.submit(str(src), str(tmp_path / "out.jsonl"), {"max_tokens": 8, "shards": 2})

        def cancel_after_three_rows() -> None:
            gate.release(3)
            gate.wait_taken(3)
            request_stop(job, "cancelled in the test")  # the engine waits for a fourth step meanwhile

        threading.Thread(target=cancel_after_three_rows, daemon=True).start()
        report = runner.run(job)
        runner.close()
        runs = instance.get_runs(dg.RunsFilter(job_name="shard_job"))
        starts = [
            e.step_key for run in runs for e in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_START)
        ]
    assert report.status == "stopped_early" and report.failure_reason == "cancelled in the test"
    assert report.request_counts.completed == 3
    assert len(runs) == 1, "the second shard did not start"
    assert starts.count("generations") == 1, "the stopped step was not retried"


def test_a_batch_api_cancel_stops_at_once_and_answers_every_unrun_row(tmp_path: Path) -> None:
    from anex_pipeline_tests.harness.batch_api import client, content, serving, submit, wait, wait_for_rows

    rows = 60
    gate = StepGate()
    engine = stepping[0] = SteppingEngine(gate=gate)  # default checkpoint_rows
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(rows)])
    with local_instance() as instance:
        runner = JobRunner(instance, StorageResource(work_root=str(tmp_path / "w")), fake_engine(STEPPING))
        with serving(runner) as url:
            sdk = client(url)
            batch = submit(sdk, src, {"max_tokens": 8})
            gate.release(5)
            wait_for_rows(sdk, batch.id, 5)  # counts follow the rows before any checkpoint is written
            sdk.batches.cancel(batch.id)  # while the engine waits for its sixth step
            asked = time.monotonic()
            batch = wait(sdk, batch.id, timeout=20)
            took = time.monotonic() - asked
            output, errors = content(sdk, batch.output_file_id), content(sdk, batch.error_file_id)
    assert batch.status == "cancelled" and took < 5
    assert engine.steps < rows and engine.aborted
    counts = batch.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (rows, len(output), len(errors))
    assert len(output) == 5 and len(output) + len(errors) == rows
    assert [r["custom_id"] for r in output] == [f"r{i}" for i in range(len(output))]
    assert [r["custom_id"] for r in errors] == [f"r{i}" for i in range(len(output), rows)], "input order"
    assert {r["error"]["code"] for r in errors} == {"batch_cancelled"} and all(r["response"] is None for r in errors)


def test_a_cancel_that_lands_as_the_run_starts_is_not_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from anex_pipeline_tests.harness.batch_api import client, content, serving, submit, wait

    rows = 30
    stepping[0] = SteppingEngine(step_s=0.02)
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(rows)])
    with local_instance() as instance:
        runner = JobRunner(instance, StorageResource(work_root=str(tmp_path / "w")), fake_engine(STEPPING))
        with serving(runner) as url:
            sdk = client(url)
            register = JobRunner._register

            def cancel_first(self: JobRunner, job: JobDir) -> None:  # the cancel comes as run() begins
                if threading.current_thread().name.startswith("batch-run") and not job.stop_path.exists():
                    sdk.batches.cancel(batch.id)
                register(self, job)

            monkeypatch.setattr(JobRunner, "_register", cancel_first)
            batch = submit(sdk, src, {"max_tokens": 8})
            batch = wait(sdk, batch.id, timeout=20)
            errors = content(sdk, batch.error_file_id)
    assert batch.status == "cancelled"
    assert len(errors) == rows and stepping[0].steps == 0, "no row ran after the cancel"


def test_the_http_engine_stops_sending_at_a_stop_and_does_not_wait_for_the_rows_in_flight() -> None:
    from anex_pipeline.engine.config import HttpSettings
    from anex_pipeline.engine.http.engine import OpenAIHttpEngine
    from anex_pipeline_tests.harness.openai_server import FakeServer

    server = FakeServer()
    engine = OpenAIHttpEngine(HttpSettings(base_url=server.url, model_name="served-model", max_concurrency=4))
    rows = [
        EngineRequest(i, f"r{i}", f"id-{i}", "chat", {"messages": [{"role": "user", "content": "slow"}]})
        for i in range(40)
    ]  # each answer takes 0.2 s
    finished: list[RowOutcome] = []
    asked: list[float] = []

    def stop() -> None:
        if len(finished) >= 2:
            asked.append(time.monotonic())
            raise JobStopped("cancelled in the test")

    try:
        with pytest.raises(JobStopped):
            for rows_done in engine.stream(rows, 256, stop):
                finished.extend(rows_done)
        took = time.monotonic() - asked[0]
        sent = server.attempts["slow"]
    finally:
        engine.shutdown()
        server.close()
    assert took < 0.1, "the stream did not wait for the requests still in flight"
    assert sent < 12, f"{sent} of 40 rows were sent"


def test_a_signal_outside_generation_still_ends_in_a_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from anex_pipeline.stages import fetch_media

    def interrupted_fetch(*args: Any) -> dict[str, int]:
        os.kill(os.getpid(), signal.SIGINT)  # Dagster's own handler is in place during this step
        time.sleep(5)  # the handler raises first
        raise AssertionError("the signal did not interrupt the step")

    monkeypatch.setattr(fetch_media, "fetch_shard", interrupted_fetch)
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(4)])
    stepping[0] = SteppingEngine()
    with local_instance() as instance:
        runner = JobRunner(instance, StorageResource(work_root=str(tmp_path / "w")), fake_engine(STEPPING))
        job = runner.submit(str(src), str(tmp_path / "out.jsonl"), {"max_tokens": 8})
        report = runner.run(job)
        runner.close()
    assert report.status == "failed" and report.failure_reason.startswith("cancelled by the user (interrupted);")
    assert stepping[0].steps == 0


@pytest.mark.subprocess
def test_a_second_signal_quits_at_once(tmp_path: Path) -> None:
    script = (
        "import os, signal, sys, time\n"
        "from anex_pipeline.workdir.manifest import JobDir\n"
        "from anex_pipeline.stopping import stopping_on_signals\n"
        "job = JobDir(sys.argv[1], 'in-0123456789')\n"
        "job.root.mkdir(parents=True)\n"
        "with stopping_on_signals(job):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(60)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 130, done.stderr
    assert done.stderr.splitlines()[0].startswith("[anex] stopping:") and "Traceback" not in done.stderr
    assert "cancelled by the user (SIGINT)" in (tmp_path / "in-0123456789" / "stop.json").read_text()


def test_a_ctrl_c_while_the_result_is_merged_merges_it_again_as_a_stopped_jobs(
    tmp_path: Path, fake_runner: JobRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row is done when the Ctrl-C lands in the last step: the command still ends with the
    job's report (no traceback) and the result published; with no row left to stop, the job
    completed."""
    from anex_pipeline import runner as runner_module

    real = JobRunner._execute
    interrupted: list[str] = []

    def execute(self: JobRunner, job_name: str, partition_key: str) -> None:
        if job_name == "finish_job" and not interrupted:
            interrupted.append(partition_key)
            raise runner_module._Interrupted()
        real(self, job_name, partition_key)

    monkeypatch.setattr(JobRunner, "_execute", execute)
    out = tmp_path / "out.jsonl"
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(4)])
    report = fake_runner.run(fake_runner.submit(str(src), str(out), {}))
    assert interrupted and report.status == "completed" and report.request_counts.completed == 4
    assert len(out.read_text().splitlines()) == 4
