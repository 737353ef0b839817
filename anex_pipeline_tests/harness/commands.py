"""The installed ``anex-pipeline`` command in its own process group: its output read line by line,
``serve`` with an SDK client, and the names of a process family."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from anex_pipeline.engine.orphans import signal_child_group
from anex_pipeline_tests.harness.jobs import chat_row
from anex_pipeline_tests.harness.ports import free_port

COMMAND = str(Path(sys.executable).with_name("anex-pipeline"))
# The command with the slow fake engine behind it (harness/fake_cli.py), for tests that kill it
FAKE_CLI = (sys.executable, "-m", "anex_pipeline_tests.harness.fake_cli")


def story_rows(n: int, topic: str = "animal", longest: int = 64) -> list[dict[str, object]]:
    """Rows that finish at different engine steps (their caps differ, 6 to ``longest`` tokens), so
    progress is gradual."""
    return [
        chat_row(
            f"r{i}",
            f"Tell a story about {topic} number {i}.",
            temperature=0,
            ignore_eos=True,
            max_tokens=6 + (i % 59) * (longest - 6) // 58,
        )
        for i in range(n)
    ]


class Lines:
    """A process's stderr, read line by line in a thread, so a test can wait for a line."""

    def __init__(self, stream: IO[str]):
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            assert line is not None, "the process ended first:\n" + "".join(self.seen)
            self.seen.append(line)
            if re.search(pattern, line):
                return line
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n" + "".join(self.seen))

    def rest(self) -> str:
        while (line := self.lines.get(timeout=30)) is not None:
            self.seen.append(line)
        return "".join(self.seen)


VLLM_CHILD = re.compile(r"\((EngineCore|VllmWorker-\d+|Worker) pid=\d+\)")

VLLM_CHILD_TRACE = re.compile(r"Process (EngineCore|VllmWorker)")


def own_lines(stderr: str) -> str:
    """The lines the command itself wrote, without those of vLLM's engine and worker processes.
    A signal to the process group reaches those too: vLLM's worker exits at once, and an engine
    process caught in the middle of a step logs a traceback of its own (vLLM 0.32)."""
    kept, in_trace = [], False
    for line in stderr.splitlines(keepends=True):
        if VLLM_CHILD.match(line):
            continue
        if VLLM_CHILD_TRACE.match(line):
            in_trace = True
            continue
        if in_trace:
            in_trace = line.startswith((" ", "Traceback"))  # the exception's own line ends it
            continue
        kept.append(line)
    return "".join(kept)


def start(args: list[str], home: Path, **extra_env: str) -> subprocess.Popen[str]:
    env = {**os.environ, "DAGSTER_HOME": str(home), **extra_env}
    home.mkdir(exist_ok=True)
    return subprocess.Popen(
        [COMMAND, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


KEY = "sk-stop-test"


class Served:
    """``anex-pipeline serve`` (with ``serve_args`` and ``env`` added) in its own process group,
    and an SDK client for it. As a context manager, it kills the group on the way out if it is
    still running (a failed test must not leave a server and its engine behind)."""

    def __init__(self, tmp_path: Path, *serve_args: str, **env: str):
        from openai import OpenAI

        port = free_port()
        env_keys = {"ANEX_BATCH_API_KEYS": KEY, "NO_PROXY": "127.0.0.1,localhost"}
        args = ["serve", "--port", str(port), "--work-dir", str(tmp_path / "work"), *serve_args]
        self.process = start(args, tmp_path / "dagster_home", **env_keys, **env)
        self.err = Lines(self.process.stderr)  # type: ignore[arg-type]
        # The server's access log goes to stdout: unread, the pipe fills after some hundred requests
        # and the server blocks on its next log line, answering nothing.
        self.out = Lines(self.process.stdout)  # type: ignore[arg-type]
        self.sdk = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            assert self.process.poll() is None and time.monotonic() < deadline, "serve did not start"
            try:
                self.sdk.batches.list()
                return
            except Exception:  # not listening yet
                time.sleep(0.2)

    def submit(self, path: Path) -> str:
        with path.open("rb") as f:
            uploaded = self.sdk.files.create(file=f, purpose="batch")
        batch = self.sdk.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        return batch.id

    def completed(self, batch_id: str) -> int:
        counts = self.sdk.batches.retrieve(batch_id).request_counts
        return counts.completed if counts is not None else 0

    def wait_for_rows(self, batch_id: str, rows: int, timeout: float = 400) -> int:
        deadline = time.monotonic() + timeout
        while (done := self.completed(batch_id)) < rows:
            assert time.monotonic() < deadline, "no rows finished"
            time.sleep(0.1)
        return done

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            signal_child_group(self.process, signal.SIGKILL)
            self.process.wait(timeout=30)

    def terminate(self, timeout: float) -> float:
        """SIGTERM to the whole process group; returns how long the process took to end."""
        assert signal_child_group(self.process, signal.SIGTERM)
        asked = time.monotonic()
        self.process.wait(timeout=timeout + 30)
        return time.monotonic() - asked


def names(family: dict[int, int]) -> list[str]:
    found = []
    for pid in family:
        try:
            found.append(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace"))
        except OSError:
            found.append("?")
    return found
