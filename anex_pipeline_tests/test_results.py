"""`anex-pipeline results`: the rows a job has finished so far, in input order and in the job's
format, read from copies of the shard checkpoints taken between two appends
(stages/merge_partial.py); a writer appending all the while never shows a torn, doubled or
taken-back row."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anex_pipeline import cli
from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.options import job_options
from anex_pipeline.spec import RowError
from anex_pipeline.stages.merge_partial import write_finished_rows
from anex_pipeline.stages.submit import prepare_job
from anex_pipeline.testing import FakeEngine
from anex_pipeline.workdir.manifest import JobDir
from anex_pipeline.workdir.shard_owner import ShardOwner
from anex_pipeline_tests.harness.commands import FAKE_CLI
from anex_pipeline_tests.harness.jobs import chat_row, read_jsonl, write_jsonl


def _job(tmp_path: Path, rows: int, fmt: str = "jsonl", shards: int = 3) -> JobDir:
    if fmt == "jsonl":
        src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(rows)])
    else:
        src = tmp_path / "in.parquet"
        pq.write_table(pa.table({"id": [f"r{i}" for i in range(rows)], "prompt": [f"q {i}" for i in range(rows)]}), src)
    options = job_options({"shards": shards, "max_tokens": 8})
    return prepare_job(src, str(tmp_path / f"out.{fmt}"), options, tmp_path / "work", local_model=False)


def _finish(job: JobDir, indices: list[int], owner: ShardOwner | None = None, fail: bool = False) -> None:
    """Writes the fake engine's answers (or an engine error) for rows ``indices`` to their shard, as a run does."""
    manifest = job.manifest()
    by_shard: dict[int, list[int]] = {}
    for i in indices:
        shard = next(n for n, rng in enumerate(manifest.shards) if rng.start <= i < rng.stop)
        by_shard.setdefault(shard, []).append(i)
    for shard, rows in by_shard.items():
        requests = {r.index: r for r in job.read_requests(shard)}
        asked = [EngineRequest(i, requests[i].key, f"req-{i}", "chat", requests[i].body, max_tokens=8) for i in rows]
        done = FakeEngine().run(asked)
        if fail:
            for o in done:
                o.body, o.status_code = None, 500
                o.error = RowError(message="engine fell over", type="engine_error")
        writer = owner or ShardOwner.claim(job.shard_dir(shard), shard)
        with writer.writing():
            job.record_outcomes(shard, done)


def _keys(path: Path) -> list[str]:
    if path.suffix == ".parquet":
        return [str(k) for k in pq.read_table(path).column("id").to_pylist()]
    return [line["custom_id"] for line in read_jsonl(path)]


def test_finished_rows_come_in_input_order_and_the_rest_is_left_out_or_marked(tmp_path: Path) -> None:
    job = _job(tmp_path, 30)
    _finish(job, [25, 3, 4, 11, 0, 12])
    _finish(job, [7], fail=True)
    out = tmp_path / "so-far.jsonl"
    counts = write_finished_rows(job, out)
    assert _keys(out) == ["r0", "r3", "r4", "r7", "r11", "r12", "r25"]
    assert (counts.completed, counts.failed, counts.pending) == (6, 1, 23)
    lines = read_jsonl(out)
    assert lines[3]["error"]["message"] == "engine fell over" and lines[0]["error"] is None

    marked = tmp_path / "marked.jsonl"
    write_finished_rows(job, marked, pending=True)
    rows = read_jsonl(marked)
    assert [r["custom_id"] for r in rows] == [f"r{i}" for i in range(30)]
    assert rows[1] == {
        "id": "batch_req_r1",
        "custom_id": "r1",
        "response": None,
        "error": {"message": "the row has not run yet", "type": "pending", "code": None, "param": None},
    }
    assert rows[3] == lines[1]  # a finished row is the same line either way


def test_a_parquet_job_gives_its_finished_rows_as_parquet(tmp_path: Path) -> None:
    job = _job(tmp_path, 20, "parquet")
    _finish(job, [19, 2, 8])
    out = tmp_path / "so-far.parquet"
    write_finished_rows(job, out)
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == ["r2", "r8", "r19"]
    assert all(isinstance(v, str) and v for v in table.column("output").to_pylist())

    marked = tmp_path / "marked.parquet"
    counts = write_finished_rows(job, marked, pending=True)
    table = pq.read_table(marked)
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(20)]
    kinds = table.column("error_type").to_pylist()
    assert [i for i, k in enumerate(kinds) if k != "pending"] == [2, 8, 19]
    assert (counts.completed, counts.failed, counts.pending) == (3, 0, 17)


def test_reads_while_a_writer_appends_only_grow_and_never_repeat_a_row(tmp_path: Path) -> None:
    """A writer appends the job's rows in chunks (shards out of order, a failed row answered again
    later) while reads go on: each read is in input order with no row twice, holds every row of
    the read before, and the last equals the merge of the whole checkpoints."""
    job = _job(tmp_path, 300, shards=2)
    order = [*range(150, 300), *range(0, 150)]
    written = threading.Event()
    first_chunk = threading.Event()

    def writer() -> None:
        for n in range(0, len(order), 10):
            _finish(job, order[n : n + 10], fail=n == 20)
            first_chunk.set()
        _finish(job, order[20:30])  # the failed chunk, answered now
        written.set()

    thread = threading.Thread(target=writer)
    thread.start()
    first_chunk.wait(30)
    reads: list[list[str]] = []
    while not written.is_set() or len(reads) < 2:
        out = tmp_path / f"read-{len(reads)}.jsonl"
        write_finished_rows(job, out)
        lines = out.read_bytes().split(b"\n")
        assert lines[-1] == b""  # ends on a whole line
        keys = [json.loads(line)["custom_id"] for line in lines[:-1]]
        indices = [int(k[1:]) for k in keys]
        assert indices == sorted(set(indices))
        assert set(reads[-1] if reads else []) <= set(keys)
        reads.append(keys)
    thread.join()
    final = tmp_path / "final.jsonl"
    write_finished_rows(job, final)
    assert _keys(final) == [f"r{i}" for i in range(300)]
    assert all(line["error"] is None for line in read_jsonl(final))


@pytest.mark.parametrize(
    "args, said",
    [
        (["results", "no-such-job", "-o", "x.jsonl"], "no job no-such-job under"),
        (["results", "../escape", "-o", "x.jsonl"], "cannot name a job folder"),
        (["results", "logs", "-o", "x.jsonl"], "the commands' log folder of the work root"),
    ],
)
def test_results_of_a_job_that_does_not_exist_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    code = cli.main([*args, "--work-dir", str(tmp_path / "work")])
    err = capsys.readouterr().err
    assert code == 2
    assert said in err and len(err.strip().splitlines()) == 1


def test_results_command_writes_the_rows_and_says_how_many(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = _job(tmp_path, 12)
    _finish(job, [5, 1])
    work = ["--work-dir", str(tmp_path / "work")]
    out = tmp_path / "got" / "so-far.jsonl"
    assert cli.main(["results", job.job_id, "-o", str(out), *work]) == 0
    assert "2 of 12 rows finished (2 completed, 0 failed), 10 not run yet (left out)" in capsys.readouterr().err
    assert _keys(out) == ["r1", "r5"]
    assert cli.main(["results", job.job_id, "-o", str(tmp_path / "so-far.parquet"), *work]) == 2
    assert "is a JSONL job: name a .jsonl file with -o" in capsys.readouterr().err
    assert cli.main(["results", job.job_id, "-o", str(job.root / "x.jsonl"), *work]) == 2
    assert "inside the work folder" in capsys.readouterr().err


@pytest.mark.subprocess
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_after_a_sigkill_mid_shard_results_gives_exactly_the_checkpointed_rows(tmp_path: Path, fmt: str) -> None:
    rows = 600
    if fmt == "jsonl":
        src = write_jsonl(
            tmp_path / "in.jsonl", [chat_row(f"r{i}", f"question {i}", max_tokens=8) for i in range(rows)]
        )
    else:
        src = tmp_path / "in.parquet"
        pq.write_table(pa.table({"id": [f"r{i}" for i in range(rows)], "prompt": [f"q {i}" for i in range(rows)]}), src)
    env = {**os.environ, "ANEX_WORK_DIR": str(tmp_path / "work"), "DAGSTER_HOME": str(tmp_path / "dagster")}
    args = ["--shards", "2", "--set", "max_tokens=8", "--set", "checkpoint_rows=16", "--quiet"]
    victim = subprocess.Popen(
        [*FAKE_CLI, "run", str(src), "-o", str(tmp_path / f"out.{fmt}"), *args],
        env={**env, "ANEX_FAKE_ROW_DELAY_S": "0.01"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    checkpoint = "results.jsonl" if fmt == "jsonl" else "results.arrow"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(
        p.stat().st_size > 4096 for p in (tmp_path / "work").glob(f"*/shards/*/{checkpoint}")
    ):
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    (job_root,) = [p for p in (tmp_path / "work").iterdir() if (p / "job.json").exists()]
    job = JobDir(tmp_path / "work", job_root.name)
    checkpointed = sorted(o.i for n in range(2) for o in job.outcomes(n))
    assert 0 < len(checkpointed) < rows

    out = tmp_path / f"so-far.{fmt}"
    done = subprocess.run(
        [*FAKE_CLI, "results", job.job_id, "-o", str(out)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert _keys(out) == [f"r{i}" for i in checkpointed]
