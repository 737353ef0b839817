"""Property tests of the invariants that matter most: over generated jobs with good rows, rows that
fail on their own, and an engine that dies at random moments, every run's result holds each input
row at most once and in input order, a finished row is never generated again, and reruns end in
the same result as a run without faults."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.engine.loader import register_engine
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import RowOutcome
from anex_pipeline.testing import FakeEngine, fake_engine
from anex_pipeline_tests.harness.jobs import chat_row, local_instance, read_jsonl, write_jsonl


class DyingEngine(FakeEngine):
    """The fake engine, except that calls marked in ``faults`` die halfway, like a crashed vLLM."""

    def __init__(self, faults: list[bool]):
        super().__init__("fake", context_words=30)
        self.faults = iter(faults)

    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        if next(self.faults, False):
            raise RuntimeError("EngineCore died unexpectedly")
        return super().run(requests)


ENGINE: dict[str, DyingEngine] = {}


register_engine("dying", lambda config, manifest: ENGINE["current"])


def run_until_complete(runner: JobRunner, src: Path, out: Path, options: dict) -> list[list[dict]]:
    job = runner.submit(str(src), str(out), options)
    results = []
    for _ in range(12):
        report = runner.run(job)
        results.append(read_jsonl(out) if out.exists() else [])  # a run that delivered nothing publishes no result
        counts = report.request_counts
        assert counts.completed + counts.failed == len(results[-1])
        if report.status == "completed":
            return results
        # Nothing delivered is "failed", something delivered "stopped_early"; both say why.
        assert report.status == ("stopped_early" if results[-1] else "failed") and report.failure_reason
    raise AssertionError("the job never completed")


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kinds=st.lists(st.sampled_from(["ok", "ok", "ok", "too-long"]), min_size=1, max_size=30),
    shards=st.integers(1, 4),
    chunk=st.integers(1, 8),
    faults=st.lists(st.booleans(), max_size=25),
)
def test_rows_exactly_once_in_order_through_engine_deaths(
    tmp_path_factory, kinds: list[str], shards: int, chunk: int, faults: list[bool]
) -> None:
    tmp = tmp_path_factory.mktemp("prop")
    rows = [chat_row(f"id-{i}", "w " * 40 if k == "too-long" else f"q {i}", max_tokens=9) for i, k in enumerate(kinds)]
    src = write_jsonl(tmp / "in.jsonl", rows)
    options = {"shards": shards, "checkpoint_rows": chunk}
    keys = [r["custom_id"] for r in rows]

    ENGINE["current"] = DyingEngine([])
    with local_instance() as instance:
        clean = JobRunner(instance, StorageResource(work_root=str(tmp / "clean")), fake_engine("dying"))
        (reference,) = run_until_complete(clean, src, tmp / "clean.jsonl", options)

    engine = DyingEngine(faults)
    ENGINE["current"] = engine
    with local_instance() as instance:
        runner = JobRunner(instance, StorageResource(work_root=str(tmp / "work")), fake_engine("dying"))
        runs = run_until_complete(runner, src, tmp / "out.jsonl", options)

    for result in runs:
        got = [r["custom_id"] for r in result]
        assert len(got) == len(set(got))  # at most once
        positions = [keys.index(k) for k in got]
        assert positions == sorted(positions)  # in input order
    final = runs[-1]
    assert [r["custom_id"] for r in final] == keys
    assert [(r["response"], r["error"]) for r in strip_ids(final)] == [
        (r["response"], r["error"]) for r in strip_ids(reference)
    ]
    # Rows that completed were generated once; only rows that failed on their own are tried again.
    generated = Counter(engine.seen)
    for key, kind in zip(keys, kinds, strict=True):
        if kind == "ok":
            assert generated[key] == 1, key


def strip_ids(lines: list[dict]) -> list[dict]:
    for line in lines:
        body = line["response"]["body"]
        if body:  # the response id comes from the job id, which differs between the two jobs
            body.pop("created", None)
            body.pop("id", None)
    return lines
