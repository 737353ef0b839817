"""Streaming I/O: checkpoints merged in bounded memory, shards cut at any block boundary, the
column-wise Parquet checks and the passed-through JSONL bodies giving what the row-by-row path gives."""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anex_pipeline.formats import decode_stored_outcome, jsonl, jsonl_checkpoint, jsonl_input, parquet
from anex_pipeline.formats.jsonl_checkpoint import append_outcomes, latest_records
from anex_pipeline.formats.registry import FORMATS
from anex_pipeline.spec import JobOptions, JobRejected, RowError, RowOutcome
from anex_pipeline.stages.merge import merge_job
from anex_pipeline.stages.submit import prepare_job
from anex_pipeline.workdir.manifest import JobDir
from anex_pipeline_tests.harness.jobs import chat_row, read_jsonl, write_jsonl


def answer(i: int, key: str, text: str | None = None) -> RowOutcome:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text or f"answer {i}"}}]}
    return RowOutcome(i, key, 200, body=body, usage={"prompt_tokens": 5, "completion_tokens": 3})


def failure(i: int, key: str) -> RowOutcome:
    return RowOutcome(i, key, 500, error=RowError(message=f"row {i} failed", type="engine_error"))


def messy_checkpoint(path: Path, rows: int, seed: int = 0) -> dict[int, str]:
    """Writes a checkpoint the way reruns leave it (sample rows out of order, failures, reruns,
    a torn line) and returns the answer text each row must end with."""
    rng = random.Random(seed)
    expected: dict[int, str] = {}
    sample = rng.sample(range(rows), min(20, rows))
    append_outcomes(path, [answer(i, f"k{i}") for i in sample])
    expected.update({i: f"answer {i}" for i in sample})
    rest = [i for i in range(rows) if i not in expected]
    for n in range(0, len(rest), 97):
        chunk = rest[n : n + 97]
        append_outcomes(path, [failure(i, f"k{i}") if i % 7 == 0 else answer(i, f"k{i}") for i in chunk])
        expected.update({i: "" for i in chunk if i % 7 == 0})
        expected.update({i: f"answer {i}" for i in chunk if i % 7})
    retried = [i for i in rest if i % 7 == 0 and i % 2 == 0]
    rng.shuffle(retried)
    append_outcomes(path, [answer(i, f"k{i}", f"retried {i}") for i in retried])
    expected.update({i: f"retried {i}" for i in retried})
    if rows > 3:  # a writer killed inside a rerun's line: the row keeps its earlier answer
        torn = msgspec.json.encode(answer(3, "k3", "never finished").to_record())
        with path.open("ab") as f:
            f.write(torn[: len(torn) // 2])
        append_outcomes(path, [answer(rows - 1, f"k{rows - 1}", "after the torn line")])
        expected[rows - 1] = "after the torn line"
    return expected


def merged_texts(path: Path, rows: int) -> dict[int, str]:
    found = {}
    for o in latest_records(path, 0, rows, decode_stored_outcome):
        found[o.i] = "" if o.failed else msgspec.json.decode(o.body)["choices"][0]["message"]["content"]
    return found


@pytest.mark.parametrize(
    ("patch_bytes", "open_runs"),
    [(8 << 20, 64), (0, 64), (0, 2), (2000, 3)],
    ids=["held-in-memory", "streamed", "spilled", "mixed"],
)
def test_checkpoint_merge_takes_the_latest_readable_line_per_row_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, patch_bytes: int, open_runs: int
) -> None:
    monkeypatch.setattr(jsonl_checkpoint, "PATCH_BYTES", patch_bytes)
    monkeypatch.setattr(jsonl_checkpoint, "MAX_OPEN_RUNS", open_runs)
    path = tmp_path / "results.jsonl"
    expected = messy_checkpoint(path, 400)
    merged = list(latest_records(path, 0, 400, decode_stored_outcome))
    assert [o.i for o in merged] == list(range(400)), "every row once, in order"
    assert merged_texts(path, 400) == expected
    assert not list(tmp_path.glob(".merge-*")), "temporary runs are removed"


def test_checkpoint_merge_keeps_only_the_shards_rows_and_skips_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    append_outcomes(path, [answer(i, f"k{i}") for i in (12, 10, 11, 13, 9)])
    with path.open("ab") as f:
        f.write(b'{"i":14,"key":"k14","status_code":2')
    assert [o.i for o in latest_records(path, 10, 14, decode_stored_outcome)] == [10, 11, 12, 13]
    assert list(latest_records(tmp_path / "missing.jsonl", 0, 5, decode_stored_outcome)) == []


def test_appending_after_a_torn_line_starts_a_new_line(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    append_outcomes(path, [answer(0, "k0")])
    with path.open("ab") as f:
        f.write(b'{"i":1,"key":"k1","bo')
    append_outcomes(path, [answer(2, "k2")])
    assert sorted(jsonl_checkpoint.read_outcomes(path)) == [0, 2]
    assert [o.i for o in latest_records(path, 0, 3, decode_stored_outcome)] == [0, 2]


def chat_job(tmp_path: Path, rows: int, **options: Any) -> JobDir:
    src = write_jsonl(tmp_path / f"in-{rows}.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(rows)])
    return prepare_job(src, str(tmp_path / f"out-{rows}.jsonl"), JobOptions(**options), tmp_path / "work")


def merge_peak(job: JobDir) -> int:
    manifest = job.manifest()
    for shard, rng in enumerate(manifest.shards):
        path = job.checkpoint_path(shard)
        keys = {r.index: r.key for r in job.read_requests(shard)}
        append_outcomes(path, [answer(i, keys[i]) for i in range(rng.start + 5, rng.stop) if i % 3])
        append_outcomes(path, [answer(i, keys[i]) for i in range(rng.start, rng.stop) if i % 3 == 0])
        append_outcomes(path, [answer(i, keys[i], "again") for i in range(rng.start, rng.start + 5)])
    tracemalloc.start()
    try:
        report = merge_job(job)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        assert report.request_counts.completed == manifest.total_rows


@pytest.mark.slow
def test_merge_memory_does_not_grow_with_the_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonl_checkpoint, "PATCH_BYTES", 1 << 16)
    small = merge_peak(chat_job(tmp_path, 6_000, shards=1))
    big = merge_peak(chat_job(tmp_path, 40_000, shards=1))
    checkpoint = chat_job(tmp_path, 40_000, shards=1).checkpoint_path(0).stat().st_size
    # Reading the shard's checkpoint whole would take several times the file's size.
    assert big < checkpoint / 2, (big, checkpoint)
    assert big < small * 1.5 + (256 << 10), (small, big)


def test_jsonl_results_escape_keys_and_carry_errors(tmp_path: Path) -> None:
    keys = ["plain", 'quote"and\\slash', "snow☃", "tab\there"]
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(k, f"q {n}") for n, k in enumerate(keys)])
    job = prepare_job(src, str(tmp_path / "out.jsonl"), JobOptions(), tmp_path / "work")
    append_outcomes(job.checkpoint_path(0), [answer(0, keys[0]), failure(1, keys[1]), answer(2, keys[2])])
    append_outcomes(
        job.checkpoint_path(0), [RowOutcome(3, keys[3], None, error=RowError(message="gone", type="engine_error"))]
    )
    report = merge_job(job)
    lines = read_jsonl(job.result_path)
    assert [line["custom_id"] for line in lines] == keys
    assert [line["id"] for line in lines] == [f"batch_req_{k}" for k in keys]
    assert [line["response"]["request_id"] for line in lines] == [f"req_{k}" for k in keys]
    assert lines[0]["response"]["body"] == answer(0, keys[0]).body and lines[0]["error"] is None
    assert lines[1]["response"] == {"status_code": 500, "request_id": f"req_{keys[1]}", "body": None}
    assert lines[1]["error"] == {"type": "engine_error", "message": "row 1 failed"} | {
        k: v for k, v in lines[1]["error"].items() if k not in ("type", "message")
    }
    assert lines[3]["response"]["status_code"] is None
    assert report.request_counts.failed == 2 and report.error_counts == {"engine_error": 2}
    assert report.usage.prompt_tokens == 10 and report.usage.completion_tokens == 6


def test_jsonl_bodies_pass_through_as_the_full_check_reads_them(tmp_path: Path) -> None:
    rows = [
        '{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "caf\\u00e9"}], "max_tokens": 3}}',
        '{"custom_id":"b","method":"POST","url":"/v1/chat/completions","body":{"messages":[{"role":"user",'
        '"content":[{"type":"text","text":"hi"}]}],"temperature":0.5,"temperature":0.25}}',
        '{"body": {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]},'
        ' "custom_id": "c"}',
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(rows) + "\n")
    for options in ({}, {"system_prompt": "You answer in French."}):
        job = prepare_job(src, str(tmp_path / "out.jsonl"), JobOptions(**options), tmp_path / f"w{len(options)}")
        got = {r.key: r.body for r in job.read_requests(0)}
        for line in rows:
            request = json.loads(line)
            body = request["body"]
            if options and request["custom_id"] != "c":
                body = {
                    **body,
                    "messages": [{"role": "system", "content": options["system_prompt"]}, *body["messages"]],
                }
            assert got[request["custom_id"]] == body


@pytest.mark.parametrize("endpoint", ["chat", "responses"])
def test_the_job_system_prompt_is_kept_once_per_job_not_in_every_row(tmp_path: Path, endpoint: str) -> None:
    prompt = "Answer in French, briefly and politely. " * 10_000  # 390 KB
    own = "be brief"
    if endpoint == "chat":
        rows = [chat_row(f"r{i}", f"question {i}") for i in range(60)]
        rows[7]["body"]["messages"].insert(0, {"role": "system", "content": own})
    else:
        rows = [{"custom_id": f"r{i}", "url": "/v1/responses", "body": {"input": f"question {i}"}} for i in range(60)]
        rows[7]["body"]["instructions"] = own
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    job = prepare_job(src, str(tmp_path / "out.jsonl"), JobOptions(system_prompt=prompt, shards=3), tmp_path / "w")

    stored = sum(p.stat().st_size for p in job.root.rglob("*") if p.is_file())
    assert stored < len(prompt) * 1.1, stored  # the manifest's options hold it once; no shard holds it
    assert job.manifest().job_options().system_prompt == prompt
    got = {r.key: r for shard in range(3) for r in job.read_requests(shard)}
    assert len(got) == 60
    for n, row in enumerate(rows):
        first = got[row["custom_id"]].body["messages"][0]
        assert first == {"role": "system", "content": own if n == 7 else prompt}
        if endpoint == "responses":  # the Responses object shows the instructions the row ran with
            assert got[row["custom_id"]].respond == {**row["body"], "instructions": own if n == 7 else prompt}


def test_a_shard_staged_with_the_prompt_in_every_line_reads_the_same(tmp_path: Path) -> None:
    options = JobOptions(system_prompt="Be kind.")
    chat_body = {"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}]}
    respond_body = {"input": "hi", "instructions": "Be kind."}
    for endpoint, body in (("chat", chat_body), ("responses", respond_body)):
        shard = tmp_path / f"{endpoint}.jsonl"
        shard.write_bytes(b'{"i":0,"key":"a","body":%b}\n' % msgspec.json.encode(body))
        (row,) = FORMATS["jsonl"].read_shard(shard, endpoint, options)  # type: ignore[arg-type]
        assert (row.respond or row.body) == body
        assert [m["content"] for m in row.body["messages"]] == ["Be kind.", "hi"]


def test_shard_files_are_cut_right_at_any_block_boundary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    staging = tmp_path / "staging"
    lines = [b'{"i":%d,"key":"%s"}\n' % (i, b"x" * (i % 13)) for i in range(100)]
    staging.write_bytes(b"".join(lines))
    for block in (1, 7, 64, 1 << 20):
        monkeypatch.setattr(jsonl, "COPY_BLOCK", block)
        sizes = [33, 1, 0, 66]
        targets = [(tmp_path / f"s{block}-{n}", size) for n, size in enumerate(sizes)]
        FORMATS["jsonl"].split_staging(staging, targets)
        starts = [sum(sizes[:n]) for n in range(len(sizes))]
        for (path, size), start in zip(targets, starts, strict=True):
            assert path.read_bytes() == b"".join(lines[start : start + size]), (block, path.name)


def parquet_input(tmp_path: Path, **columns: Any) -> Path:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table(columns), path, row_group_size=3)
    return path


def test_parquet_results_keep_the_input_columns_and_types(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parquet, "MERGE_ROWS", 4)  # several batches, some of them partly delivered
    n = 10
    src = parquet_input(
        tmp_path,
        prompt=pa.array([f"say {i}" for i in range(n)]),
        small=pa.array(range(n), pa.int16()),
        score=pa.array([i / 4 for i in range(n)], pa.float64()),
        tags=pa.array([[f"t{i}", "x"] for i in range(n)], pa.list_(pa.string())),
        when=pa.array(range(n), pa.timestamp("ms")),
    )
    job = prepare_job(src, str(tmp_path / "out.parquet"), JobOptions(), tmp_path / "work")
    outcomes = [answer(i, str(i)) if i % 4 else failure(i, str(i)) for i in range(n) if i not in (5, 6)]
    job.record_outcomes(0, outcomes[::-1])  # out of order on purpose
    merge_job(job)
    table = pq.read_table(job.result_path)
    source = pq.read_table(src)
    for field in source.schema:
        assert table.schema.field(field.name).type == field.type
    kept = [i for i in range(n) if i not in (5, 6)]
    assert table.column("row_index").to_pylist() == kept
    assert table.column("small").to_pylist() == kept
    assert table.column("tags").to_pylist() == [[f"t{i}", "x"] for i in kept]
    assert table.column("output").to_pylist() == [None if i % 4 == 0 else f"answer {i}" for i in kept]
    assert table.column("error_type").to_pylist() == ["engine_error" if i % 4 == 0 else None for i in kept]


def rejected_lines(src: Path, tmp_path: Path, **options: Any) -> dict[int, str]:
    with pytest.raises(JobRejected) as caught:
        prepare_job(src, str(tmp_path / "out.parquet"), JobOptions(**options), tmp_path / "work")
    return {p.line: p.message for p in caught.value.problems if p.line is not None}


def test_parquet_blank_prompts_are_found_column_wise_as_strip_finds_them(tmp_path: Path) -> None:
    blank = ["", " ", "\x1c\x1f", "\u3000\u2029", "\t\n"]
    fine = ["a", "\u200b", " x "]  # a zero-width space is not whitespace to str.strip
    src = parquet_input(tmp_path, prompt=pa.array(fine + blank + [None]))
    found = rejected_lines(src, tmp_path)
    assert sorted(found) == list(range(len(fine) + 1, len(fine) + len(blank) + 2))
    assert all("empty" in found[line] for line in range(len(fine) + 1, len(fine) + len(blank) + 1))
    assert "null" in found[len(fine) + len(blank) + 1]


def test_parquet_ids_column_wise_and_row_by_row(tmp_path: Path) -> None:
    src = parquet_input(tmp_path, id=pa.array(["a", "b", "c", "b"]), prompt=pa.array(["p"] * 4))
    assert rejected_lines(src, tmp_path) == {4: "'b' is already used by row 2"}
    src = parquet_input(tmp_path, id=pa.array([7, 8, 9], pa.int32()), prompt=pa.array(["p", "q", "r"]))
    job = prepare_job(src, str(tmp_path / "o.parquet"), JobOptions(), tmp_path / "ok")
    assert [(r.index, r.key, r.body) for r in job.read_requests(0)] == [
        (i, str(7 + i), {"messages": [{"role": "user", "content": p}]}) for i, p in enumerate("pqr")
    ]
    src = parquet_input(tmp_path, input=pa.array([" ", "x"]))
    job = prepare_job(src, str(tmp_path / "o.parquet"), JobOptions(endpoint="embeddings"), tmp_path / "emb")
    assert [r.body for r in job.read_requests(0)] == [{"input": " "}, {"input": "x"}]


def test_a_record_of_the_wrong_shape_stops_the_merge_instead_of_dropping_the_row(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    append_outcomes(path, [answer(0, "k0")])
    record = answer(1, "k1").to_record() | {"usage": {"prompt_tokens": "many"}}
    with path.open("ab") as f:
        f.write(msgspec.json.encode(record) + b"\n")
    with pytest.raises(msgspec.ValidationError, match="prompt_tokens"):
        list(latest_records(path, 0, 2, decode_stored_outcome))


def test_repeated_ids_are_named_even_when_every_hash_collides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonl_input, "hash", lambda _: 7, raising=False)  # ids are kept as hashes only
    rows = [chat_row(cid, "q") for cid in ("a", "b", "c", "b", "d", "a")]
    rows[2]["body"]["messages"] = []  # a rejected line's id does not count as used
    rows.append(chat_row("c", "q"))
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(JobRejected) as caught:
        prepare_job(src, str(tmp_path / "out.jsonl"), JobOptions(), tmp_path / "work")
    found = {p.line: p.message for p in caught.value.problems}
    assert found == {
        3: found[3],
        4: "'b' is already used on line 2; ids must be unique",
        6: "'a' is already used on line 1; ids must be unique",
    }
    assert "messages" in found[3]


@pytest.mark.parametrize("processes", ["one process", "one per core"])
def test_a_merge_out_of_space_leaves_no_partial_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: str
) -> None:
    if processes == "one per core":
        monkeypatch.setattr(jsonl, "PARALLEL_MERGE_ROWS", 0)
    job = chat_job(tmp_path, 20, shards=2)
    for shard, rng in enumerate(job.manifest().shards):
        append_outcomes(job.checkpoint_path(shard), [answer(i, f"r{i}") for i in range(rng.start, rng.stop)])

    def half_written(path: Path, rows: Any, append: bool = False) -> None:
        path.write_text("{half a line")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(jsonl, "write_results", half_written)
    with pytest.raises(OSError, match="No space left") as raised:
        merge_job(job)
    assert raised.value.filename == str(job.result_path)  # the message names the result, not a temp file
    assert sorted(p.name for p in job.root.iterdir() if "result" in p.name and p.is_file()) == []


def test_a_big_jsonl_job_merged_by_several_processes_equals_one_merged_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = chat_job(tmp_path, 600, shards=5)
    for shard, rng in enumerate(job.manifest().shards):  # rows of other shards are ignored by the merge
        messy_checkpoint(job.checkpoint_path(shard), rng.stop, seed=shard)
    alone = merge_job(job)
    by_one = job.result_path.read_bytes()
    monkeypatch.setattr(jsonl, "PARALLEL_MERGE_ROWS", 0)
    together = merge_job(job)
    assert job.result_path.read_bytes() == by_one
    assert together.model_dump(exclude={"timings"}) == alone.model_dump(exclude={"timings"})
    assert together.request_counts.failed > 0 and together.error_counts  # the messy rows were there
    assert sorted(p.name for p in job.root.iterdir() if "result" in p.name) == [job.result_path.name]


def test_an_empty_checkpoint_has_no_records(tmp_path: Path) -> None:
    """A checkpoint whose first write failed (a full disk) is cut back to nothing; reading it
    gives no rows instead of an error."""
    empty = tmp_path / "results.jsonl"
    empty.write_bytes(b"")
    assert list(latest_records(empty, 0, 10, bytes)) == []
