"""What the command pays for before its first row: nothing it does not use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from anex_pipeline_tests.harness.jobs import chat_row, read_jsonl, write_jsonl

# Runs the command (with the fake engine) inside this Python, then names the heavy packages it imported.
RUN_THEN_LIST = """
import json, runpy, sys
sys.argv = ["anex-pipeline", *sys.argv[1:]]
try:
    runpy.run_module("anex_pipeline_tests.harness.fake_cli", run_name="__main__")
except SystemExit as end:
    code = end.code
imported = sorted({name.split(".")[0] for name in sys.modules} & {"dagster_aws", "vllm"})
sys.stderr.write(json.dumps({"code": code, "imported": imported}))
"""


@pytest.mark.subprocess
def test_a_run_of_the_command_never_imports_dagster_aws(tmp_path: Path) -> None:
    """The S3 inbox's ``dagster_aws`` takes about a second to import (its package pulls in Dagster's
    test utilities); the command's runs have no sensors, so a whole job runs without it."""
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"question {i}") for i in range(3)])
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "ANEX_WORK_DIR": str(tmp_path / "work")}
    command = [sys.executable, "-c", RUN_THEN_LIST, "run", str(src), "-o", str(out), "--quiet"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    facts = json.loads(done.stderr.strip().splitlines()[-1])
    assert facts["code"] == 0, done.stderr
    assert len(read_jsonl(out)) == 3
    assert facts["imported"] == [], facts
