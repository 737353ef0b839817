"""In Dagster: a submitted job's quote is a `validated_input` metadata entry (and its run's report
shows it beside what happened), and each running `generations` step reports its progress as it
goes: run log lines with rows done, failed and tok/s, and observations of the asset."""

from __future__ import annotations

from pathlib import Path

import pytest

from anex_pipeline.orchestration.definitions import build_definitions
from anex_pipeline.orchestration.partitions import JOBS, job_shard_key
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.testing import fake_engine
from anex_pipeline.workdir.manifest import read_report
from anex_pipeline_tests.harness.jobs import chat_row, local_instance, write_jsonl


@pytest.mark.slow
def test_a_submitted_job_is_quoted_and_its_shards_report_progress_as_they_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANEX_CARRY_ON_SHARDS", "0")  # each step its own run here
    rows = [chat_row(f"d{i}", f"question number {i}", max_tokens=12) for i in range(40)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    d = build_definitions(StorageResource(work_root=str(tmp_path / "work")), fake_engine())
    config = {"input": str(src), "output": str(tmp_path / "out.jsonl"), "options": {"shards": 1}}
    with local_instance() as instance:
        instance.add_dynamic_partitions(JOBS, ["q-job"])
        submitted = d.resolve_job_def("submit_job").execute_in_process(
            instance=instance, partition_key="q-job", run_config={"ops": {"validated_input": {"config": config}}}
        )
        validated = submitted.asset_materializations_for_node("validated_input")[0]
        quote = validated.metadata["quote"].value
        assert quote["rows"] == 40 and quote["output_tokens_cap"] == 40 * 12
        assert validated.metadata["quote_prompt_tokens"].value == quote["prompt_tokens"] > 0

        assert d.resolve_job_def("estimate_job").execute_in_process(instance=instance, partition_key="q-job").success
        shard = d.resolve_job_def("shard_job").execute_in_process(
            instance=instance, partition_key=job_shard_key("q-job", 0)
        )
        observed = [o.metadata for o in shard.asset_observations_for_node("generations")]
        assert observed and observed[-1]["rows_done"].value == 40 and observed[-1]["failed"].value == 0
        assert "output_tokens_per_s" in observed[-1]
        logged = [entry.user_message for entry in instance.all_logs(shard.run_id)]
        lines = [m for m in logged if "rows done (" in m]
        assert lines and lines[-1].startswith("40/40 rows done (0 failed)")
        assert d.resolve_job_def("finish_job").execute_in_process(instance=instance, partition_key="q-job").success
    report = read_report(tmp_path / "out.report.json")
    assert report is not None and report.quote is not None
    assert report.quote.quoted.prompt_tokens == quote["prompt_tokens"]
    assert report.quote.output_tokens == report.usage.completion_tokens
