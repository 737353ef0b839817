"""A warm engine between runs of the command: ``run --keep-engine`` leaves the machine's shared
model server up, and the next run on the same model and engine settings uses it instead of
loading vLLM, so its first answer comes within seconds of the command's start. Real commands,
a real ``vllm serve`` on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from anex_pipeline.engine.server.machine_server import alive, read_state, starts, stop_server
from anex_pipeline_tests.harness.jobs import REPO, chat_row, read_jsonl, write_jsonl

FIRST_ANSWER_S = 5.0


def command(src: Path, out: Path, *more: str) -> list[str]:
    return [
        sys.executable, "-m", "anex_pipeline.cli", "run", str(src), "-o", str(out), "--max-model-len", "2048",
        "--quiet", "--json", "--set", "checkpoint_rows=1", *more,
    ]  # fmt: skip


def first_checkpointed(work: Path, process: subprocess.Popen[str], timeout_s: float = 300) -> None:
    """Waits until a row of some job under ``work`` is in its checkpoint (written row by row)."""
    deadline = time.monotonic() + timeout_s
    while not any(path.stat().st_size for path in work.glob("*/shards/*/results.jsonl")):
        assert process.poll() is None or process.returncode == 0, process.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "no answer was written"
        time.sleep(0.05)


@pytest.mark.subprocess
@pytest.mark.vllm_serve
@pytest.mark.engine
def test_the_run_after_keep_engine_answers_within_seconds(tmp_path: Path) -> None:
    server_dir, work = tmp_path / "machine-server", tmp_path / "work"
    env = {**os.environ, "ANEX_MACHINE_SERVER_DIR": str(server_dir), "ANEX_WORK_DIR": str(work)}
    env.pop("ANEX_MACHINE_SERVER", None)
    first_in = write_jsonl(
        tmp_path / "a.jsonl", [chat_row(f"a{i}", f"Name a colour, {i}.", max_tokens=6) for i in range(4)]
    )
    second_in = write_jsonl(
        tmp_path / "b.jsonl", [chat_row(f"b{i}", f"Name a fruit, {i}.", max_tokens=6) for i in range(4)]
    )
    try:
        first = subprocess.run(
            command(first_in, tmp_path / "a.out.jsonl", "--keep-engine"),
            env=env, cwd=REPO, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert first.returncode == 0, first.stderr[-2000:]
        assert json.loads(first.stdout)["engine"]["kind"] == "machine_server"
        state = read_state(server_dir)
        assert state is not None and alive(state), "the server stays up after the command"

        started = time.monotonic()
        second = subprocess.Popen(
            command(second_in, tmp_path / "b.out.jsonl"),
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        first_checkpointed(work, second)
        first_answer_s = time.monotonic() - started
        stdout, stderr = second.communicate(timeout=300)
        assert second.returncode == 0, stderr[-2000:]
        report = json.loads(stdout)
        assert report["engine"]["kind"] == "machine_server" and report["request_counts"]["completed"] == 4
        assert starts(server_dir) == 1, "the second run loaded no model"
        assert [r["custom_id"] for r in read_jsonl(tmp_path / "b.out.jsonl")] == [f"b{i}" for i in range(4)]
        assert first_answer_s < FIRST_ANSWER_S, f"the second run's first answer took {first_answer_s:.1f} s"
    finally:
        stop_server(server_dir)


@pytest.mark.subprocess
@pytest.mark.engine
def test_without_a_warm_server_the_command_loads_its_own_engine_and_starts_none(tmp_path: Path) -> None:
    server_dir = tmp_path / "machine-server"
    env = {**os.environ, "ANEX_MACHINE_SERVER_DIR": str(server_dir), "ANEX_WORK_DIR": str(tmp_path / "work")}
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("x", "Say hi.", max_tokens=4)])
    done = subprocess.run(
        command(src, tmp_path / "out.jsonl"), env=env, cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["engine"]["kind"] == "vllm"
    assert starts(server_dir) == 0 and read_state(server_dir) is None
