"""Parquet jobs' column checkpoints: a torn append cut at any byte keeps every whole chunk before
it and is cut off by the next append; a failed write leaves the file as it was; the last row
written wins; and the column-wise merge gives the same report and answers as the row-by-row JSONL
merge of the same outcomes."""

from __future__ import annotations

import errno
import json
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anex_pipeline.formats import arrow_checkpoint, parquet
from anex_pipeline.spec import JobOptions, RowError, RowOutcome
from anex_pipeline.stages.merge import merge_job
from anex_pipeline.stages.submit import prepare_job
from anex_pipeline.workdir.manifest import JobDir
from anex_pipeline_tests.harness.jobs import chat_row, read_jsonl, write_jsonl


def answer(i: int, text: str | None = None, **fields: object) -> RowOutcome:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text or f"answer {i}"}}]}
    usage = {"prompt_tokens": 5 + i % 3, "completion_tokens": 1 + i % 7, "cached_prompt_tokens": i % 2}
    return RowOutcome(i, str(i), 200, body=body, usage=usage, **fields)  # type: ignore[arg-type]


def failure(i: int, kind: str = "engine_error") -> RowOutcome:
    return RowOutcome(i, str(i), 500, error=RowError(message=f"row {i} failed", type=kind), usage={"prompt_tokens": 2})


def latest(path: Path, window: int | None = None) -> pa.Table:
    tables = list(arrow_checkpoint.latest(path, "chat", window))
    assert all(0 < t.num_rows <= (window or arrow_checkpoint.WINDOW_ROWS) for t in tables)
    return pa.concat_tables(tables) if tables else arrow_checkpoint.schema("chat").empty_table()


def indices(path: Path) -> list[int]:
    return latest(path).column("i").to_pylist()


@pytest.mark.slow
def test_a_torn_append_at_any_byte_keeps_the_chunks_before_it(tmp_path: Path) -> None:
    path = tmp_path / "results.arrow"
    arrow_checkpoint.append(path, [answer(0), answer(1)], "chat")
    arrow_checkpoint.append(path, [answer(2)], "chat")
    whole = path.read_bytes()
    arrow_checkpoint.append(path, [answer(3, "torn")], "chat")
    full = path.read_bytes()
    for cut in range(len(whole), len(full)):  # a writer killed after writing `cut` bytes
        path.write_bytes(full[:cut])
        arrow_checkpoint._known_ends.clear()  # as in the next process
        assert indices(path) == [0, 1, 2], cut
        arrow_checkpoint.append(path, [answer(4)], "chat")
        assert indices(path) == [0, 1, 2, 4], cut
    for cut in range(len(whole)):  # torn inside the schema or the first chunks
        path.write_bytes(full[:cut])
        arrow_checkpoint._known_ends.clear()
        arrow_checkpoint.append(path, [answer(4)], "chat")
        assert set(indices(path)) <= {0, 1, 2, 4} and 4 in indices(path), cut


def test_a_failed_write_is_cut_back_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "results.arrow"
    arrow_checkpoint.append(path, [answer(0)], "chat")
    before = path.read_bytes()

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left") as caught:
        arrow_checkpoint.append(path, [answer(1)], "chat")
    assert caught.value.filename == str(path)
    assert path.read_bytes() == before
    monkeypatch.undo()
    arrow_checkpoint.append(path, [answer(2)], "chat")
    assert indices(path) == [0, 2]


def test_the_last_row_written_for_an_index_wins(tmp_path: Path) -> None:
    path = tmp_path / "results.arrow"
    arrow_checkpoint.append(path, [answer(5), failure(3), answer(4)], "chat")
    arrow_checkpoint.append(path, [answer(3, "rerun"), failure(5)], "chat")
    arrow_checkpoint.append(path, [answer(5, "rerun again")], "chat")
    for window in (1, 2, 3, 100):  # read a window of rows at a time
        table = latest(path, window)
        assert table.column("i").to_pylist() == [3, 4, 5]
        assert table.column("value").to_pylist() == ["rerun", "answer 4", "rerun again"]
    assert latest(tmp_path / "missing.arrow").num_rows == 0


def outcomes_of_a_messy_run(rows: int, seed: int) -> list[list[RowOutcome]]:
    """Chunks as reruns leave them: failures, length and format flags, copies, a stray sample,
    reruns out of order, and some rows never finished."""
    rng = random.Random(seed)
    chunks: list[list[RowOutcome]] = [[answer(i) for i in rng.sample(range(rows), 5)]]
    for start in range(0, rows, 13):
        chunk = []
        for i in range(start, min(rows, start + 13)):
            roll = rng.random()
            if roll < 0.1:
                continue  # never finished
            if roll < 0.25:
                chunk.append(failure(i, rng.choice(["engine_error", "media_error"])))
            elif roll < 0.35:
                chunk.append(answer(i, completion_flag=rng.choice(["length", "format_error"]), format_error=True))
            else:
                chunk.append(answer(i, f"text {i} ☃", reused=roll > 0.9))
        rng.shuffle(chunk)
        chunks.append(chunk)
    reruns = [answer(i, f"rerun {i}") for i in range(rows) if rng.random() < 0.1]
    rng.shuffle(reruns)
    return [*chunks, reruns]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_column_wise_merge_equals_the_row_by_row_merge(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(arrow_checkpoint, "WINDOW_ROWS", 7)  # windows and input batches cut
    monkeypatch.setattr(parquet, "MERGE_ROWS", 11)  # across each other and across shards
    rows = 200
    prompts = [f"question {i}" for i in range(rows)]
    jsonl_src = write_jsonl(tmp_path / "in.jsonl", [chat_row(str(i), p) for i, p in enumerate(prompts)])
    parquet_src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [str(i) for i in range(rows)], "prompt": prompts}), parquet_src)
    options = JobOptions(shards=4, max_tokens=16)
    by_line = prepare_job(jsonl_src, str(tmp_path / "out.jsonl"), options, tmp_path / "work")
    by_column = prepare_job(parquet_src, str(tmp_path / "out.parquet"), options, tmp_path / "work")
    chunks = outcomes_of_a_messy_run(rows, seed)
    for chunk in chunks:
        for job in (by_line, by_column):
            for shard, rng in enumerate(job.manifest().shards):
                job.record_outcomes(shard, [o for o in chunk if rng.start <= o.index < rng.stop])

    line_report, column_report = merge_job(by_line), merge_job(by_column)
    assert column_report.request_counts == line_report.request_counts
    assert column_report.error_counts == line_report.error_counts
    assert column_report.usage == line_report.usage
    assert column_report.output_tokens == line_report.output_tokens
    assert column_report.reused_answer_rows == line_report.reused_answer_rows
    assert column_report.status == line_report.status == "stopped_early"

    latest = {o.index: o for chunk in chunks for o in chunk}
    expected = [
        (o.key, None if o.error else o.body["choices"][0]["message"]["content"], o.error_type)  # type: ignore[index]
        for _, o in sorted(latest.items())
    ]
    table = pq.read_table(by_column.result_path)
    assert list(zip(*(table.column(c).to_pylist() for c in ("id", "output", "error_type")), strict=True)) == expected
    lines = read_jsonl(by_line.result_path)
    texts = [None if line["error"] else line["response"]["body"]["choices"][0]["message"]["content"] for line in lines]
    assert list(zip([line["custom_id"] for line in lines], texts, strict=True)) == [(k, t) for k, t, _ in expected]


def test_stored_outcomes_carry_what_the_other_readers_use(tmp_path: Path) -> None:
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"]}), src)
    job = prepare_job(src, str(tmp_path / "out.parquet"), JobOptions(max_tokens=4), tmp_path / "work")
    job.record_outcomes(0, [answer(0, reused=True), failure(1, "media_error")])
    got = {o.i: o for o in JobDir(tmp_path / "work", job.job_id).outcomes(0)}
    assert sorted(got) == [0, 1]
    assert not got[0].failed and got[0].reused and got[0].usage.completion_tokens == 1
    assert got[1].failed and got[1].error_type == "media_error" and got[1].status_code == 500
    assert json.loads(json.dumps(got[1].error))["message"] == "row 1 failed"
    assert job.finished_rows(0) == {0}


_POOLS: list[pa.MemoryPool] = []


def parquet_merge_peak(tmp_path: Path, rows: int) -> int:
    """Arrow's peak allocation while merging a one-shard Parquet job of ``rows`` rows, whose
    checkpoint was written in reruns (out of order, so the merge sorts it)."""
    src = tmp_path / f"in-{rows}.parquet"
    pq.write_table(pa.table({"prompt": [f"question {i}" for i in range(rows)]}), src, row_group_size=2048)
    job = prepare_job(src, str(tmp_path / f"out-{rows}.parquet"), JobOptions(shards=1, max_tokens=4), tmp_path / "w")
    for start in range(0, rows, 1000):
        job.record_outcomes(0, [answer(i, f"a longer answer for row {i} " * 4) for i in range(start, start + 1000)])
    job.record_outcomes(0, [answer(i, "rerun") for i in range(0, rows, 97)])
    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    _POOLS.append(pool)  # buffers made from it may outlive this call: the pool must too
    previous = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    try:
        report = merge_job(job)
    finally:
        pa.set_memory_pool(previous)
    assert report.request_counts.completed == rows
    return pool.max_memory()


def test_parquet_merge_memory_does_not_grow_with_the_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arrow_checkpoint, "WINDOW_ROWS", 2048)
    monkeypatch.setattr(parquet, "MERGE_ROWS", 2048)
    small, big = parquet_merge_peak(tmp_path, 8_000), parquet_merge_peak(tmp_path, 64_000)
    assert big < small * 1.5, (small, big)  # 8 times the rows


def test_a_checkpoint_from_before_the_finish_reason_column_is_upgraded(tmp_path: Path) -> None:
    """A shard checkpointed by an earlier version resumes: its rows read with a null finish
    reason, and the rows appended after them are read too."""
    path = tmp_path / "results.arrow"
    current = arrow_checkpoint.schema("chat")
    older = pa.schema([f for f in current if f.name != "finish_reason"])
    rows = arrow_checkpoint._batch([answer(0), answer(1)], "chat")
    old_batch = pa.RecordBatch.from_arrays([rows.column(n) for n in older.names], schema=older)
    path.write_bytes(older.serialize().to_pybytes() + old_batch.serialize().to_pybytes())
    finished = answer(2)
    finished.body["choices"][0]["finish_reason"] = "stop"  # type: ignore[index]
    arrow_checkpoint.append(path, [finished], "chat")
    table = latest(path)
    assert table.column("i").to_pylist() == [0, 1, 2]
    assert table.column("finish_reason").to_pylist() == [None, None, "stop"]
    assert table.column("value").to_pylist() == ["answer 0", "answer 1", "answer 2"]
