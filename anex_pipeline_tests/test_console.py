"""The terminal: our lines and progress on stderr, the engine's and libraries' chatter in a log file."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from anex_pipeline.console import PROGRESS_FIELD, ProgressDisplay, ProgressHandler, ShardProgress


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
