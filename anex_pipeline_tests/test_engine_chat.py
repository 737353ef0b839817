"""Real jobs on the real vLLM engine (the CPU build here) with the embedded SmolLM2 model.

The jobs share one runner (and so one loaded engine) for the whole session, as the CLI shares it
across a job's steps; the CLI test loads its own, since the command releases it on exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.jobs import chat_row, read_jsonl, run_job, write_jsonl

pytestmark = pytest.mark.engine


def test_200_row_chat_job_with_one_overlong_prompt(tmp_path: Path, real_runner: JobRunner) -> None:
    rows = [chat_row(f"row-{i}", f"What is {i} plus {i}?", max_tokens=8, temperature=0) for i in range(200)]
    rows[123] = chat_row("row-123", "tell me a story " * 700, max_tokens=8)  # about 2,800 tokens
    # values that pass the submit checks one by one, but not together: vLLM refuses the row
    rows[7] = chat_row("row-7", "hi", max_tokens=8, min_tokens=20)
    rows[50] = chat_row("row-50", "hi", max_tokens=2040)  # the prompt leaves less of the 2,048-token context
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"

    assert run_job(real_runner, src, out, {"shards": 2}).status == "completed"

    lines = read_jsonl(out)
    assert [line["custom_id"] for line in lines] == [f"row-{i}" for i in range(200)]
    for i, line in enumerate(lines):
        if i in (7, 50, 123):
            continue
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = ChatCompletion.model_validate(line["response"]["body"])
        assert body.usage is not None and 0 < body.usage.completion_tokens <= 8
        assert body.choices[0].message.content
    long_row = lines[123]
    assert long_row["response"]["status_code"] == 400 and long_row["response"]["body"] is None
    assert long_row["error"]["type"] == "invalid_request_error"
    assert "context" in long_row["error"]["message"]
    assert (long_row["error"]["code"], long_row["error"]["param"]) == ("context_length_exceeded", "messages")
    over_cap = lines[50]
    assert over_cap["response"]["status_code"] == 400
    assert (over_cap["error"]["code"], over_cap["error"]["param"]) == ("context_length_exceeded", "max_tokens")
    assert "at most" in over_cap["error"]["message"]
    bad_param = lines[7]
    assert bad_param["response"]["status_code"] == 400
    assert bad_param["error"]["type"] == "invalid_request_error"
    assert "min_tokens" in bad_param["error"]["message"]
    report = json.loads((tmp_path / "out.report.json").read_text())
    assert report["status"] == "completed"
    assert report["request_counts"] == {"total": 200, "completed": 197, "failed": 3, "format_error_rows": 0}
    assert {k: report["error_counts"][k] for k in ("context_length_exceeded", "invalid_request_error")} == {
        "context_length_exceeded": 2,
        "invalid_request_error": 1,
    }
    assert report["usage"]["completion_tokens"] > 0


@pytest.mark.subprocess
def test_cli_run_gives_real_english_answers(tmp_path: Path) -> None:
    """The installed command, in its own process, as a user runs it."""
    rows = [chat_row("paris", "What is the capital of France? Answer in one sentence.", max_tokens=24, temperature=0)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    env = {**os.environ, "ANEX_WORK_DIR": str(tmp_path / "work"), "DAGSTER_HOME": str(tmp_path / "dagster")}
    command = [str(Path(sys.executable).with_name("anex-pipeline")), "run", str(src), "-o", str(tmp_path / "out.jsonl")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["status"] == "completed"
    assert "1/1 rows" in done.stderr  # progress lines
    answer = read_jsonl(tmp_path / "out.jsonl")[0]["response"]["body"]["choices"][0]["message"]["content"]
    assert "Paris" in answer


def test_200_row_parquet_job(tmp_path: Path, real_runner: JobRunner) -> None:
    prompts = [f"Name a colour. ({i})" for i in range(200)]
    prompts[77] = "tell me a story " * 700  # about 2,800 tokens, over the 2,048-token context
    pq.write_table(pa.table({"prompt": prompts, "batch": ["a"] * 200}), tmp_path / "in.parquet")
    out = tmp_path / "out.parquet"
    report = run_job(real_runner, tmp_path / "in.parquet", out, {"max_tokens": 6, "temperature": 0})
    assert report.status == "completed" and report.request_counts.completed == 199
    assert report.error_counts.get("context_length_exceeded") == 1
    table = pq.read_table(out)
    assert table.num_rows == 200
    assert table.column_names == [
        "prompt",
        "batch",
        "row_index",
        "output",
        "error_type",
        "prompt_tokens",
        "completion_tokens",
        "finish_reason",
    ]
    assert table.column("row_index").to_pylist() == list(range(200))
    assert table.column("prompt").to_pylist() == prompts
    rows = table.to_pylist()
    failed = rows.pop(77)
    assert failed["error_type"] == "context_length_exceeded" and failed["output"] is None
    assert (failed["prompt_tokens"], failed["completion_tokens"], failed["finish_reason"]) == (None, None, None)
    assert all(isinstance(r["output"], str) and r["output"] for r in rows)
    assert {r["error_type"] for r in rows} <= {None, "length"}
    for r in rows:  # the row's own figures: the chat template's tokens around the prompt, at most 6 answered
        assert 10 < r["prompt_tokens"] < 60 and 0 < r["completion_tokens"] <= 6
        assert r["finish_reason"] in ("stop", "length")
        assert (r["error_type"] == "length") == (r["finish_reason"] == "length")
    assert sum(r["prompt_tokens"] for r in rows) == report.usage.prompt_tokens
    assert sum(r["completion_tokens"] for r in rows) == report.usage.completion_tokens


def test_completions_job(tmp_path: Path, real_runner: JobRunner) -> None:
    rows = [
        {"custom_id": f"c{i}", "url": "/v1/completions", "body": {"prompt": p, "max_tokens": 12, "temperature": 0}}
        for i, p in enumerate(["The capital of Italy is", "One, two, three,"])
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    run_job(real_runner, src, tmp_path / "out.jsonl")
    for line in read_jsonl(tmp_path / "out.jsonl"):
        body = Completion.model_validate(line["response"]["body"])
        assert body.object == "text_completion" and body.choices[0].text.strip()
