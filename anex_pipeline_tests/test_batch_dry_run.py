"""A Batch API dry run (``anex_options.dry_run: true``): the batch is quoted, not run; a malformed
file gets the problems a failed batch lists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.batch_api import client, rows, serving, submit
from anex_pipeline_tests.harness.jobs import write_jsonl


@pytest.mark.slow
def test_a_dry_run_answers_with_the_quote_and_runs_nothing(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", rows(12))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"custom_id": "a"}\nnot json\n')
    with serving(fake_runner, warm_up=False) as url:
        sdk = client(url)
        quoted = submit(sdk, src, {"max_tokens": 8, "dry_run": True})
        extra = quoted.model_extra or {}
        assert quoted.status == "completed" and extra["dry_run"] is True
        assert quoted.request_counts is not None and quoted.request_counts.total == 12
        assert extra["quote"]["rows"] == 12 and extra["quote"]["output_tokens_cap"] == 12 * 8
        assert extra["quote"]["completion_window_s"] == 24 * 3600
        assert sdk.batches.list().data == []  # nothing was made
        refused = submit(sdk, bad, {"dry_run": True})
        assert refused.status == "failed" and refused.errors is not None and refused.errors.data
        assert [e.line for e in refused.errors.data] == [1, 2]
        assert "quote" not in (refused.model_extra or {})
        with pytest.raises(Exception, match="dry_run must be true or false"):
            submit(sdk, src, {"dry_run": "yes"})
    assert json.loads(json.dumps(extra["quote"]))["prompt_tokens"] > 0
