"""The command's own help: every job flag says what it does and what happens without it."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version

import pytest

from anex_pipeline import cli
from anex_pipeline.cli.parser import BOOL_FLAGS, OPTION_FLAGS, build_parser


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"anex-pipeline {version('anex-pipeline')}"


def test_every_job_flag_has_help_that_names_its_default() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    run = commands.choices["run"]
    flags = {opt: action for action in run._actions for opt in action.option_strings}
    for flag, _, _ in OPTION_FLAGS:
        assert flags[flag].help, f"{flag} has no help"
    for flag, _ in BOOL_FLAGS:
        assert flags[flag].help, f"{flag} has no help"
    # max_tokens is a cap for rows without their own, estimated when unset: the help says both
    assert "cap" in flags["--max-tokens"].help and "estimated" in flags["--max-tokens"].help


@pytest.mark.subprocess
def test_run_help_is_printed_by_the_installed_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "anex_pipeline.cli", "run", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--max-tokens" in out and "default: estimated from a generated sample" in " ".join(out.split())


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["run", "in.jsonl", "-o", "out.jsonl", "--temprature", "0"],
            "anex-pipeline run: error: unrecognized arguments: --temprature 0 (did you mean --temperature?); "
            "`anex-pipeline run --help` lists what it takes",
        ),
        (
            ["run", "in.jsonl", "-o", "out.jsonl", "--shards", "abc"],
            "anex-pipeline run: error: argument --shards: invalid int value: 'abc'; "
            "`anex-pipeline run --help` lists what it takes",
        ),
        (["list", "--all"], "anex-pipeline list: error: unrecognized arguments: --all; "),
        (["frobnicate"], "anex-pipeline: error: argument command: invalid choice: 'frobnicate'"),
    ],
)
def test_a_command_line_mistake_is_one_line_naming_the_command(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err
    assert err.startswith(expected)
