"""A disk that fills up during a job, on real small filesystems (tmpfs mounts; the tests run as
root): the command fails with a message naming the path and the lack of space, without a
traceback; the rows finished before stay in the checkpoints, whole; nothing half-written appears
at the output location; and once there is room, running the same command again finishes the job
without generating any finished row again."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anex_pipeline_tests.harness.commands import FAKE_CLI
from anex_pipeline_tests.harness.jobs import chat_row, read_jsonl, write_jsonl

ROWS = 300

Mount = Callable[[Path, str], Path]


@pytest.fixture
def small_disk() -> Iterator[Mount]:
    """Mounts a tmpfs of the given size (e.g. "64k") on a folder; unmounted after the test."""
    mounted: list[Path] = []

    def mount(path: Path, size: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", str(path)], check=True)


def cli(tmp: Path, work: Path, *args: str, delay: float = 0.0, home: Path | None = None) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "ANEX_WORK_DIR": str(work),
        "DAGSTER_HOME": str(home or tmp / "dagster"),
        "ANEX_FAKE_ROW_DELAY_S": str(delay),
    }
    command = [*FAKE_CLI, *args, "--quiet"]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def checkpoint_lines(work: Path) -> list[str]:
    return [line for p in sorted(work.glob("*/shards/*/results.jsonl")) for line in p.read_text().splitlines(True)]


def checkpoint_rows(work: Path) -> list[str]:
    """Every row appended to a Parquet job's checkpoints, as "index error-or-answer"; reading the
    files whole fails on a torn message."""
    rows = []
    for path in sorted(work.glob("*/shards/*/results.arrow")):
        table = pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
        columns = (table.column(c).to_pylist() for c in ("i", "error", "value"))
        rows += [f"{i} {e or v}" for i, e, v in zip(*columns, strict=True)]
    return rows


def job_input(tmp: Path) -> Path:
    return write_jsonl(
        tmp / "in.jsonl", [chat_row(f"r{i}", f"question number {i}", max_tokens=20) for i in range(ROWS)]
    )


def parquet_input(tmp: Path) -> Path:
    path = tmp / "in.parquet"
    pq.write_table(
        pa.table({"id": [f"r{i}" for i in range(ROWS)], "prompt": [f"question {i}" for i in range(ROWS)]}), path
    )
    return path


def fill_up_once(work: Path, proc: subprocess.Popen[str], ready: Callable[[], bool]) -> Path:
    """Waits until ``ready()`` (or the command ends), then takes every byte left on the work
    folder's disk while the shard runs; returns the file holding them."""
    deadline = time.monotonic() + 120
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return fill(work)


def fill(folder: Path) -> Path:
    """Takes every byte left on the folder's disk; returns the file holding them."""
    filler = folder / "filler"
    with filler.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def assert_one_error_line(code: int, err: str, path: Path, *words: str, exit_code: int = 1) -> str:
    """The exit code (1: the job stopped), no traceback or stack frames (Python's or Dagster's),
    and one line of error that names the path (and holds the given words); returns that line."""
    lines = err.strip().splitlines()
    assert code == exit_code, err
    assert "Traceback (most recent call last)" not in err and "Stack Trace" not in err, err
    assert not [line for line in lines if line.lstrip().startswith('File "')], err
    errors = [line for line in lines if line.startswith("error: ") or " - ERROR - " in line]
    assert errors == [lines[-1]], err
    assert str(path) in lines[-1] and all(w in lines[-1].lower() for w in words), err
    return lines[-1]


def assert_clean_failure(code: int, err: str, path: Path) -> None:
    """The failure of a full disk: one line of error that says what is full and where."""
    assert_one_error_line(code, err, path, "no space left")


@pytest.mark.subprocess
def test_full_output_location_keeps_the_rows_and_leaves_no_partial_file(tmp_path: Path, small_disk: Mount) -> None:
    src = job_input(tmp_path)
    work = tmp_path / "work"
    full = small_disk(tmp_path / "out", "64k")  # far smaller than the result
    out = full / "result.jsonl"

    code, err = finish(cli(tmp_path, work, "run", str(src), "-o", str(out), "--shards", "2"))
    assert_clean_failure(code, err, out)
    assert os.listdir(full) == []  # neither a part of the result nor a temp file
    assert len(checkpoint_lines(work)) == ROWS

    elsewhere = tmp_path / "roomy" / "result.jsonl"
    code, err = finish(cli(tmp_path, work, "run", str(src), "-o", str(elsewhere), "--shards", "2"))
    assert code == 0, err
    assert [r["custom_id"] for r in read_jsonl(elsewhere)] == [f"r{i}" for i in range(ROWS)]
    assert len(checkpoint_lines(work)) == ROWS  # the rerun generated nothing again


@pytest.mark.subprocess
def test_work_folder_filling_up_mid_shard_keeps_whole_rows_and_resumes(tmp_path: Path, small_disk: Mount) -> None:
    src = job_input(tmp_path)
    work = small_disk(tmp_path / "work", "1m")
    out = tmp_path / "out" / "result.jsonl"

    proc = cli(
        tmp_path, work, "run", str(src), "-o", str(out), "--shards", "2", "--set", "checkpoint_rows=10", delay=0.01
    )
    filler = fill_up_once(work, proc, lambda: len(checkpoint_lines(work)) >= 30)
    code, err = finish(proc)
    assert_clean_failure(code, err, work)
    kept = checkpoint_lines(work)
    assert 30 <= len(kept) < ROWS
    # A stopped job delivers its finished rows when there is room to merge them (the failed
    # append gave back its blocks): then the result holds exactly those rows, whole.
    delivered = read_jsonl(out) if out.exists() else []
    assert len(delivered) in (0, len(kept))
    assert all(line.endswith("\n") and json.loads(line)["error"] is None for line in kept)  # whole rows only

    filler.unlink()
    code, err = finish(
        cli(tmp_path, work, "run", str(src), "-o", str(out), "--shards", "2", "--set", "checkpoint_rows=10")
    )
    assert code == 0, err
    assert [r["custom_id"] for r in read_jsonl(out)] == [f"r{i}" for i in range(ROWS)]
    after = checkpoint_lines(work)
    assert len(after) == ROWS and set(kept) <= set(after)  # finished rows kept, none generated again


@pytest.mark.subprocess
def test_work_folder_filling_up_mid_shard_keeps_a_parquet_checkpoint_whole(tmp_path: Path, small_disk: Mount) -> None:
    src = parquet_input(tmp_path)
    work = small_disk(tmp_path / "work", "1m")
    out = tmp_path / "out" / "result.parquet"
    args = ("run", str(src), "-o", str(out), "--shards", "2", "--set", "checkpoint_rows=10", "--set", "max_tokens=20")

    proc = cli(tmp_path, work, *args, delay=0.01)
    filler = fill_up_once(work, proc, lambda: len(checkpoint_rows(work)) >= 30)
    code, err = finish(proc)
    assert_clean_failure(code, err, work)

    kept = checkpoint_rows(work)  # every checkpoint still reads whole
    assert 30 <= len(kept) < ROWS
    # As with JSONL: when the failed append gave back its blocks, the stopped job's finished rows
    # are delivered, and then the result holds exactly those rows.
    delivered = pq.read_table(out).num_rows if out.exists() else 0
    assert delivered in (0, len(kept))
    assert all(row.split(" ", 1)[1].startswith("answer to") for row in kept), kept[:3]  # answers, no failures

    filler.unlink()
    code, err = finish(cli(tmp_path, work, *args))
    assert code == 0, err
    assert pq.read_table(out).column("id").to_pylist() == [f"r{i}" for i in range(ROWS)]
    after = checkpoint_rows(work)
    assert len(after) == ROWS and set(kept) <= set(after)


@pytest.mark.subprocess
def test_an_unwritable_output_is_refused_before_anything_runs(tmp_path: Path, small_disk: Mount) -> None:
    src = job_input(tmp_path)
    work = tmp_path / "work"
    folder = tmp_path / "a-folder"
    folder.mkdir()
    read_only = small_disk(tmp_path / "read-only", "64k")
    subprocess.run(["mount", "-o", "remount,ro", str(read_only)], check=True)

    for out in (folder, read_only / "result.jsonl"):
        code, err = finish(cli(tmp_path, work, "run", str(src), "-o", str(out)))
        assert code == 2 and str(out) in err and "Traceback" not in err, err
        assert err.startswith("job rejected: ") and "\n  field 'output': " in err, err
    assert os.listdir(folder) == [] and os.listdir(read_only) == []
    assert checkpoint_lines(work) == []  # nothing generated


@pytest.mark.subprocess
def test_an_output_that_becomes_unwritable_is_one_line_of_error(tmp_path: Path, small_disk: Mount) -> None:
    src = job_input(tmp_path)
    work = tmp_path / "work"
    disk = small_disk(tmp_path / "out-disk", "64k")
    out = disk / "result.jsonl"
    proc = cli(tmp_path, work, "run", str(src), "-o", str(out), "--set", "checkpoint_rows=10", delay=0.01)
    deadline = time.monotonic() + 120
    while len(checkpoint_lines(work)) < 10 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)  # after the submit-time probe
    code, err = finish(proc)
    line = assert_one_error_line(code, err, out, "cannot write")
    assert "run the same command again" in line and "anex_pipeline." not in line, line
    assert os.listdir(disk) == []


@pytest.mark.subprocess
def test_a_full_disk_under_the_dagster_home_says_where_and_resumes(tmp_path: Path, small_disk: Mount) -> None:
    src = job_input(tmp_path)
    disk = small_disk(tmp_path / "disk", "4m")
    work, home = disk / "work", disk / "dagster"  # the default layout: both under one cache folder
    out = tmp_path / "out" / "result.jsonl"
    args = ("run", str(src), "-o", str(out), "--shards", "2", "--set", "checkpoint_rows=10")

    proc = cli(tmp_path, work, *args, delay=0.01, home=home)
    filler = fill_up_once(disk, proc, lambda: len(checkpoint_lines(work)) >= 30)
    code, err = finish(proc)
    line = assert_one_error_line(code, err, disk, "no space left")
    assert "run the same command again" in line, line
    assert not [x for x in err.splitlines() if x != line and ("sqlite" in x.lower() or "disk is full" in x)], err
    assert not out.exists()

    filler.unlink()
    code, err = finish(cli(tmp_path, work, *args, home=home))
    assert code == 0, err
    assert [r["custom_id"] for r in read_jsonl(out)] == [f"r{i}" for i in range(ROWS)]


@pytest.mark.subprocess
def test_a_new_dagster_home_on_a_full_disk_is_one_line_before_anything_runs(tmp_path: Path, small_disk: Mount) -> None:
    src = job_input(tmp_path)
    disk = small_disk(tmp_path / "disk", "4m")
    home, out = disk / "dagster", tmp_path / "out" / "result.jsonl"
    filler = fill(disk)

    code, err = finish(cli(tmp_path, tmp_path / "work", "run", str(src), "-o", str(out), home=home))
    line = assert_one_error_line(code, err, home, "no space left", exit_code=2)  # nothing ran
    assert "DAGSTER_HOME" in line

    filler.unlink()  # the home that was begun is usable once there is room
    code, err = finish(cli(tmp_path, tmp_path / "work", "run", str(src), "-o", str(out), home=home))
    assert code == 0, err
    assert len(read_jsonl(out)) == ROWS
