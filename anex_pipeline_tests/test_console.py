"""The terminal: our lines and progress on stderr, the engine's and libraries' chatter in a log file."""

from __future__ import annotations

import json
import logging
import os
import re
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import dagster as dg
import pytest

from anex_pipeline.console import (
    PROGRESS_FIELD,
    EngineLoad,
    ProgressDisplay,
    ProgressHandler,
    ShardProgress,
    summary_lines,
)
from anex_pipeline.spec import JobReport, RequestCounts, Throughput, Usage
from anex_pipeline_tests.harness.commands import COMMAND, story_rows
from anex_pipeline_tests.harness.jobs import chat_row, write_jsonl


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def loaded(display: ProgressDisplay, clock: FakeClock, seconds: float) -> None:
    """The engine's loading as the engine module reports it, taking ``seconds``."""
    display.engine(EngineLoad("m", "loading"), "[anex] loading m into vLLM")
    clock.t += seconds
    display.engine(EngineLoad("m", "ready"), f"[anex] engine ready in {seconds:.1f} s")


def test_plain_progress_lines_at_each_tenth_with_rate_and_eta(capsys: pytest.CaptureFixture[str]) -> None:
    clock = FakeClock()
    display = ProgressDisplay(tty=False, every_s=3600, clock=clock)
    loaded(display, clock, 5)
    for shard in (0, 1):  # two shards of 60 rows, one after the other, a row a second
        for done in range(0, 61):
            display.update(ShardProgress("job", shard, done, 60, completion_tokens=5 * done))
            clock.t += 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[:3] == ["[anex] loading m into vLLM", "[anex] engine ready in 5.0 s", "[anex] 0/60 rows (0%)"]
    assert lines[-1].startswith("[anex] 120/120 rows (100%), 1.0 rows/s, 5.0 output tok/s")
    middle = [line for line in lines if "/120 rows" in line and not line.startswith("[anex] 120/120")]
    assert 3 <= len(middle) <= 12  # one line per tenth of the job, not one per row
    assert all("rows/s" in line and "output tok/s" in line and "left" in line for line in middle)


def test_no_rows_before_the_engine_is_ready_and_rates_count_from_generation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A shard that waits 90 s for its engine, then 8 rows in 8 s at 25 output tok/s: nothing is
    said about rows during the load, and the rate and time left are the generation's."""
    clock = FakeClock()
    display = ProgressDisplay(tty=False, every_s=3600, clock=clock)
    display.update(ShardProgress("job", 0, 0, 8, waiting=True))
    display.engine(EngineLoad("m", "loading"), "[anex] loading m into vLLM")
    clock.t += 90
    display.engine(EngineLoad("m", "ready"), "[anex] engine ready in 90.0 s")
    display.update(ShardProgress("job", 0, 0, 8))
    for done in range(1, 9):
        clock.t += 1
        display.update(ShardProgress("job", 0, done, 8, completion_tokens=25 * done))
    lines = capsys.readouterr().err.splitlines()
    assert lines[:3] == ["[anex] loading m into vLLM", "[anex] engine ready in 90.0 s", "[anex] 0/8 rows (0%)"]
    assert "[anex] 4/8 rows (50%), 1.0 rows/s, 25.0 output tok/s, about 4.0s left" in lines
    assert lines[-1] == "[anex] 8/8 rows (100%), 1.0 rows/s, 25.0 output tok/s"


def test_the_rate_starts_again_after_a_pause(capsys: pytest.CaptureFixture[str]) -> None:
    """Rows at 1 a second, a minute with none (a model server died and its rows went to the
    others), then 1 every 2 seconds: the time left is the new pace's, not an average over the pause."""
    clock = FakeClock()
    display = ProgressDisplay(tty=False, every_s=0, clock=clock)
    loaded(display, clock, 1)
    display.update(ShardProgress("job", 0, 0, 100))
    for done in range(1, 41):
        clock.t += 1
        display.update(ShardProgress("job", 0, done, 100))
    clock.t += 60
    for done in range(41, 51):
        clock.t += 2
        display.update(ShardProgress("job", 0, done, 100))
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == "[anex] 50/100 rows (50%), 0.5 rows/s, 0.0 output tok/s, about 1m40s left", last


def test_the_time_left_follows_the_latest_half_of_the_rows(capsys: pytest.CaptureFixture[str]) -> None:
    """Five rows a second apart while another process held the cores, then ten a second: at
    half-way the time left is the new pace's (2 s for 20 rows), not the whole's (near 6 s)."""
    clock = FakeClock()
    display = ProgressDisplay(tty=False, every_s=0, clock=clock)
    loaded(display, clock, 1)
    display.update(ShardProgress("job", 0, 0, 40))
    for done in range(1, 21):
        clock.t += 1 if done <= 5 else 0.1
        display.update(ShardProgress("job", 0, done, 40))
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == "[anex] 20/40 rows (50%), 10.0 rows/s, 0.0 output tok/s, about 2.0s left", last


def test_the_time_left_of_a_batch_that_empties_follows_its_quickening_pace() -> None:
    """Forty rows generated together, one finishing per engine step, each step costing 20 ms plus
    5 ms per row still in the batch: from a quarter to three quarters of the rows the time left is
    within 1.3x of the truth, where the recent pace alone said up to twice (and more) too long."""
    clock = FakeClock()
    display = ProgressDisplay(tty=False, every_s=3600, clock=clock)
    loaded(display, clock, 1)
    display.update(ShardProgress("job", 0, 0, 40))
    steps = [0.02 + 0.005 * (40 - k) for k in range(40)]
    clock.t += 0.5  # the shortest answer's first steps
    ratios, steady_ratios = [], []
    for done in range(1, 40):
        clock.t += steps[done - 1]
        display.update(ShardProgress("job", 0, done, 40))
        if 10 <= done <= 30:
            truth = sum(steps[done:])
            state = display._clock
            assert state is not None
            since, first = state.recent(done)
            steady_ratios.append((40 - done) * (clock.t - since) / (done - first) / truth)
            ratios.append(state.seconds_left(done, 40, clock.t) / truth)
    assert max(steady_ratios) > 2, steady_ratios  # what the recent pace alone would have shown
    assert all(0.77 <= r <= 1.3 for r in ratios), ratios


def test_an_engine_loaded_again_restarts_the_rate(capsys: pytest.CaptureFixture[str]) -> None:
    clock = FakeClock()
    display = ProgressDisplay(tty=False, every_s=0, clock=clock)
    loaded(display, clock, 1)
    for done in range(0, 11):
        display.update(ShardProgress("job", 0, done, 20))
        clock.t += 1
    display.update(ShardProgress("job", 0, 10, 20, waiting=True))  # the step runs again after the engine died
    loaded(display, clock, 120)
    display.update(ShardProgress("job", 0, 10, 20))
    for done in range(11, 15):
        clock.t += 0.5
        display.update(ShardProgress("job", 0, done, 20))
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == "[anex] 14/20 rows (70%), 2.0 rows/s, 0.0 output tok/s, about 3.0s left", last


def test_a_terminal_shows_the_loading_time_as_it_grows(capsys: pytest.CaptureFixture[str]) -> None:
    clock = FakeClock()
    display = ProgressDisplay(tty=True, clock=clock)
    display.update(ShardProgress("job", 0, 0, 8, waiting=True))
    display.engine(EngineLoad("m", "loading"), "[anex] loading m into vLLM")
    clock.t += 42
    seen, deadline = "", time.monotonic() + 10
    while "(42s)" not in seen and time.monotonic() < deadline:
        time.sleep(0.05)
        seen += capsys.readouterr().err
    assert "\r\x1b[K[anex] loading m into vLLM (0.0s)" in seen and "[anex] loading m into vLLM (42s)" in seen
    display.engine(EngineLoad("m", "ready"), "[anex] engine ready in 42.0 s")
    display.close()
    after = capsys.readouterr().err
    assert after.endswith("\r\x1b[K[anex] engine ready in 42.0 s\n"), repr(after)
    assert "rows" not in seen + after  # the waiting shard said nothing about rows


def test_progress_records_feed_the_display_and_other_records_are_printed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = logging.getLogger("anex_pipeline.progress.test")
    log.propagate = False
    log.setLevel(logging.INFO)
    handler = ProgressHandler(ProgressDisplay(tty=False))
    log.addHandler(handler)
    try:
        log.info("checking the input")
        log.info("loading m into vLLM", extra={PROGRESS_FIELD: EngineLoad("m", "loading")})
        log.info("shard 0: 0/10 rows", extra={PROGRESS_FIELD: ShardProgress("job", 0, 0, 10, waiting=True)})
        log.info("engine ready in 3.0 s", extra={PROGRESS_FIELD: EngineLoad("m", "ready")})
        log.info("shard 0: 5/10 rows", extra={PROGRESS_FIELD: ShardProgress("job", 0, 5, 10)})
    finally:
        log.removeHandler(handler)
    assert capsys.readouterr().err.splitlines() == [
        "[anex] checking the input",
        "[anex] loading m into vLLM",
        "[anex] engine ready in 3.0 s",
        "[anex] 5/10 rows (50%)",
    ]


def test_the_summary_is_a_few_aligned_lines() -> None:
    report = JobReport(
        job_id="j",
        status="completed",
        output="out/r.jsonl",
        request_counts=RequestCounts(total=10, completed=5, failed=5, format_error_rows=1),
        error_counts={
            "context_length_exceeded": 2,
            "media_fetch_error": 1,
            "server_error": 1,
            "engine_error": 1,
            "length": 3,
            "format_error": 1,
        },
        usage=Usage(prompt_tokens=500, completion_tokens=120, cached_prompt_tokens=128),
        throughput=Throughput(rows_per_s=1.25, output_tokens_per_s=25.7),
        cost=0.01234,
    )
    spent = {"engine_load": 91.2, "generate": 6.5, "estimate": 0.4, "merge": 0.1}
    lines = summary_lines(report, "out/r.jsonl.report.json", "error", spent, 98.0)
    assert lines == [
        "status      completed",
        "rows        5 completed (3 reached the token cap), 5 failed, 1 format errors, of 10",
        "errors      2 context_length_exceeded, 1 engine_error, 1 media_fetch_error, and 1 more kind",
        "tokens      500 in (128 cached), 120 out",
        "time        1m38s: engine start 1m31s, generation 6.9s",
        "speed       25.7 output tok/s, 1.2 rows/s",
        "cost        0.0123 (at the job's prices)",
        "result      out/r.jsonl",
        "error rows  the 5 rows of the result whose error is set",
        "report      out/r.jsonl.report.json",
    ]
    stopped = report.model_copy(update={"status": "stopped_early", "request_counts": RequestCounts(total=10)})
    lines = summary_lines(stopped, "r.report.json", "error_type", {}, 3.0)
    assert lines[0] == "status      stopped early" and "10 have no result" in lines[1]
    assert "result      none published: no row has a result" in lines


@pytest.mark.subprocess
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


OUR_LINE = re.compile(
    r"^(\[anex\] |error: |job |(status|rows|errors|tokens|time|speed|cost|result|error rows|report) +)"
)


@pytest.mark.subprocess
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
    ready = next(i for i, line in enumerate(lines) if line.startswith("[anex] engine ready in "))
    assert not [line for line in lines[:ready] if re.search(r"rows/s|tok/s|\d+/\d+ rows", line)], lines[:ready]
    foreign = [line for line in lines if not OUR_LINE.match(line)]
    assert len(foreign) <= 5, "\n".join(foreign)
    counts = [int(m.group(1)) for line in lines if (m := re.match(r"\[anex\] (\d+)/120 rows", line))]
    assert len([c for c in counts if 0 < c < 120]) >= 3, lines
    assert counts == sorted(counts) and counts[-1] == 120
    log = Path(re.search(r"go to (\S+\.log)", done.stderr).group(1))  # type: ignore[union-attr]
    assert "Resolved architecture" in log.read_text()  # the engine's own chatter is there
    assert json.loads(done.stdout)["request_counts"]["completed"] == 120


# -- the end of a run, and the figures in Dagster ------------------------------------------------


SUMMARY_LABELS = ("status", "rows", "errors", "tokens", "time", "speed", "cost", "result", "error rows", "report")


def summary_of(stderr: str) -> list[str]:
    """The summary that ends the command's output: the lines from its status line on."""
    lines = stderr.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("status "))
    return lines[start:]


@pytest.mark.slow
def test_the_run_ends_with_a_summary_and_the_json_report_only_when_piped_or_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from anex_pipeline.cli import main

    monkeypatch.setenv("ANEX_ENGINE", "fake")
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    rows = [chat_row(f"r{i}", f"question {i}") for i in range(5)] + [chat_row("long", "word " * 300)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    prices = 'prices={"input_per_1k": 1.0, "output_per_1k": 2.0}'
    argv = ["run", str(src), "-o", str(out), "--max-tokens", "8", "--set", prices, "--work-dir", str(tmp_path / "w")]

    assert main(argv) == 0  # standard output is not a terminal here: the JSON report is on it
    piped = capsys.readouterr()
    report = json.loads(piped.out)
    assert report["request_counts"] == {"total": 6, "completed": 5, "failed": 1, "format_error_rows": 0}
    summary = summary_of(piped.err)
    assert len(summary) <= 12 and [line[:12].strip() for line in summary] == [
        label for label in SUMMARY_LABELS if label != "error rows" or report["request_counts"]["failed"]
    ]
    assert summary[1] == "rows        5 completed, 1 failed, 0 format errors, of 6"
    assert summary[2] == "errors      1 context_length_exceeded"
    assert summary[3].startswith(f"tokens      {report['usage']['prompt_tokens']} in (0 cached), ")
    assert summary[6] == f"cost        {report['cost']:.4f} (at the job's prices)"
    assert summary[7] == f"result      {out}" and summary[-1] == f"report      {tmp_path / 'out.report.json'}"

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(argv) == 0  # at a terminal: the summary alone
    terminal = capsys.readouterr()
    assert terminal.out == "" and summary_of(terminal.err)[0] == "status      completed"
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["job_id"] == report["job_id"]


def test_generation_figures_reach_the_materialization_and_the_run_log(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    from anex_pipeline.orchestration.resources import StorageResource
    from anex_pipeline.runner import JobRunner
    from anex_pipeline.testing import fake_engine

    rows = [chat_row(f"r{i}", " ".join(["w"] * (i % 7 + 1))) for i in range(30)] + [chat_row("long", "w " * 300)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    runner = JobRunner(instance, StorageResource(work_root=str(tmp_path / "w")), fake_engine())
    report = runner.run(runner.submit(str(src), str(tmp_path / "out.jsonl"), {"estimate_sample_size": 20}))
    record = instance.fetch_materializations(dg.AssetKey("generations"), limit=1).records[0]
    meta = {k: v.value for k, v in record.asset_materialization.metadata.items()}
    assert meta["error_counts"] == report.error_counts == {"context_length_exceeded": 1}
    assert meta["cached_prompt_tokens"] == report.usage.cached_prompt_tokens
    assert meta["completion_tokens"] == report.usage.completion_tokens
    assert meta["generation_s"] > 0 and meta["rows_per_s"] > 0 and meta["output_tokens_per_s"] >= 0
    merged = instance.fetch_materializations(dg.AssetKey("merged_result"), limit=1).records[0]
    job_meta = {k: v.value for k, v in merged.asset_materialization.metadata.items()}
    assert job_meta["error_counts"] == report.error_counts
    assert job_meta["output_tokens_per_s"] == report.throughput.output_tokens_per_s
    assert job_meta["cached_prompt_tokens"] == report.usage.cached_prompt_tokens
    logged = [e.user_message for e in instance.all_logs(record.run_id)]
    assert any(m.startswith("30 of 31 rows completed, 1 failed, 0 format errors") for m in logged), logged

    estimate = instance.fetch_materializations(dg.AssetKey("length_estimate"), limit=1).records[0]
    histogram = estimate.asset_materialization.metadata["output_length_histogram"].value
    lengths = json.loads(estimate.asset_materialization.metadata["sample_lengths"].value)
    lines = histogram.splitlines()
    assert lines[:2] == ["| output tokens | rows | |", "|---|---:|---|"]
    assert sum(int(line.split("|")[2]) for line in lines[2:] if line.split("|")[2].strip()) == len(lengths) >= 19
    assert "█" in histogram and "(max_tokens)" in histogram


BAR = re.compile(
    r"\[anex\]\s+\d+%\|[^|]*\| (\d+)/(\d+) rows(?:, ([\d.]+) rows/s, ([\d.]+) output tok/s)?(?:, about (\S+) left)?"
)


def seconds_of(text: str) -> float:
    """A duration as the display prints it: 6.5s, 1m05s, 1h02m."""
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:([\d.]+)s)?", text)
    assert m is not None and text, text
    hours, minutes, secs = (float(g) if g else 0.0 for g in m.groups())
    return 3600 * hours + 60 * minutes + secs


class Terminal:
    """A command on a pseudo-terminal (120 columns), its output read as it comes: each piece of
    a line (a bar redraws its line after a carriage return) with the time its first character
    arrived."""

    def __init__(self, command: list[str], env: dict[str, str]):
        import fcntl
        import pty
        import struct
        import termios
        import threading

        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.proc = subprocess.Popen(command, env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        self.pieces: list[tuple[float, str]] = []
        self.text = ""
        self._master = master
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        pending, began = "", 0.0  # the piece not ended yet, and when it began
        while True:
            try:
                data = os.read(self._master, 65536)
            except OSError:  # EIO: every holder of the terminal's other end has closed it
                break
            if not data:
                break
            now = time.monotonic()
            chunk = data.decode("utf-8", "replace")
            self.text += chunk
            first, *more = re.split(r"[\r\n]", chunk)
            began = began if pending else now
            pending += first
            for piece in more:
                self._add(began, pending)
                pending, began = piece, now
        self._add(began, pending)

    def _add(self, began: float, piece: str) -> None:
        self.pieces.append((began, re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", piece)))

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=30)
        os.close(self._master)
        return code


@pytest.mark.subprocess
@pytest.mark.engine
def test_a_run_at_a_terminal_tells_the_truth_and_ends_with_a_short_summary(tmp_path: Path) -> None:
    """The real command on the real engine under a pseudo-terminal, then piped: no row or rate
    before the engine is ready, a loading line that counts the seconds, a time left in the middle
    of the job within a factor of 2 of the time that was really left (the median of its frames),
    and a summary of at most 12 lines; piped, the JSON report on standard output."""
    rows = story_rows(40)
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home")}
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    command = [COMMAND, "run", str(src), "-o", str(tmp_path / "out.jsonl"), "--work-dir", str(tmp_path / "work")]
    terminal = Terminal(command, env)
    assert terminal.wait(timeout=600) == 0, terminal.text
    pieces = [(t, piece) for t, piece in terminal.pieces if piece.strip()]
    texts = [piece for _, piece in pieces]

    ready = next(i for i, text in enumerate(texts) if text.startswith("[anex] engine ready in "))
    before = texts[:ready]
    assert not [text for text in before if re.search(r"rows/s|tok/s|\d+/\d+ rows|\d+%\|", text)], before
    loading = [
        text for text in before if re.fullmatch(r"\[anex\] loading \S+ into vLLM \((?:[\d.]+s|\d+m\d+s)\)", text)
    ]
    assert len({text for text in loading}) >= 2, before  # the seconds grew while it loaded

    frames = [(t, m) for t, text in pieces[ready:] if (m := BAR.search(text))]
    assert frames, texts
    finished = next(t for t, m in frames if m.group(1) == m.group(2))
    # The time left shown against the time really left, from a quarter to three quarters of the rows:
    # their median within a factor of 2 (on a shared machine one moment's pace can be far off).
    middle = [(t, m) for t, m in frames if m.group(5) and 1 <= 4 * int(m.group(1)) / int(m.group(2)) <= 3]
    ratios = sorted(seconds_of(m.group(5)) / (finished - t) for t, m in middle)
    timeline = [(round(t - frames[0][0], 2), int(m.group(1)), m.group(5)) for t, m in frames]
    assert len(ratios) >= 5 and 0.5 <= statistics.median(ratios) <= 2, (ratios, timeline)

    summary = summary_of("\n".join(texts))
    assert len(summary) <= 12 and summary[0] == "status      completed", summary
    assert not any(text.lstrip().startswith("{") for text in texts)  # no JSON report at a terminal

    piped = subprocess.run([*command, "--quiet"], env=env, capture_output=True, text=True, timeout=600)
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout)["request_counts"]["completed"] == len(rows)
    assert summary_of(piped.stderr)[0] == "status      completed"
