"""The terminal: our lines and progress on stderr, the engine's and libraries' chatter in a log file."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from anex_pipeline.console import PROGRESS_FIELD, ProgressDisplay, ProgressHandler, ShardProgress
from anex_pipeline_tests.conftest import write_jsonl
from anex_pipeline_tests.test_stop_real import COMMAND, story_rows


def test_plain_progress_lines_at_each_tenth_with_rate_and_eta(capsys: pytest.CaptureFixture[str]) -> None:
    display = ProgressDisplay(tty=False, every_s=3600)
    for done in range(0, 61):  # two shards of 60 rows, one after the other, a row at a time
        display.update(ShardProgress("job", 0, done, 60, completion_tokens=5 * done))
    for done in range(0, 61):
        display.update(ShardProgress("job", 1, done, 60, completion_tokens=5 * done))
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("[anex] 0/60 rows (0%)")  # the second shard is not known yet
    assert lines[-1].startswith("[anex] 120/120 rows (100%)")
    middle = [line for line in lines if "/120 rows" in line and not line.startswith("[anex] 120/120")]
    assert 3 <= len(middle) <= 12  # one line per tenth of the job, not one per row
    assert all("output tok/s" in line for line in lines)
    assert any("left" in line for line in middle)  # an ETA while rows remain


def test_progress_records_feed_the_display_and_other_records_are_printed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = logging.getLogger("anex_pipeline.progress.test")
    log.propagate = False
    log.setLevel(logging.INFO)
    handler = ProgressHandler(ProgressDisplay(tty=False))
    log.addHandler(handler)
    try:
        log.info("loading the model")
        log.info("shard 0: 5/10 rows", extra={PROGRESS_FIELD: ShardProgress("job", 0, 5, 10)})
    finally:
        log.removeHandler(handler)
    assert capsys.readouterr().err.splitlines() == [
        "[anex] loading the model",
        "[anex] 5/10 rows (50%), 0.0 output tok/s",
    ]


def test_engine_chatter_goes_to_the_log_file_and_our_lines_to_the_terminal(tmp_path: Path) -> None:
    """Output below Python (a raw write to descriptor 2, a child process), vLLM-style logging to
    sys.__stderr__ and Python warnings land in the log; what we print to sys.stderr stays on the
    process's real stderr."""
    log_path = tmp_path / "logs" / "run.log"
    script = textwrap.dedent(
        f"""
        import logging, os, subprocess, sys, warnings
        from pathlib import Path
        from anex_pipeline.console import quiet_engine_output
        quiet_engine_output(Path({str(log_path)!r}))
        os.write(2, b"raw write below python\\n")
        subprocess.run(["sh", "-c", "echo child process >&2"], check=True)
        logging.getLogger("vllm.triton_utils").warning("warning before any logging set-up")
        logging.basicConfig(stream=sys.__stderr__)
        logging.getLogger("vllm").warning("engine warning")
        warnings.warn("library deprecation")
        print("[anex] our line", file=sys.stderr)
        assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.__stderr__"
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "[anex] our line\n"
    logged = log_path.read_text()
    chatter = ("raw write below python", "child process", "before any logging", "engine warning", "library deprecation")
    for line in chatter:
        assert line in logged


OUR_LINE = re.compile(r"^(\[anex\] |result: |error: |job )")


@pytest.mark.engine
def test_a_plain_run_shows_our_lines_and_gradual_progress_only(tmp_path: Path) -> None:
    """The installed command on the real engine, stderr not a terminal: progress comes as rows
    finish, and what vLLM, torch and Triton print goes to the log file named on the first line."""
    src = write_jsonl(tmp_path / "in.jsonl", story_rows(120))
    command = [COMMAND, "run", str(src), "-o", str(tmp_path / "out.jsonl"), "--work-dir", str(tmp_path / "work")]
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home")}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    foreign = [line for line in lines if not OUR_LINE.match(line)]
    assert len(foreign) <= 5, "\n".join(foreign)
    counts = [int(m.group(1)) for line in lines if (m := re.match(r"\[anex\] (\d+)/120 rows", line))]
    assert len([c for c in counts if 0 < c < 120]) >= 3, lines
    assert counts == sorted(counts) and counts[-1] == 120
    log = Path(re.search(r"go to (\S+\.log)", done.stderr).group(1))  # type: ignore[union-attr]
    assert "EngineCore" in log.read_text()  # the engine's own chatter is there
    assert json.loads(done.stdout)["request_counts"]["completed"] == 120
