"""One base class for the errors a user sees, and one enumeration of row error types."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
from pathlib import Path

import pytest

import anex_pipeline
from anex_pipeline.cli import main
from anex_pipeline.errors import AnexError, ExitCode, RejectedError, RowErrorType
from anex_pipeline.spec import JobRejected, Problem, RowError


def _modules() -> list[str]:
    return [
        m.name
        for m in pkgutil.walk_packages(anex_pipeline.__path__, "anex_pipeline.")
        if m.name != "anex_pipeline.cli.__main__"
    ]


def test_every_public_exception_of_the_project_derives_from_the_base() -> None:
    found = {}
    for name in _modules():
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == name:
                found[f"{name}.{attr}"] = value
    public = {k: v for k, v in found.items() if not k.rsplit(".", 1)[1].startswith("_")}
    assert len(public) >= 14, sorted(public)
    outside = sorted(k for k, v in public.items() if not issubclass(v, AnexError))
    assert not outside, f"user-facing exceptions outside AnexError: {outside}"


def test_the_base_carries_its_line_and_exit_code() -> None:
    rejected = JobRejected([Problem("no rows", field="input")])
    assert isinstance(rejected, RejectedError) and rejected.exit_code == ExitCode.REJECTED == 2
    assert rejected.render().startswith("job rejected: 1 problem(s) found")
    plain = AnexError("the thing broke; do this instead")
    assert (plain.exit_code, str(plain), plain.render()) == (
        1,
        "the thing broke; do this instead",
        "error: the thing broke; do this instead",
    )


def test_the_command_prints_one_line_and_the_errors_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["report", str(tmp_path / "missing.report.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == ExitCode.REJECTED
    assert len(err) == 1 and err[0].startswith("error: cannot read report"), err


def test_row_error_types_write_the_same_strings_as_before() -> None:
    assert {t.value for t in RowErrorType} >= {
        "invalid_request_error",
        "engine_error",
        "media_fetch_error",
        "batch_error",
    }
    error = RowError(message="m", type=RowErrorType.ENGINE)
    assert json.dumps(error.as_dict()) == '{"message": "m", "type": "engine_error", "code": null, "param": null}'
    assert RowErrorType.MEDIA_FETCH == "media_fetch_error" and f"{RowErrorType.LENGTH}" == "length"
