"""Job options from every source go through one reader and one set of messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from anex_pipeline.cli import main
from anex_pipeline.errors import ExitCode
from anex_pipeline.options import (
    MAX_OPTIONS_BYTES,
    OptionsError,
    job_options,
    options_from_json,
    read_options_file,
    sidecar_of,
)
from anex_pipeline.spec import JobRejected
from anex_pipeline_tests.harness.jobs import chat_row, write_jsonl


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("max_tokens: 5", "sidecar x.job.json is not valid JSON: Expecting value (line 1, column 1)"),
        ("[1, 2]", "sidecar x.job.json holds a list; job options must be one JSON object"),
        (b'{"system_prompt": "caf\xe9"}', "sidecar x.job.json is not UTF-8 text"),
    ],
)
def test_one_message_per_kind_of_unreadable_options(text: str | bytes, says: str) -> None:
    with pytest.raises(OptionsError) as raised:
        options_from_json(text, "sidecar x.job.json")
    assert str(raised.value).startswith(says), raised.value
    assert "\n" not in str(raised.value)


def test_a_file_a_sidecar_and_the_command_line_share_the_reader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("r0", "hello")])
    sidecar_of(src).write_text('{"max_tokens": 7', encoding="utf-8")
    with pytest.raises(OptionsError) as raised:
        read_options_file(sidecar_of(src))
    assert main(["validate", str(src)]) == ExitCode.REJECTED
    line = capsys.readouterr().err.strip()
    assert line == f"error: {raised.value}", line
    assert f"options file {sidecar_of(src)} is not valid JSON" in line and "one JSON object" in line


def test_bad_option_values_are_refused_by_name() -> None:
    assert job_options({"max_tokens": 5}).max_tokens == 5
    with pytest.raises(JobRejected) as raised:
        job_options({"max_token": 5})
    assert "did you mean 'max_tokens'?" in raised.value.render()


def test_an_options_file_nested_5000_deep_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("r0", "hello")])
    deep = tmp_path / "deep.json"
    deep.write_bytes(b'{"response_format": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    for args in (["--options", str(deep)], []):
        if not args:
            sidecar_of(src).write_bytes(deep.read_bytes())  # the same file as the input's sidecar
        assert main(["validate", str(src), *args]) == ExitCode.REJECTED
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "nested more than 100 levels deep" in err, err


def test_options_over_the_size_cap_are_refused_without_being_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row("r0", "hello")])
    huge = tmp_path / "huge.json"
    with huge.open("wb") as f:
        f.truncate(1 << 40)  # a sparse terabyte: reading it whole would never finish
    assert main(["validate", str(src), "--options", str(huge)]) == ExitCode.REJECTED
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"options file {huge} holds {1 << 40:,} bytes" in err, err
    assert "at most 4 MiB" in err
    at_cap = tmp_path / "at-cap.json"
    at_cap.write_bytes(b'{"max_tokens": 5}'.ljust(MAX_OPTIONS_BYTES))  # trailing blanks: still JSON
    assert read_options_file(at_cap) == {"max_tokens": 5}
    with pytest.raises(OptionsError, match="holds 4,194,305 bytes"):
        options_from_json(b" " * (MAX_OPTIONS_BYTES + 1), "metadata.anex_options")
