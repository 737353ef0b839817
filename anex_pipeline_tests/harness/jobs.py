"""Writing and reading job files, Dagster instances on disk, and running jobs from a test."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import dagster as dg
from openai.types.chat import ChatCompletion

from anex_pipeline.instance import TERMINAL_OUTPUT
from anex_pipeline.orchestration.resources import EngineResource
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobReport

REPO = Path(__file__).resolve().parents[2]


# An instance for Dagster's own commands (webserver, `dagster job backfill`) with no daemon: its
# coordinator starts each run at once instead of queueing it for the daemon `dagster dev` runs.
DAEMONLESS_INSTANCE_YAML = """\
run_coordinator:
  module: dagster._core.run_coordinator
  class: DefaultRunCoordinator
telemetry:
  enabled: false
"""


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")
    return path


def chat_row(cid: str, text: str | list[dict[str, Any]], **body: Any) -> dict[str, Any]:
    """A chat row of one user message: plain text, or a list of content parts."""
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": text}], **body},
    }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    # split on newlines only: str.splitlines() would also cut at U+2028 and U+0085 inside a JSON string
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def local_instance(
    temp_dir: str | None = None, *, set_dagster_home: bool = False
) -> contextlib.AbstractContextManager[dg.DagsterInstance]:
    """A Dagster instance on disk in a temporary folder, set up as the command sets up its own:
    step output is not captured. (The in-memory instance refuses a key-value write while another
    thread runs a job; Dagster's default capture redirects the whole process's output through
    helper processes, once per step, which threads running steps at once tangle.)"""
    return dg.instance_for_test(temp_dir=temp_dir, set_dagster_home=set_dagster_home, overrides=TERMINAL_OUTPUT)


def real_engine_resource(**more: Any) -> EngineResource:
    """The real vLLM engine in this process, sized for the CPU build and small test jobs (the
    machine's shared model server only where a test asks for it)."""
    return EngineResource(**{"max_model_len": 2048, "machine_server": False, **more})


def run_job(runner: JobRunner, src: Path, out: Path, options: dict[str, Any] | None = None) -> JobReport:
    return runner.run(runner.submit(str(src), str(out), options or {}))


def answers(out: Path) -> dict[str, dict[str, Any]]:
    return {line["custom_id"]: line for line in read_jsonl(out)}


def text_of(line: dict[str, Any]) -> str:
    return ChatCompletion.model_validate(line["response"]["body"]).choices[0].message.content or ""


def responses_row(cid: str, given: Any, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/responses", "body": {"input": given, **body}}
