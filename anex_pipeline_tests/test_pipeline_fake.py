"""The whole pipeline through Dagster on the fake engine: shapes, order, resume, reports."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from anex_pipeline.engine.base import Engine
from anex_pipeline.engine.loader import register_engine
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobRejected
from anex_pipeline.stages.estimate import estimate_lengths
from anex_pipeline.testing import fake_engine, shared_fake_engine
from anex_pipeline_tests.harness.jobs import chat_row, local_instance, read_jsonl, write_jsonl


def test_jsonl_chat_job_keeps_order_and_exact_envelopes(tmp_path: Path, fake_runner: JobRunner) -> None:
    rows = [chat_row(f"r-{i}", f"question number {i}", max_tokens=20) for i in range(200)]
    rows[57] = chat_row("r-57", "word " * 500)  # longer than the fake context
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    job = fake_runner.submit(str(src), str(out), {"shards": 3})
    report = fake_runner.run(job)

    lines = read_jsonl(out)
    assert [line["custom_id"] for line in lines] == [f"r-{i}" for i in range(200)]
    ok = lines[0]
    assert ok["id"] == "batch_req_r-0" and ok["error"] is None
    assert ok["response"]["status_code"] == 200 and ok["response"]["request_id"] == "req_r-0"
    ChatCompletion.model_validate(ok["response"]["body"])
    bad = lines[57]
    assert bad["response"] == {"status_code": 400, "request_id": "req_r-57", "body": None}
    assert bad["error"]["type"] == "invalid_request_error" and bad["error"]["param"] == "messages"
    assert report.status == "completed"
    assert report.request_counts.model_dump() == {"total": 200, "completed": 199, "failed": 1, "format_error_rows": 0}
    assert json.loads((tmp_path / "out.report.json").read_text())["job_id"] == job.job_id
    assert len(job.manifest().shards) == 3


def test_completions_endpoint_gives_text_completions(tmp_path: Path, fake_runner: JobRunner) -> None:
    rows = [{"custom_id": f"c{i}", "url": "/v1/completions", "body": {"prompt": f"once upon {i}"}} for i in range(5)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report = fake_runner.run(fake_runner.submit(str(src), str(tmp_path / "o.jsonl"), {"max_tokens": 8}))
    assert report.request_counts.completed == 5
    for line in read_jsonl(tmp_path / "o.jsonl"):
        body = Completion.model_validate(line["response"]["body"])
        assert body.object == "text_completion" and body.choices[0].text


def test_parquet_job_adds_row_index_output_and_error_type(tmp_path: Path, fake_runner: JobRunner) -> None:
    prompts = [f"tell me about {i}" for i in range(200)]
    prompts[10] = "long " * 400
    pq.write_table(pa.table({"prompt": prompts, "topic": [f"t{i}" for i in range(200)]}), tmp_path / "in.parquet")
    out = tmp_path / "out.parquet"
    report = fake_runner.run(fake_runner.submit(str(tmp_path / "in.parquet"), str(out), {"max_tokens": 3, "shards": 4}))
    table = pq.read_table(out)
    assert table.column_names == [
        "prompt",
        "topic",
        "row_index",
        "output",
        "error_type",
        "prompt_tokens",
        "completion_tokens",
        "finish_reason",
    ]
    assert table.column("row_index").to_pylist() == list(range(200))
    assert table.column("topic").to_pylist() == [f"t{i}" for i in range(200)]
    kinds = table.column("error_type").to_pylist()
    assert kinds[10] == "context_length_exceeded" and table.column("output")[10].as_py() is None
    assert kinds[0] == "length"  # the fake's answers are longer than 3 words
    assert report.request_counts.failed == 1
    assert report.error_counts["context_length_exceeded"] == 1
    meta = table.select(["prompt_tokens", "completion_tokens", "finish_reason"]).to_pylist()
    assert meta[10] == {"prompt_tokens": None, "completion_tokens": None, "finish_reason": None}  # the failed row
    assert meta[0] == {"prompt_tokens": 7, "completion_tokens": 3, "finish_reason": "length"}  # words, for the fake
    assert sum(m["completion_tokens"] or 0 for m in meta) == report.usage.completion_tokens


@pytest.mark.slow
def test_parquet_row_metadata_survives_a_resume_and_can_be_turned_off(tmp_path: Path, fake_runner: JobRunner) -> None:
    prompts = [f"say {'more ' * (i % 5)}about {i}" for i in range(40)]
    pq.write_table(pa.table({"prompt": prompts}), tmp_path / "in.parquet")
    options = {"shards": 2, "max_tokens": 6}
    whole = tmp_path / "whole.parquet"
    fake_runner.run(fake_runner.submit(str(tmp_path / "in.parquet"), str(whole), options))
    columns = ["prompt_tokens", "completion_tokens", "finish_reason"]
    expected = pq.read_table(whole).select(columns)
    assert set(expected.column("finish_reason").to_pylist()) == {"stop"}
    assert len(set(expected.column("prompt_tokens").to_pylist())) == 5  # the prompts have five lengths

    resumed = tmp_path / "resumed.parquet"
    job = fake_runner.submit(str(tmp_path / "in.parquet"), str(resumed), {**options, "checkpoint_rows": 3})
    fake_runner.run(job, shards=[0])  # the first shard's rows go to its checkpoint, then the job resumes
    engine = shared_fake_engine(job.manifest().model_name)
    seen = len(engine.seen)
    fake_runner.run(job)
    assert len(engine.seen) - seen == 20  # only the second shard was generated
    assert pq.read_table(resumed).select(columns).equals(expected)

    bare = tmp_path / "bare.parquet"
    fake_runner.run(fake_runner.submit(str(tmp_path / "in.parquet"), str(bare), {**options, "row_metadata": False}))
    assert pq.read_table(bare).column_names == ["prompt", "row_index", "output", "error_type"]


def test_an_input_column_named_like_row_metadata_is_refused_unless_it_is_off(
    tmp_path: Path, fake_runner: JobRunner
) -> None:
    pq.write_table(pa.table({"prompt": ["a", "b"], "finish_reason": ["x", "y"]}), tmp_path / "in.parquet")
    with pytest.raises(JobRejected) as refused:
        fake_runner.submit(str(tmp_path / "in.parquet"), str(tmp_path / "out.parquet"), {})
    assert refused.value.problems[0].field == "finish_reason" and "row_metadata" in str(refused.value)
    job = fake_runner.submit(str(tmp_path / "in.parquet"), str(tmp_path / "out.parquet"), {"row_metadata": False})
    fake_runner.run(job)
    assert pq.read_table(tmp_path / "out.parquet").column("finish_reason").to_pylist() == ["x", "y"]


def test_parquet_with_own_id_keeps_it(tmp_path: Path, fake_runner: JobRunner) -> None:
    pq.write_table(pa.table({"id": [11, 7, 3], "prompt": ["a", "b", "c"]}), tmp_path / "in.parquet")
    out = tmp_path / "out.parquet"
    fake_runner.run(fake_runner.submit(str(tmp_path / "in.parquet"), str(out), {"max_tokens": 50}))
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == [11, 7, 3]
    assert "row_index" not in table.column_names
    assert all(t.startswith("answer to") for t in table.column("output").to_pylist())


def test_rerun_generates_only_missing_rows(tmp_path: Path, fake_runner: JobRunner) -> None:
    rows = [chat_row(f"k{i}", f"q {i}", max_tokens=30) for i in range(40)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    job = fake_runner.submit(str(src), str(out), {"shards": 2})
    fake_runner.run(job, shards=[0])
    partial = fake_runner.run(job, shards=[])
    assert partial.status == "stopped_early" and partial.request_counts.completed == 20
    assert len(read_jsonl(out)) == 20
    engine = shared_fake_engine("HuggingFaceTB/SmolLM2-135M-Instruct")
    before = len(engine.seen)
    final = fake_runner.run(job)
    assert final.status == "completed" and len(read_jsonl(out)) == 40
    assert engine.seen[before:] == [f"k{i}" for i in range(20, 40)]


def test_estimate_sets_the_cap_and_its_sample_is_reused(tmp_path: Path, fake_runner: JobRunner) -> None:
    rows = [chat_row(f"e{i}", f"question {i}") for i in range(150)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    job = fake_runner.submit(str(src), str(tmp_path / "o.jsonl"), {"estimate_sample_size": 100})
    engine = shared_fake_engine("HuggingFaceTB/SmolLM2-135M-Instruct")
    before = len(engine.seen)
    report = fake_runner.run(job)
    assert report.estimate.sample_size == 100 and report.estimate.max_tokens is not None
    assert "order-statistic" in report.estimate.method
    assert len(engine.seen) - before == 150  # 100 sampled rows reused, 50 generated once
    assert report.reused_sample_rows == 100


def test_sample_answers_cut_at_the_cap_in_force_are_not_generated_again(tmp_path: Path, fake_runner: JobRunner) -> None:
    """A Parquet job the sample covers whole, with answers longer than the sample's cap: the cap
    in force is the sample's own, so every cut answer is the row's answer and none is generated again."""
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"tell me about item {i}" for i in range(50)]}), src)
    job = fake_runner.submit(str(src), str(tmp_path / "o.parquet"), {"estimate_sample_size": 64})
    engine = shared_fake_engine("HuggingFaceTB/SmolLM2-135M-Instruct")
    estimate, _ = estimate_lengths(job, lambda: engine, cap=4)  # the fake's answers are longer than 4 words
    assert estimate.max_tokens == 4 and estimate.sample_size == 50
    before = len(engine.seen)
    report = fake_runner.run(job)
    assert len(engine.seen) == before  # no row generated twice
    assert report.request_counts.completed == 50 and report.reused_sample_rows == 50
    assert pq.read_table(tmp_path / "o.parquet").column("error_type").to_pylist() == ["length"] * 50


def test_backfill_command_reruns_only_unfinished_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from anex_pipeline import cli

    monkeypatch.setenv("ANEX_WORK_DIR", str(tmp_path / "work"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv("ANEX_ENGINE", "fake")  # the command's engine settings read it
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"b{i}", f"q {i}", max_tokens=30) for i in range(30)])
    with local_instance() as instance:
        runner = JobRunner(instance, StorageResource(work_root=str(tmp_path / "work")), fake_engine())
        job = runner.submit(str(src), str(tmp_path / "out.jsonl"), {"shards": 3})
        runner.run(job, shards=[1])
        assert runner.unfinished_shards(job) == [0, 2]
    capsys.readouterr()
    assert cli.main(["backfill", job.job_id, "--failed", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "completed"
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 30
    assert cli.main(["backfill", job.job_id, "--shards", "7"]) == 2
    assert cli.main(["backfill", "no-such-job"]) == 2


def slow_engine(config, manifest):  # type: ignore[no-untyped-def]
    """The fake engine, taking 0.5 s per call, so that a time limit falls in the middle of a job."""
    engine = shared_fake_engine(manifest.model_name)

    class Slow(Engine):
        model_name = engine.model_name

        def run(self, requests):  # type: ignore[no-untyped-def]
            time.sleep(0.5)
            return engine.run(requests)

    return Slow()


register_engine("slow", slow_engine)


@pytest.mark.slow
def test_time_limit_stops_early_and_delivers_finished_rows(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    runner = JobRunner(instance, StorageResource(work_root=str(tmp_path / "w")), fake_engine("slow"))
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"t{i}", f"q {i}", max_tokens=20) for i in range(100)])
    out = tmp_path / "out.jsonl"
    job = runner.submit(str(src), str(out), {"time_limit_s": 4.0, "checkpoint_rows": 5, "shards": 2})
    report = runner.run(job)
    assert report.status == "stopped_early"
    assert "time limit of 4 s" in (report.failure_reason or "")
    delivered = [line["custom_id"] for line in read_jsonl(out)]
    assert 0 < len(delivered) < 100
    assert delivered == [f"t{i}" for i in range(100) if f"t{i}" in set(delivered)]  # in order, once
    for _ in range(40):  # each run gets the whole limit again and carries on where the last stopped
        if runner.run(job).status == "completed":
            break
    assert [line["custom_id"] for line in read_jsonl(out)] == [f"t{i}" for i in range(100)]


def test_unwritable_output_fails_clearly_and_loses_nothing(tmp_path: Path, fake_runner: JobRunner) -> None:
    from anex_pipeline.runner import StepFailed

    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"u{i}", f"q {i}", max_tokens=20) for i in range(12)])
    job = fake_runner.submit(str(src), str(tmp_path / "a-file" / "out.jsonl"), {})
    shutil.rmtree(tmp_path / "a-file")  # the location breaks after submit, which refuses it up front
    (tmp_path / "a-file").write_text("not a folder")
    engine = shared_fake_engine("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(StepFailed, match="cannot write the result"):
        fake_runner.run(job)
    generated = len(engine.seen)
    again = fake_runner.submit(str(src), str(tmp_path / "out.jsonl"), {})
    assert again.job_id == job.job_id  # the same job, now pointed at a writable place
    assert fake_runner.run(again).status == "completed"
    assert len(engine.seen) == generated  # nothing was generated twice
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 12


def test_report_and_metadata_show_output_length_percentiles(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    rows = [chat_row(f"p{i}", " ".join(["w"] * (i % 10 + 1)), max_tokens=50) for i in range(100)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    runner = JobRunner(instance, StorageResource(work_root=str(tmp_path / "w")), fake_engine())
    report = runner.run(runner.submit(str(src), str(tmp_path / "out.jsonl"), {}))
    lengths = [line["response"]["body"]["usage"]["completion_tokens"] for line in read_jsonl(tmp_path / "out.jsonl")]
    assert report.output_tokens["max"] == max(lengths)
    assert report.output_tokens["p50"] == sorted(lengths)[49]
    assert report.output_tokens["p90"] <= report.output_tokens["p95"] <= report.output_tokens["p99"] <= max(lengths)
    events = instance.fetch_materializations(dg.AssetKey("merged_result"), limit=1).records
    table = events[0].asset_materialization.metadata["output_lengths"].value
    assert table.startswith("| p50 | p90 | p95 | p99 | max |")


def test_a_row_of_several_answers_is_sampled_for_one_and_never_reused(tmp_path: Path, fake_runner: JobRunner) -> None:
    """The estimate bounds one answer's length: a row asking for three choices (or, on completions,
    answers to a list of prompts) is sampled for its first answer alone, whose usage is one
    answer's, and that answer is not the row's, so no shard takes it."""
    from anex_pipeline.testing import FakeEngine
    from anex_pipeline.validate.answers import answers_asked

    class CountsEveryAnswer(FakeEngine):
        """Usage as vLLM gives it: every choice's tokens added up."""

        def _one(self, req: Any) -> Any:
            outcome = super()._one(req)
            outcome.usage["completion_tokens"] *= answers_asked(req.body)
            asked.append(answers_asked(req.body))
            return outcome

    asked: list[int] = []
    rows = [chat_row(f"n{i}", f"question {i}", n=3, temperature=0.8) for i in range(10)]
    rows += [chat_row(f"o{i}", f"question {i}") for i in range(10)]
    job = fake_runner.submit(str(write_jsonl(tmp_path / "in.jsonl", rows)), str(tmp_path / "o.jsonl"), {})
    estimate, stats = estimate_lengths(job, lambda: CountsEveryAnswer(), cap=100)
    assert asked == [1] * 20 and estimate.sample_size == 20
    reusable = read_jsonl(job.sample_path)
    assert sorted(r["key"] for r in reusable) == [f"o{i}" for i in range(10)]
    one_answer = max(r["usage"]["completion_tokens"] for r in reusable)  # the same words for n-rows
    assert stats["sample_max"] == one_answer, "a row's three answers were counted as one"
