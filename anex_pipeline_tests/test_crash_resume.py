"""A job killed with SIGKILL in the middle of generation finishes on the next run, keeps every row
it had finished, and ends with the same result as a run that was never interrupted."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anex_pipeline.formats import arrow_checkpoint
from anex_pipeline_tests.harness.commands import FAKE_CLI
from anex_pipeline_tests.harness.jobs import chat_row, read_jsonl, write_jsonl

ROWS = 900


def cli(tmp: Path, *args: str, delay: float = 0.0) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "ANEX_WORK_DIR": str(tmp / "work"),
        "DAGSTER_HOME": str(tmp / "dagster"),
        "ANEX_FAKE_ROW_DELAY_S": str(delay),
    }
    command = [*FAKE_CLI, *args, "--quiet"]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def checkpoint_lines(tmp: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in (tmp / "work").glob("*/shards/*/results.jsonl"))


def answers(path: Path) -> list[tuple[str, str]]:
    return [(r["custom_id"], r["response"]["body"]["choices"][0]["message"]["content"]) for r in read_jsonl(path)]


@pytest.mark.subprocess
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_then_rerun_equals_an_uninterrupted_run(tmp_path: Path, seed: int) -> None:
    rows = [chat_row(f"r{i}", f"question {i}", max_tokens=20) for i in range(ROWS)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)

    reference = cli(tmp_path / "ref", "run", str(src), "-o", str(tmp_path / "ref.jsonl"), "--shards", "3")
    assert reference.wait(timeout=300) == 0, reference.stderr.read() if reference.stderr else ""

    out = tmp_path / "out.jsonl"
    victim = cli(tmp_path, "run", str(src), "-o", str(out), "--shards", "3", delay=0.004)
    deadline = time.monotonic() + 120
    while checkpoint_lines(tmp_path) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(random.Random(seed).uniform(0.0, 2.0))
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    finished_before = checkpoint_lines(tmp_path)
    assert finished_before > 0
    assert not out.exists() or len(read_jsonl(out)) == ROWS  # never a half-written result

    rerun = cli(tmp_path, "run", str(src), "-o", str(out), "--shards", "3")
    assert rerun.wait(timeout=300) == 0, rerun.stderr.read() if rerun.stderr else ""
    assert json.loads(Path(str(out).replace(".jsonl", ".report.json")).read_text())["status"] == "completed"
    assert answers(out) == answers(tmp_path / "ref.jsonl")
    # The checkpoints only grew by the rows that were missing: nothing finished was generated again.
    assert checkpoint_lines(tmp_path) == ROWS


@pytest.mark.subprocess
def test_sigkill_of_a_parquet_job_then_rerun_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    src = tmp_path / "in.parquet"
    pq.write_table(
        pa.table({"id": [f"r{i}" for i in range(ROWS)], "prompt": [f"question {i}" for i in range(ROWS)]}), src
    )
    args = ("--shards", "3", "--set", "max_tokens=20")

    reference = cli(tmp_path / "ref", "run", str(src), "-o", str(tmp_path / "ref.parquet"), *args)
    assert reference.wait(timeout=300) == 0, reference.stderr.read() if reference.stderr else ""

    def appended_rows() -> int:
        paths = (tmp_path / "work").glob("*/shards/*/results.arrow")
        return sum(batch.num_rows for path in paths for batch in arrow_checkpoint.whole_batches(path))

    out = tmp_path / "out.parquet"
    victim = cli(tmp_path, "run", str(src), "-o", str(out), *args, delay=0.004)
    deadline = time.monotonic() + 120
    while appended_rows() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(random.Random(4).uniform(0.0, 2.0))
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    assert appended_rows() > 0
    assert not out.exists() or pq.read_table(out).num_rows == ROWS

    rerun = cli(tmp_path, "run", str(src), "-o", str(out), *args)
    assert rerun.wait(timeout=300) == 0, rerun.stderr.read() if rerun.stderr else ""
    assert pq.read_table(out).to_pylist() == pq.read_table(tmp_path / "ref.parquet").to_pylist()
    assert appended_rows() == ROWS  # nothing finished was generated again
