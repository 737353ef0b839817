"""Retention: ``list``, ``delete`` and ``prune`` on a real Dagster home, and the Batch API's file
listing, deletion and expiry driven with the ``openai`` SDK against a served app on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import dagster as dg
import openai
import pytest

from anex_pipeline.batches.store import Store
from anex_pipeline.orchestration.definitions import build_definitions
from anex_pipeline.orchestration.job_admin import parse_age, prune
from anex_pipeline.orchestration.partitions import JOBS
from anex_pipeline.orchestration.prune_schedule import RetentionSettings
from anex_pipeline.runner import JobRunner
from anex_pipeline.testing import fake_engine
from anex_pipeline.workdir.manifest import JobDir
from anex_pipeline_tests.harness.batch_api import KEY_B, client, serving, submit, wait
from anex_pipeline_tests.harness.cli_jobs import DAY, anex, make_old, partitions_of, run_cli_job
from anex_pipeline_tests.harness.jobs import chat_row, run_job, write_jsonl


def test_delete_removes_the_work_folder_and_every_partition_key_and_keeps_the_result(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gone, gone_out = run_cli_job(tmp_path, capsys, "first")
    kept, _ = run_cli_job(tmp_path, capsys, "second")
    with dg.DagsterInstance.get() as instance:
        before = partitions_of(instance, gone)
    assert before["job|shard"] == [f"{gone}|00", f"{gone}|01"], before  # exactly the job's two shards
    assert before["generations"] and before["result_file"] and before["runs"], before

    code, listed, _ = anex(capsys, "list", "--json")
    assert code == 0
    assert [(j["job_id"], j["status"], j["rows"]) for j in json.loads(listed)] == [
        (kept, "completed", 4),
        (gone, "completed", 4),
    ]
    code, _, err = anex(capsys, "delete", gone)
    assert code == 0, err

    work = tmp_path / "work"
    assert not (work / gone).exists() and (work / kept).is_dir()
    assert gone_out.is_file() and gone_out.with_name("first.results.report.json").is_file()
    with dg.DagsterInstance.get() as instance:
        assert all(v == [] for v in partitions_of(instance, gone).values()), partitions_of(instance, gone)
        assert partitions_of(instance, kept)["job|shard"]  # the other job is untouched
    code, listed, _ = anex(capsys, "list")
    assert (
        kept in listed
        and gone not in listed
        and listed.splitlines()[0].split()
        == [
            "JOB",
            "STATUS",
            "ROWS",
            "AGE",
            "OUTPUT",
        ]
    )
    code, _, err = anex(capsys, "delete", gone)
    assert code == 2 and err.startswith(f"error: no job {gone} under") and len(err.splitlines()) == 1


def hold_lease(job: JobDir) -> subprocess.Popen[str]:
    """Another process that drives the job (holds its lease) until its stdin closes."""
    code = (
        "import sys; from anex_pipeline.workdir.lease import take_lease; "
        "from anex_pipeline.workdir.manifest import JobDir; "
        f"lease = take_lease(JobDir({str(job.root.parent)!r}, {job.job_id!r})); print('held', flush=True); "
        "sys.stdin.read()"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


@pytest.mark.subprocess
def test_prune_removes_only_old_jobs_that_are_not_running(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old, old_out = run_cli_job(tmp_path, capsys, "old")
    busy, _ = run_cli_job(tmp_path, capsys, "busy")
    new, _ = run_cli_job(tmp_path, capsys, "new")
    work = tmp_path / "work"
    make_old(work / old, 8 * DAY)
    make_old(work / busy, 8 * DAY)
    lease = hold_lease(JobDir(work, busy))
    try:
        code, listed, _ = anex(capsys, "list", "--json")
        statuses = {j["job_id"]: j["status"] for j in json.loads(listed)}
        assert statuses == {old: "completed", busy: "running", new: "completed"}
        code, out, err = anex(capsys, "delete", busy)
        assert code == 2 and "is being run by an anex-pipeline process" in err and len(err.splitlines()) == 1
        assert (work / busy).is_dir()

        code, out, _ = anex(capsys, "prune", "--older-than", "7d", "--dry-run")
        assert code == 0 and out.startswith(f"would remove job {old}: last active 8.0d ago")
        assert len(out.splitlines()) == 1 and (work / old).is_dir()
        code, out, _ = anex(capsys, "prune", "--older-than", "7d", "--json")
        assert code == 0 and [r["id"] for r in json.loads(out)] == [old]
    finally:
        assert lease.stdin is not None
        lease.stdin.close()
        lease.wait(timeout=30)
    assert not (work / old).exists() and (work / busy).is_dir() and (work / new).is_dir()
    assert old_out.is_file()
    code, _, err = anex(capsys, "prune", "--older-than", "7 weeks")
    assert code == 2 and err.startswith("error: --older-than: '7 weeks' is not an age: write a number and a unit")
    assert len(err.splitlines()) == 1


def test_ages() -> None:
    assert [parse_age(t) for t in ("90s", "15m", "12h", "7d", "1.5h")] == [90, 900, 43200, 604800, 5400]
    for bad in ("7", "d", "-1d", "7w", ""):
        with pytest.raises(ValueError):
            parse_age(bad)


def upload(sdk: openai.OpenAI, path: Path, **extra: Any) -> Any:
    with path.open("rb") as f:
        return sdk.files.create(file=f, purpose="batch", **extra)


def test_files_list_pages_filters_and_belongs_to_its_key(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("r0", "hello")])
    with serving(fake_runner) as url:
        alice, bob = client(url), client(url, KEY_B)
        mine = [upload(alice, src).id for _ in range(5)]
        theirs = upload(bob, src).id
        batch = wait(alice, submit(alice, src, {"max_tokens": 8}).id)
        assert batch.status == "completed"
        first = alice.files.list(limit=2, purpose="batch")
        assert len(first.data) == 2 and first.has_more
        newest_first = [f.id for f in first]  # the SDK follows the pages
        assert newest_first == [batch.input_file_id, *reversed(mine)]
        oldest_first = [f.id for f in alice.files.list(limit=3, order="asc", purpose="batch")]
        assert oldest_first == list(reversed(newest_first))
        assert [f.id for f in alice.files.list(purpose="batch_output")] == [batch.output_file_id]
        assert [f.id for f in bob.files.list()] == [theirs]
        with pytest.raises(openai.BadRequestError):
            alice.files.list(limit=10001)

        assert alice.files.delete(mine[0]).deleted
        with pytest.raises(openai.NotFoundError):
            alice.files.retrieve(mine[0])
        with pytest.raises(openai.NotFoundError):
            alice.files.delete(mine[0])
        with pytest.raises(openai.NotFoundError):
            bob.files.delete(mine[1])
        assert mine[0] not in [f.id for f in alice.files.list()]
        assert not Store(fake_runner.instance, fake_runner.storage.work_root).content_path(mine[0]).exists()
        assert alice.files.retrieve(mine[1]).id == mine[1]


def test_a_file_in_use_by_an_unfinished_batch_is_not_deleted(tmp_path: Path, slow_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(40)])
    with serving(slow_runner) as url:
        sdk = client(url)
        batch = submit(sdk, src, {"max_tokens": 8})
        wait(sdk, batch.id, until={"in_progress"})
        with pytest.raises(openai.BadRequestError, match=f"is the input of batch {batch.id}, which is in_progress"):
            sdk.files.delete(batch.input_file_id)
        assert sdk.files.retrieve(batch.input_file_id).id == batch.input_file_id
        sdk.batches.cancel(batch.id)
        assert wait(sdk, batch.id).status == "cancelled"
        assert sdk.files.delete(batch.input_file_id).deleted


def test_expired_files_answer_404_and_prune_removes_them_and_their_jobs(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("r0", "hello"), chat_row("r1", "world")])
    instance, work = fake_runner.instance, Path(fake_runner.storage.work_root)
    store = Store(instance, work)
    with serving(fake_runner) as url:
        sdk = client(url)
        soon = upload(sdk, src, expires_after={"anchor": "created_at", "seconds": 1})
        assert soon.expires_at == soon.created_at + 1
        later = upload(sdk, src, expires_after={"anchor": "created_at", "seconds": 3600})
        assert later.expires_at == later.created_at + 3600
        with pytest.raises(openai.BadRequestError, match=r"expires_after\.anchor"):
            upload(sdk, src, expires_after={"anchor": "last_active_at", "seconds": 3600})
        created = sdk.batches.create(
            input_file_id=later.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 7200},
        )
        batch = wait(sdk, created.id)
        assert batch.status == "completed" and batch.output_file_id
        output = sdk.files.retrieve(batch.output_file_id)
        assert output.expires_at == output.created_at + 7200
        job_id = store.batch(batch.id).job_id  # type: ignore[union-attr]
        assert job_id and (work / job_id).is_dir()

        deadline = time.monotonic() + 10  # a file past its time is gone before any prune
        while soon.id in [f.id for f in sdk.files.list()]:
            assert time.monotonic() < deadline, "the expired file is still listed"
            time.sleep(0.05)
        with pytest.raises(openai.NotFoundError):
            sdk.files.retrieve(soon.id)
        with pytest.raises(openai.NotFoundError):
            sdk.files.content(soon.id)
        assert store.content_path(soon.id).exists()  # its bytes wait for the prune

        now = time.time()
        assert [r.id for r in prune(instance, work, None, at=now)] == [soon.id]
        assert not store.content_path(soon.id).exists()
        assert prune(instance, work, None, at=now + 3601) and sdk.files.list(purpose="batch").data == []
        assert (work / job_id).is_dir()  # its output file is still there
        removed = prune(instance, work, None, at=now + 7300)
        assert [(r.kind, r.id) for r in removed] == [("file", batch.output_file_id), ("job", job_id)]
        assert not (work / job_id).exists() and job_id not in instance.get_dynamic_partitions(JOBS)
        assert not store.content_path(batch.output_file_id).exists()
        again = sdk.batches.retrieve(batch.id)  # the batch object stays, with its counts
        assert again.status == "completed" and again.request_counts and again.request_counts.completed == 2
        assert prune(instance, work, None, at=now + 7300) == []


@pytest.mark.slow
def test_the_prune_schedule_runs_prune_with_its_age_setting(tmp_path: Path, fake_runner: JobRunner) -> None:
    old = run_job(fake_runner, write_jsonl(tmp_path / "old.jsonl", [chat_row("a", "hi")]), tmp_path / "o.jsonl")
    new = run_job(fake_runner, write_jsonl(tmp_path / "new.jsonl", [chat_row("b", "hi")]), tmp_path / "n.jsonl")
    work = Path(fake_runner.storage.work_root)
    make_old(work / old.job_id, 3 * DAY)
    defs = build_definitions(fake_runner.storage, fake_engine(), retention=RetentionSettings(max_age="2d"))
    schedule = defs.resolve_schedule_def("prune_old_jobs")
    assert schedule.default_status == dg.DefaultScheduleStatus.STOPPED
    with dg.build_schedule_context(instance=fake_runner.instance) as context:
        (request,) = schedule.evaluate_tick(context).run_requests or []
    assert schedule.job_name == "prune_job"
    result = defs.resolve_job_def("prune_job").execute_in_process(instance=fake_runner.instance, tags=request.tags)
    assert result.success
    assert not (work / old.job_id).exists() and (work / new.job_id).is_dir()
    assert fake_runner.instance.get_dynamic_partitions(JOBS) == [new.job_id]
    assert (tmp_path / "o.jsonl").is_file()
