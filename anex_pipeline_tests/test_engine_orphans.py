"""`anex-pipeline run` killed with SIGKILL at random moments, while the engine loads and while it
generates: every process the command had started, vLLM's EngineCore and Worker among them, is gone
within 5 s. The command runs in the test's own process group, as from a script, so nothing may
kill the group. The kills take turns between vLLM's engine core in processes of its own and in the
command's process (the command's choice for a small job such as this one)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import pytest

from anex_pipeline.engine.orphans import descendants, kill_all, start_time
from anex_pipeline_tests.harness.commands import names
from anex_pipeline_tests.harness.jobs import chat_row, write_jsonl

pytestmark = pytest.mark.engine

COMMAND = str(Path(sys.executable).with_name("anex-pipeline"))
LOADING, READY = "into vLLM", "engine ready in"  # the command's progress lines


class Run:
    """One `anex-pipeline run` in its own work folder, its progress lines watched as they come."""

    def __init__(self, src: Path, folder: Path, core_in_process: bool):
        env = {**os.environ, "ANEX_WORK_DIR": str(folder / "work"), "DAGSTER_HOME": str(folder / "dagster")}
        if not core_in_process:  # the variable as a user sets it: the command then leaves it alone
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        command = [COMMAND, "run", str(src), "-o", str(folder / "out.jsonl"), "--set", "checkpoint_rows=4"]
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.seen = {LOADING: threading.Event(), READY: threading.Event()}
        self.tail: deque[str] = deque(maxlen=30)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.tail.append(line)
            for text, event in self.seen.items():
                if text in line:
                    event.set()

    def wait_for(self, text: str) -> None:
        if not self.seen[text].wait(600):
            pytest.fail(f"no '{text}' line in 600 s:\n{''.join(self.tail)}")


@pytest.mark.subprocess
def test_killed_run_leaves_no_process_behind(tmp_path: Path) -> None:
    # enough rows and tokens that the engine is still generating seconds after it is ready
    rows = [chat_row(f"r{i}", f"List animals ({i}).", max_tokens=96, temperature=0, ignore_eos=True) for i in range(64)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    # (progress line, seconds after it): three moments in the engine's load, two in generation
    plan = [(LOADING, rng.uniform(0, 2)), (LOADING, rng.uniform(4, 12)), (LOADING, rng.uniform(12, 25))]
    plan += [(READY, rng.uniform(0.5, 3)), (READY, rng.uniform(0.5, 3))]
    started = time.monotonic()
    for n, (line, delay) in enumerate(plan):
        core_in_process = n % 2 == 1
        run = Run(src, tmp_path / f"run{n}", core_in_process)
        family: dict[int, int] = {}
        try:
            run.wait_for(line)
            kill_at = time.monotonic() + delay
            while time.monotonic() < kill_at and run.process.poll() is None:
                family = descendants(run.process.pid, family)  # noted as the guard notes them
                time.sleep(0.1)
            family = descendants(run.process.pid, family)
            core = "in the command" if core_in_process else "in processes"
            where = f"kill {n} ({delay:.1f} s after '{line}', engine core {core}, seed {seed}): {names(family)}"
            assert run.process.poll() is None, f"the run ended before the {where}"
            if line == READY:  # generating: vLLM's engine processes are among the family, or none is
                engine = {"VLLM::EngineCore", "VLLM::Worker"}
                assert engine.isdisjoint(names(family)) if core_in_process else engine <= set(names(family)), where
            run.process.kill()
            run.process.wait()
            deadline = time.monotonic() + 5
            while (alive := [pid for pid, start in family.items() if start_time(pid) == start]) and (
                time.monotonic() < deadline
            ):
                time.sleep(0.05)
            assert not alive, f"alive 5 s after {where}: {names(dict.fromkeys(alive, 0))}"
        finally:
            run.process.kill()
            kill_all(family)
    print(f"{len(plan)} killed runs in {time.monotonic() - started:.0f} s (seed {seed})")
