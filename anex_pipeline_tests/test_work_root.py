"""Only jobs are ever touched under the work root: ``delete``, ``list``, ``prune`` and the prune
schedule against the work root's own folders, other data, and job folders that cannot be read;
results refused inside the work root; a resume's lease taken before prune can remove the job; and
the command's own process on a closed stdout and a double Ctrl-C."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from anex_pipeline.batches.store import Store
from anex_pipeline.orchestration.definitions import build_definitions
from anex_pipeline.orchestration.job_admin import JobEntry, JobRunning, delete_job, prune, table
from anex_pipeline.orchestration.partitions import JOBS
from anex_pipeline.orchestration.prune_schedule import RetentionSettings
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobRejected, JobReport
from anex_pipeline.testing import fake_engine
from anex_pipeline.workdir import layout
from anex_pipeline.workdir.lease import lease_held, take_lease, try_lease
from anex_pipeline.workdir.manifest import JobDir
from anex_pipeline_tests.harness.batch_api import client, serving, submit, wait_for_rows
from anex_pipeline_tests.harness.cli_jobs import DAY, anex, make_old, partitions_of, run_cli_job
from anex_pipeline_tests.harness.fake_cli import SLOW_FAKE
from anex_pipeline_tests.harness.jobs import REPO, chat_row, local_instance, write_jsonl

# The installed command's own entry point (``anex-pipeline``), in a process of its own.
COMMAND = [sys.executable, "-m", "anex_pipeline.cli"]


def command_env(tmp_path: Path, **more: str) -> dict[str, str]:
    return {
        **os.environ,
        "DAGSTER_HOME": str(tmp_path / "home"),
        "ANEX_WORK_DIR": str(tmp_path / "work"),
        "PYTHONPATH": str(REPO),
        **more,
    }


def anex_process(tmp_path: Path, *args: str, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real command in its own process (``prefix`` runs it under another program)."""
    return subprocess.run(
        [*(prefix or []), *COMMAND, *args],
        env=command_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )


def other_data(work: Path) -> dict[str, Path]:
    """Folders that are not jobs, each with a file in it: the work root's own folders with what
    the product keeps there, and someone else's data (one folder with a job.json of its own)."""
    folders = {
        "batch-api": "files/file-abc",
        "logs": "run-1.log",
        "inputs": "0123/in.jsonl",
        "photos": "cat.jpg",
        "notes": layout.MANIFEST,
    }
    made = {}
    for name, inside in folders.items():
        path = work / name / inside
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('{"not": "a manifest"}')
        made[name] = path
    return made


@pytest.mark.subprocess
def test_delete_refuses_every_folder_that_is_not_a_job(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job_id, out = run_cli_job(tmp_path, capsys, "kept")
    work = tmp_path / "work"
    data = other_data(work)
    # The exact case found: the Batch API's folder, through the installed command in its own process.
    done = anex_process(tmp_path, "delete", "batch-api")
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "error: batch-api is the Batch API's folder of the work root, not a job; `anex-pipeline list` shows the jobs\n"
    )
    for name in data:
        code, _, err = anex(capsys, "delete", name)
        assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, (name, err)
    assert "notes has a job.json that is cut short or not a job's manifest, so it is not deleted" in err
    assert all(path.is_file() for path in data.values()), "a folder that is not a job was touched"
    with dg.DagsterInstance.get() as instance:
        assert instance.has_dynamic_partition(JOBS, job_id)

    # A copy of a job under another name has a manifest, but not its own: it is no job either.
    copy = work / "copied"
    copy.mkdir()
    (copy / layout.MANIFEST).write_bytes((work / job_id / layout.MANIFEST).read_bytes())
    code, _, err = anex(capsys, "delete", "copied")
    assert code == 2 and f"has the manifest of another job ({job_id})" in err and copy.is_dir()

    code, _, err = anex(capsys, "delete", job_id)
    assert code == 0 and not (work / job_id).exists() and out.is_file()


def test_a_jobs_partition_named_after_the_work_roots_own_folder_is_refused(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    work = tmp_path / "work"
    (work / "batch-api" / "files").mkdir(parents=True)
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("r0", "hello")])
    defs = build_definitions(StorageResource(work_root=str(work)), fake_engine())
    instance.add_dynamic_partitions(JOBS, ["batch-api"])  # what a UI user may type in the launchpad
    config = {"input": str(src), "output": str(tmp_path / "out.jsonl")}
    result = defs.resolve_job_def("submit_job").execute_in_process(
        instance=instance,
        partition_key="batch-api",
        run_config={"ops": {"validated_input": {"config": config}}},
        raise_on_error=False,
    )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    error = failure.step_failure_data.error  # type: ignore[union-attr]
    assert error is not None and error.cls_name == "Failure", error
    assert "batch-api is the Batch API's folder of the work root, not a job; add a key of its own" in error.message
    assert sorted(p.name for p in (work / "batch-api").iterdir()) == ["files"]


@pytest.mark.slow
def test_on_a_work_root_of_other_data_prune_and_its_schedule_touch_only_jobs(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job_id, _ = run_cli_job(tmp_path, capsys, "old")
    work = tmp_path / "work"
    data = other_data(work)
    make_old(work, 40 * DAY)
    notes = f"skipped {work / 'notes'}: it has a job.json that is cut short or not a job's manifest\n"
    code, listed, err = anex(capsys, "list", "--json")
    assert code == 0 and [j["job_id"] for j in json.loads(listed)] == [job_id] and err == notes
    code, out, err = anex(capsys, "prune", "--older-than", "1d")
    assert code == 0 and out.splitlines() == [f"removed job {job_id}: last active 40.0d ago"] and err == notes
    assert all(path.is_file() for path in data.values())

    again, _ = run_cli_job(tmp_path, capsys, "again")
    make_old(work / again, 40 * DAY)
    with dg.DagsterInstance.get() as instance:
        storage = StorageResource(work_root=str(work))
        defs = build_definitions(storage, fake_engine(), retention=RetentionSettings(max_age="1d"))
        assert defs.resolve_job_def("prune_job").execute_in_process(instance=instance).success
        assert not instance.has_dynamic_partition(JOBS, again)
    assert not (work / again).exists()
    assert all(path.is_file() for path in data.values())


@pytest.mark.subprocess
def test_bad_job_folders_are_skipped_and_reported_and_the_rest_go_on(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "work"
    cut, _ = run_cli_job(tmp_path, capsys, "cut")
    locked, _ = run_cli_job(tmp_path, capsys, "locked")
    linked, _ = run_cli_job(tmp_path, capsys, "linked")
    fine, _ = run_cli_job(tmp_path, capsys, "fine")
    manifest = work / cut / layout.MANIFEST
    manifest.write_bytes(manifest.read_bytes()[:40])  # a job.json cut short
    (work / linked).rename(tmp_path / "elsewhere")  # the job's folder moved and linked back
    (work / linked).symlink_to(tmp_path / "elsewhere")
    for job in (cut, locked, linked, fine):
        make_old(work / job, 8 * DAY)
    (work / locked).chmod(0)  # unreadable for anyone without the capability to override it
    try:
        # Root reads any folder: the command runs without that capability, as another user would.
        no_override = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]
        listed = anex_process(tmp_path, "list", prefix=no_override)
        assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
        assert [line.split()[0] for line in listed.stdout.splitlines()] == ["JOB", fine]
        assert sorted(listed.stderr.splitlines()) == sorted(
            [
                f"skipped {work / cut}: it has a job.json that is cut short or not a job's manifest",
                f"skipped {work / linked}: it is a symbolic link (to {tmp_path / 'elsewhere'}); jobs are only read "
                "and removed in real folders",
                f"skipped {work / locked}: it cannot be read (Permission denied)",
            ]
        )
        pruned = anex_process(tmp_path, "prune", "--older-than", "7d", prefix=no_override)
        assert pruned.returncode == 0 and pruned.stdout == f"removed job {fine}: last active 8.0d ago\n", pruned
        assert len(pruned.stderr.splitlines()) == 3 and "Traceback" not in pruned.stderr
        work.chmod(0)  # the work root itself unreadable: one line, not a traceback
        listed = anex_process(tmp_path, "list", prefix=no_override)
        assert listed.returncode == 2 and listed.stderr.splitlines() == [
            f"error: cannot read the work root {work}: Permission denied; make it readable, or set ANEX_WORK_DIR "
            "(or --work-dir) to the folder the jobs ran with"
        ], listed.stderr
    finally:
        work.chmod(0o755)
        (work / locked).chmod(0o755)
    assert not (work / fine).exists() and all((work / job).exists() for job in (cut, locked, linked))

    # A symlinked job folder is never half-deleted: refused before its runs or keys are touched.
    with dg.DagsterInstance.get() as instance:
        before = partitions_of(instance, linked)
    code, _, err = anex(capsys, "delete", linked)
    assert code == 2 and len(err.splitlines()) == 1 and "is a symbolic link" in err
    assert (tmp_path / "elsewhere" / layout.MANIFEST).is_file() and (work / linked).is_symlink()
    with dg.DagsterInstance.get() as instance:
        assert partitions_of(instance, linked) == before and before["runs"]


def test_ages_of_jobs_seconds_old_are_never_negative() -> None:
    at = time.time()
    entry = JobEntry("job-1", "completed", 3, at + 0.4, "/tmp/out.jsonl")  # stamped just after the clock was read
    assert table([entry], at).splitlines()[1].split()[3] == "0s"
    assert entry.as_json(at)["age_s"] == 0.0


@pytest.mark.subprocess
def test_an_output_or_report_inside_the_work_root_is_refused_at_submit(tmp_path: Path) -> None:
    work = tmp_path / "work"
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("r0", "hello")])
    (tmp_path / "to-work").symlink_to(work, target_is_directory=True)
    work.mkdir()
    for output, extra in [
        (work / "in-0123456789" / "delivered.jsonl", []),
        (tmp_path / "to-work" / "results.jsonl", []),
        (tmp_path / "results.jsonl", ["--report", str(work / "results.report.json")]),
    ]:
        done = anex_process(tmp_path, "run", str(src), "-o", str(output), *extra)
        assert done.returncode == 2, done.stderr
        problems = [line for line in done.stderr.splitlines() if line.startswith("  ")]
        field = "report" if extra else "output"
        assert len(problems) == 1 and f"inside the work folder {work}" in problems[0], done.stderr
        assert problems[0].strip().startswith(f"field '{field}': {extra[1] if extra else output} is inside")
        assert not output.exists() and "Traceback" not in done.stderr
    assert sorted(p.name for p in work.iterdir()) == [layout.LOGS_DIR], "a refused job left work behind"


def test_a_refused_job_leaves_no_folder_in_the_work_root(tmp_path: Path, fake_runner: JobRunner) -> None:
    work = Path(fake_runner.storage.work_root)
    bad = write_jsonl(tmp_path / "bad.jsonl", [chat_row("r0", "hello"), '{"custom_id": "r1", "body": '])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    for src, why in [(bad, "line 2"), (empty, "has no rows")]:
        with pytest.raises(JobRejected, match=why):
            fake_runner.submit(str(src), str(tmp_path / "out.jsonl"), {})
    assert not work.exists() or list(work.iterdir()) == []
    assert fake_runner._leases == {}  # no lease kept for a job nobody drives


@pytest.mark.subprocess
def test_delete_refuses_the_job_of_an_unfinished_batch_after_serve_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANEX_FAKE_ROW_DELAY_S", "0.1")
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(30)])
    work = tmp_path / "work"
    home_dir = tmp_path / "home"
    home_dir.mkdir()
    with local_instance(str(home_dir), set_dagster_home=True) as instance:
        runner = JobRunner(instance, StorageResource(work_root=str(work)), fake_engine(SLOW_FAKE))
        with serving(runner) as url:
            sdk = client(url)
            batch = submit(sdk, src, {"max_tokens": 8, "checkpoint_rows": 2})
            wait_for_rows(sdk, batch.id, 4)
        runner.close()
        job_id = Store(instance, work).batch(batch.id).job_id  # type: ignore[union-attr]
    assert job_id is not None
    done = anex_process(tmp_path, "delete", job_id)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert f"runs Batch API batch {batch.id}, which is in_progress" in done.stderr
    assert (work / job_id / layout.MANIFEST).is_file()
    with local_instance(str(home_dir)) as instance:
        assert instance.has_dynamic_partition(JOBS, job_id)


class _Paused:
    """Stops the thread that submits a job where ``prepare_job`` first looks for the job's
    manifest, until the test lets it go on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.reached, self.go = threading.Event(), threading.Event()
        self.thread: threading.Thread | None = None
        exists = JobDir.exists

        def pausing(job: JobDir) -> bool:
            if threading.current_thread() is self.thread and not self.reached.is_set():
                self.reached.set()
                assert self.go.wait(30)
            return exists(job)

        monkeypatch.setattr(JobDir, "exists", pausing)


def test_prune_cannot_remove_a_job_whose_resume_is_being_prepared(
    tmp_path: Path, fake_runner: JobRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(6)])
    out = tmp_path / "out.jsonl"
    work = Path(fake_runner.storage.work_root)
    job = fake_runner.submit(str(src), str(out), {"max_tokens": 8, "shards": 2})
    fake_runner.run(job, shards=[0])  # half done: the resume keeps shard 0
    make_old(job.root, 8 * DAY)
    paused = _Paused(monkeypatch)
    resumed: dict[str, JobReport] = {}

    def resume() -> None:
        again = fake_runner.submit(str(src), str(out), {"max_tokens": 8, "shards": 2})
        resumed["report"] = fake_runner.run(again)

    paused.thread = threading.Thread(target=resume)
    paused.thread.start()
    assert paused.reached.wait(30)
    try:
        removed = prune(fake_runner.instance, work, 7 * DAY)
    finally:
        paused.go.set()
        paused.thread.join(60)
    assert removed == [] and job.exists()
    report = resumed["report"]
    assert report.status == "completed" and report.request_counts.completed == 6


def test_a_lease_taken_while_the_job_is_deleted_is_on_the_new_folder(tmp_path: Path) -> None:
    job = JobDir(tmp_path / "work", "job-1")
    deleting = try_lease(job)
    assert deleting is not None
    waiting = threading.Event()

    class Notice(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            waiting.set()

    progress = logging.getLogger("anex_pipeline.progress")
    notice = Notice()
    progress.addHandler(notice)
    taken: list[object] = []
    thread = threading.Thread(target=lambda: taken.append(take_lease(job)))
    try:
        thread.start()
        assert waiting.wait(30), "the second lease did not wait for the first"
        shutil.rmtree(job.root)  # as delete_job does while it holds the lease
        deleting.close()
        thread.join(30)
    finally:
        progress.removeHandler(notice)
    (lease,) = taken
    assert lease_held(job), "the lease taken is on a file that no longer exists"
    lease.close()  # type: ignore[attr-defined]


@pytest.mark.subprocess
def test_a_closed_stdout_ends_list_without_a_traceback(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_cli_job(tmp_path, capsys, "one")
    proc = subprocess.Popen(
        [*COMMAND, "list"], env=command_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before anything is written (`list | head` once head has its lines)
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 1 and err == "", err


@pytest.fixture
def slow_exit(tmp_path: Path) -> Iterator[list[str]]:
    """The command with one more exit handler that takes seconds, standing for the clean-up of
    Dagster's SQLAlchemy pools that a Ctrl-C can land in; it says when it starts."""
    yield [
        sys.executable,
        "-c",
        "import atexit, sys, time\n"
        "def slow():\n"
        "    print('exiting', file=sys.stderr, flush=True)\n"
        "    time.sleep(20)\n"
        "atexit.register(slow)\n"
        "import anex_pipeline_tests.harness.fake_cli\n"
        "from anex_pipeline.cli import entry\n"
        "entry()\n",
    ]


def _wait_line(stream: object, wanted: str, timeout: float = 60) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()  # type: ignore[attr-defined]
        assert line, f"the command ended before it wrote {wanted!r}: {lines}"
        lines.append(line)
        if wanted in line:
            return lines
    raise AssertionError(f"no {wanted!r} within {timeout} s: {lines}")


@pytest.mark.subprocess
def test_a_double_ctrl_c_prints_no_traceback(tmp_path: Path, slow_exit: list[str]) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(40)])
    env = command_env(tmp_path, ANEX_ENGINE=SLOW_FAKE, ANEX_FAKE_ROW_DELAY_S="0.2")
    args = ["run", str(src), "-o", str(tmp_path / "out.jsonl"), "--max-tokens", "8"]
    proc = subprocess.Popen(
        slow_exit + args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stderr is not None
    try:
        seen = _wait_line(proc.stderr, "0/40 rows")
        os.killpg(proc.pid, signal.SIGINT)  # the first stops the job gently
        seen += _wait_line(proc.stderr, "exiting")  # the job is stopped and delivered; the exit handlers run
        os.killpg(proc.pid, signal.SIGINT)  # the second lands in an exit handler
        started = time.monotonic()
        rest = proc.stderr.read()
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = "".join(seen) + rest
    assert code == 130 and time.monotonic() - started < 10, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert rest.endswith("stopped at once; rerun the same command to resume\n"), stderr

    # One Ctrl-C that arrives during the exit handlers is taken quietly; the command still ends.
    proc = subprocess.Popen([*slow_exit, "list"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    _wait_line(proc.stderr, "exiting")
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(30) == 0 and rest == "", rest


def test_delete_and_prune_refuse_a_running_job_as_before(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("r0", "hello")])
    job = fake_runner.submit(str(src), str(tmp_path / "out.jsonl"), {})  # the runner holds the lease until run ends
    with pytest.raises(JobRunning, match="is being run by an anex-pipeline process"):
        delete_job(fake_runner.instance, job)
    fake_runner.run(job)
    delete_job(fake_runner.instance, job)
    assert not job.root.exists()
