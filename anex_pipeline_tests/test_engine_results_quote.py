"""On the real engine: `results` read twice while a 400-row job runs gives whole rows in input
order, the second read holding the first; and after that run, a quote of a file of the same shape
(new questions, same templates) expects within 25% of the output tokens the run produced, and
within 50% of its engine time."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import dagster as dg
import pytest

from anex_pipeline.options import job_options
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobReport
from anex_pipeline.stages.merge_partial import write_finished_rows
from anex_pipeline.stages.quote import make_quote
from anex_pipeline_tests.harness.jobs import real_engine_resource
from bench.vs_run_batch import make_input

pytestmark = pytest.mark.engine

ROWS = 400


def _read(job, out: Path) -> list[str]:  # type: ignore[no-untyped-def]
    write_finished_rows(job, out)
    data = out.read_bytes()
    assert data == b"" or data.endswith(b"\n")
    return [json.loads(line)["custom_id"] for line in data.splitlines()]


def test_results_while_a_400_row_job_runs_then_a_quote_of_the_same_shape(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    runner = JobRunner(instance, StorageResource(work_root=str(tmp_path / "work")), real_engine_resource())
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    make_input(first, ROWS, seed=1, unique=True)
    make_input(second, ROWS, seed=2, unique=True)
    options = {"shards": 2, "checkpoint_rows": 16}
    job = runner.submit(str(first), str(tmp_path / "a.results.jsonl"), options)
    done: list[JobReport] = []
    running = threading.Thread(target=lambda: done.append(runner.run(job)))
    running.start()
    reads: list[list[str]] = []
    order = {f"b-{i}": i for i in range(ROWS)}
    try:
        while running.is_alive() and len(reads) < 2:
            got = _read(job, tmp_path / f"read-{len(reads)}.jsonl")
            if got and (not reads or len(got) > len(reads[-1]) + 32):
                reads.append(got)
            running.join(0.5)
    finally:
        running.join()
    assert len(reads) == 2, "the job ended before two reads of its rows"
    for got in reads:
        assert [order[k] for k in got] == sorted({order[k] for k in got})
    assert set(reads[0]) < set(reads[1])
    (report,) = done
    assert report.status == "completed"
    assert _read(job, tmp_path / "final.jsonl") == [f"b-{i}" for i in range(ROWS)]

    quote = make_quote(second, job_options(options), tmp_path / "work", real_engine_resource().plain())
    produced = report.usage.completion_tokens
    took = report.timings.get("generate", 0.0) + report.timings.get("estimate", 0.0)
    print(f"quote: {quote.model_dump_json()}\nrun: {produced} output tokens, {took:.1f} s")  # docs/benchmarks.md
    assert quote.output_tokens_expected is not None and quote.engine_seconds is not None
    assert abs(quote.output_tokens_expected - produced) <= 0.25 * produced, (quote.output_tokens_expected, produced)
    assert abs(quote.engine_seconds - took) <= 0.5 * took, (quote.engine_seconds, took)
