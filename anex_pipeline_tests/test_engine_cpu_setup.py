"""vLLM's CPU engine processes start as engine/vllm/cpu_environment.py sets them up: on a small machine
the model's threads are bound to every core this process may use (vLLM alone would keep one out),
and tcmalloc, when installed, is loaded into them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from anex_pipeline.engine.orphans import descendants
from anex_pipeline.engine.vllm.cpu_environment import FEW_CORES, RESERVED_CORES_ENV, _tcmalloc
from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.jobs import chat_row, run_job, write_jsonl

pytestmark = pytest.mark.engine


def cpu_list(text: str) -> set[int]:
    """The cores of a list such as ``0-2,5``."""
    cores: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def bound_cores(pid: int) -> set[int]:
    """The cores the process's threads pinned to a single core are pinned to (OpenMP's threads)."""
    bound: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        allowed = cpu_list(status.split("Cpus_allowed_list:")[1].split()[0])
        if len(allowed) == 1:
            bound |= allowed
    return bound


def test_the_model_runs_on_every_core_with_tcmalloc(tmp_path: Path, real_runner: JobRunner) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("a", "Hi", max_tokens=2)])
    assert run_job(real_runner, src, tmp_path / "out.jsonl").status == "completed"  # the engine is loaded

    workers = [
        pid for pid in descendants(os.getpid()) if Path(f"/proc/{pid}/comm").read_text().strip() == "VLLM::Worker"
    ]
    assert workers, "no vLLM worker process under this one"
    cores = os.sched_getaffinity(0)
    for pid in workers:
        if len(cores) <= FEW_CORES:
            assert os.environ[RESERVED_CORES_ENV] == "0"
            assert bound_cores(pid) == cores
        assert ("libtcmalloc" in Path(f"/proc/{pid}/maps").read_text()) == (_tcmalloc() is not None)
