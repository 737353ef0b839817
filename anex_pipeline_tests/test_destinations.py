"""A job never writes over a file it reads: an output or report that is the input, the input's
options sidecar or the options file (by any spelling of the path: relative, ``..``, symlinks,
hard links), or that is the other one, is refused at submit with exit 2. Files that are not
regular files (FIFOs, folders) are refused without being waited on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from anex_pipeline import cli
from anex_pipeline.cli import commands
from anex_pipeline.errors import ExitCode
from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.deployment import local_deployment, submitted
from anex_pipeline_tests.harness.jobs import chat_row, local_instance, read_jsonl, write_jsonl

T = TypeVar("T")

# Names in the job's folder, by the file they lead to (a symlink and a hard link to each).
SAME_FILE = {
    "input": ["in.jsonl", "ln_in", "hard_in"],
    "sidecar": ["in.jsonl.job.json", "ln_sidecar", "hard_sidecar"],
    "options": ["opts.json", "ln_opts", "hard_opts"],
}
FREE_NAMES = ["out.jsonl", "res.json", "sub/out.jsonl", "sub"]  # "sub" is a folder
FILE_OF = {name: file for file, names in SAME_FILE.items() for name in names} | {n: n for n in FREE_NAMES}
# Spellings of the job's folder: itself, through a folder and back (one that exists, one that
# does not, a symlink to one), and its absolute path.
PREFIXES = ["", "./", "sub/../", "ln_sub/../", "nothere/../", "sub/./../", "{root}/"]
# Half the draws are files the job may write, so that runs that go through are drawn as well.
name = st.sampled_from(["out.jsonl", "res.json", "sub/out.jsonl"]) | st.sampled_from(sorted(FILE_OF))
destination = st.tuples(st.sampled_from(PREFIXES), name)
readable = [p for p in PREFIXES if not p.startswith("nothere")]  # a read does not make folders
options_file = st.tuples(st.sampled_from(readable), st.sampled_from(SAME_FILE["options"]))


def make_folder(root: Path) -> dict[str, bytes]:
    """The input, its sidecar, an options file and links to each; returns their contents."""
    (root / "sub").mkdir()
    (root / "ln_sub").symlink_to("sub")
    write_jsonl(root / "in.jsonl", [chat_row(f"{uuid.uuid4().hex}-{n}", f"say {n}") for n in range(3)])
    (root / "in.jsonl.job.json").write_text('{"max_tokens": 7}')
    (root / "opts.json").write_text('{"max_tokens": 5}')
    for name, target in (("in", "in.jsonl"), ("sidecar", "in.jsonl.job.json"), ("opts", "opts.json")):
        (root / f"ln_{name}").symlink_to(target)
        os.link(root / target, root / f"hard_{name}")
    return {file: (root / names[0]).read_bytes() for file, names in SAME_FILE.items()}


def spelled(root: Path, prefix: str, name: str) -> str:
    return prefix.format(root=root) + name


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(output=destination, report=st.none() | destination, options=st.none() | options_file)
@example(output=("", "in.jsonl"), report=None, options=None)
@example(output=("sub/../", "in.jsonl"), report=None, options=None)
@example(output=("nothere/../", "ln_in"), report=None, options=None)
@example(output=("nothere/../", "hard_in"), report=None, options=None)
@example(output=("", "out.jsonl"), report=("", "in.jsonl"), options=None)
@example(output=("", "opts.json"), report=None, options=("", "opts.json"))
@example(output=("", "hard_in"), report=None, options=None)
@example(output=("ln_sub/../", "ln_sidecar"), report=None, options=None)
@example(output=("", "out.jsonl"), report=("./", "out.jsonl"), options=None)
@example(output=("", "out.jsonl"), report=None, options=("", "hard_opts"))
@example(output=("", "ln_opts"), report=("", "opts.json"), options=None)
@example(output=("{root}/", "out.jsonl"), report=("sub/../", "res.json"), options=("ln_sub/../", "ln_opts"))
def test_no_output_or_report_path_writes_over_what_the_job_reads(
    fake_runner: JobRunner,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    output: tuple[str, str],
    report: tuple[str, str] | None,
    options: tuple[str, str] | None,
) -> None:
    monkeypatch.setattr(commands, "_runner", lambda args: fake_runner)
    with tempfile.TemporaryDirectory(dir=tmp_path) as folder, monkeypatch.context() as m:
        root = Path(folder)
        m.chdir(root)
        contents = make_folder(root)
        read = {"input", "sidecar"} | ({"options"} if options else set())
        argv = ["run", "in.jsonl", "-o", spelled(root, *output), "--quiet"]
        argv += ["--report", spelled(root, *report)] if report else []
        argv += ["--options", spelled(root, *options)] if options else []

        code = cli.main(argv)

        assert {f: (root / SAME_FILE[f][0]).read_bytes() for f in read} == {f: contents[f] for f in read}
        # The outcome, worked out from the names alone: which file each path leads to.
        written = [FILE_OF[output[1]]] + ([FILE_OF[report[1]]] if report else [])
        refused = bool(read & set(written)) or "sub" in written or len(set(written)) < len(written)
        event("refused" if refused else "written")
        assert code == (ExitCode.REJECTED if refused else ExitCode.OK)
        if not refused:
            assert len(read_jsonl(root / output[1])) == 3


def test_refusal_names_what_would_be_overwritten(
    fake_runner: JobRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(commands, "_runner", lambda args: fake_runner)
    monkeypatch.chdir(tmp_path)
    make_folder(tmp_path)
    assert cli.main(["run", "in.jsonl", "-o", "out.jsonl", "--options", "opts.json", "--report", "hard_opts"]) == 2
    err = capsys.readouterr().err
    assert "field 'report': hard_opts is the options file" in err and "choose another path" in err, err
    # Our own "[anex] checking ..." line shows when an earlier test of the session left the
    # command's progress handler on its logger; the refusal itself is two lines either way.
    refusal = [line for line in err.strip().splitlines() if not line.startswith("[anex] ")]
    assert len(refusal) == 2 and "Traceback" not in err, err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.subprocess
def test_the_real_command_refuses_an_output_that_is_its_input(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("a", "hi")])
    before = src.read_bytes()
    env = os.environ | {"DAGSTER_HOME": str(tmp_path / "dagster"), "ANEX_WORK_DIR": str(tmp_path / "work")}
    command = Path(sys.executable).parent / "anex-pipeline"
    done = subprocess.run(
        [command, "run", "in.jsonl", "-o", "in.jsonl"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "in.jsonl is the input" in done.stderr and "Traceback" not in done.stderr
    assert src.read_bytes() == before
    assert not (tmp_path / "in.report.json").exists()


# --- files that are not regular files ----------------------------------------------------------


def without_hanging(work: Callable[[], T], fifo: Path) -> T:
    """``work()``, failing the test if it waits on ``fifo`` (which is then released)."""
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:  # raised again in the test's thread
            errors.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(60)
    if worker.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer that comes and goes ends the read
        worker.join(60)
        pytest.fail(f"waited on the FIFO {fifo}")
    if errors:
        raise errors[0]
    return result[0]


@pytest.mark.parametrize(
    ("fifo", "args", "says"),
    [
        pytest.param(
            "in.jsonl.job.json",
            ["validate", "in.jsonl"],
            "in.jsonl.job.json is not a regular file",
            id="sidecar-validate",
        ),
        pytest.param(
            "in.jsonl.job.json", ["run", "in.jsonl", "-o", "out.jsonl"], "is not a regular file", id="sidecar-run"
        ),
        pytest.param(
            "f", ["validate", "in.jsonl", "--options", "f"], "options file f is not a regular file", id="options"
        ),
        pytest.param("f", ["validate", "in.jsonl", "--response-format", "@f"], "f is not a regular file", id="at-file"),
        pytest.param("f", ["validate", "f"], "input f is not a file", id="input-validate"),
        pytest.param("f", ["run", "f", "-o", "out.jsonl"], "input f is not a file", id="input-run"),
        pytest.param("f", ["run", "in.jsonl", "-o", "f"], "f exists and is not a regular file", id="output"),
        pytest.param("f", ["run", "in.jsonl", "-o", "out.jsonl", "--report", "f"], "field 'report'", id="report"),
        pytest.param(
            None, ["run", "in.jsonl", "-o", "sub"], "sub exists and is not a regular file", id="output-folder"
        ),
    ],
)
def test_fifos_and_folders_are_refused_without_waiting(
    fifo: str | None,
    args: list[str],
    says: str,
    fake_runner: JobRunner,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(commands, "_runner", lambda args: fake_runner)
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "in.jsonl", [chat_row("a", "hi")])
    (tmp_path / "sub").mkdir()
    if fifo:
        os.mkfifo(tmp_path / fifo)
    assert without_hanging(lambda: cli.main(args), tmp_path / (fifo or "sub")) == ExitCode.REJECTED
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    assert not (tmp_path / "out.jsonl").exists() and (tmp_path / (fifo or "sub")).exists()


def test_the_local_inbox_skips_a_fifo_sidecar_without_waiting(tmp_path: Path) -> None:
    inbox = tmp_path / "drop"
    inbox.mkdir()
    write_jsonl(inbox / "a.jsonl", [chat_row("a", "hi")])
    os.mkfifo(inbox / "a.jsonl.job.json")
    good = write_jsonl(inbox / "b.jsonl", [chat_row("b", "hi")])
    with local_instance(set_dagster_home=True) as instance:  # on disk: a sensor tick reopens it by reference
        deployment = local_deployment(tmp_path, instance, folder=str(inbox), outbox=str(tmp_path / "done"))
        data = without_hanging(lambda: deployment.tick("local_inbox"), inbox / "a.jsonl.job.json")
    assert [c["input"] for c in submitted(data)] == [str(good)]


def test_an_options_file_that_is_not_utf8_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("a", "hi")])
    Path(f"{src}.job.json").write_bytes(b'{"system_prompt": "caf\xe9"}')
    assert cli.main(["validate", str(src)]) == 2
    err = capsys.readouterr().err
    assert "is not UTF-8 text" in err and "Traceback" not in err, err


def test_the_options_read_still_reach_the_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("a", "hi")])
    opts = tmp_path / "opts.json"
    opts.write_text(json.dumps({"seed": 2**64}))
    assert cli.main(["validate", str(src), "--options", str(opts)]) == 2
    assert "field 'seed'" in capsys.readouterr().err
    assert cli.main(["validate", str(src), "--response-format", f"@{opts}"]) == 2  # not a response format
    assert "response_format.type" in capsys.readouterr().err
