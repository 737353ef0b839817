"""The bounds on the regexes and grammars rows ask for: a constraint that takes longer than
ANEX_CONSTRAINT_COMPILE_S to compile against the model's vocabulary refuses its job at submit with
its line and field, and the others are still checked; a job may ask for at most
ANEX_CONSTRAINT_MAX_DISTINCT distinct ones and spend ANEX_CONSTRAINT_COMPILE_TOTAL_S compiling them
in all; the compiling child never outlives the process that asked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from anex_pipeline.cli import main
from anex_pipeline.engine.constraint_check import (
    OUT_OF_TIME,
    SLOW,
    compile_problems,
    job_constraints,
    slow_constraints,
)
from anex_pipeline.engine.models import prepare_default_chat_model
from anex_pipeline.engine.orphans import cmdline_has, process_table, running, start_time
from anex_pipeline.errors import AnexError
from anex_pipeline.runner import JobRunner
from anex_pipeline.validate.answers import Constraints
from anex_pipeline_tests.harness.batch_api import client, serving, submit, wait
from anex_pipeline_tests.harness.cli_jobs import refusing_cli  # noqa: F401 (a fixture)

# About 2 s on the bundled model (49,152 tokens) on the build machine; far above the bounds below.
SLOW_REGEX = "(.{1,500}){1,500}"
SLOW_LARK = "start: /(.{1,500}){1,500}/"
BOUND_S = 0.3
CHILD = b"anex_pipeline.engine.constraint_check"


def test_each_constraint_is_kept_once_with_the_lines_that_ask_for_it() -> None:
    seen = Constraints()
    seen.add({"structured_outputs": {"regex": "[a-z]+"}}, 3)
    seen.add({"structured_outputs": {"grammar": 'root ::= "a"'}}, 4)
    seen.add({"structured_outputs": {"regex": "[a-z]+"}}, 9)
    seen.add({"structured_outputs": {"choice": ["a", "b"]}}, 10)  # bounded by size alone
    seen.add({"response_format": {"type": "json_object"}}, 11)
    assert seen.lines == {("regex", "[a-z]+"): [3, 9], ("grammar", 'root ::= "a"'): [4]}
    assert not Constraints()


def _regex(text: str) -> dict[str, object]:
    return {"structured_outputs": {"regex": text}}


def test_past_the_most_distinct_constraints_only_the_lines_asking_for_others_are_kept_and_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ANEX_CONSTRAINT_MAX_DISTINCT", "2")
    seen = job_constraints()
    seen.add(_regex("a"), 1)
    seen.add({"structured_outputs": {"grammar": 'root ::= "b"'}}, 2)
    seen.add(_regex("c"), 3)  # the third distinct one: past the two
    seen.add(_regex("a"), 4)  # one of the two again: fine
    seen.add({"structured_outputs": {"grammar": 'root ::= "d"'}}, 5)
    seen.add(_regex("c"), 6)  # still not one of the two
    assert seen.lines == {("regex", "a"): [1, 4], ("grammar", 'root ::= "b"'): [2]}
    assert list(seen.past_most()) == [(3, "regex"), (5, "grammar"), (6, "regex")]
    # Refused before anything is compiled: no model (nor child process) is needed to say so.
    problems = list(compile_problems(seen, "/no/such/model"))
    assert [(p.line, p.field) for p in problems] == [
        (3, "body.structured_outputs.regex"),
        (5, "body.structured_outputs.grammar"),
        (6, "body.structured_outputs.regex"),
    ]
    assert "past the 2 distinct regexes and grammars one job may ask for" in problems[0].message
    assert "split the rows into several jobs" in problems[0].message


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("ANEX_CONSTRAINT_MAX_DISTINCT", "many"),
        ("ANEX_CONSTRAINT_MAX_DISTINCT", "2.5"),
        ("ANEX_CONSTRAINT_COMPILE_TOTAL_S", "-1"),
        ("ANEX_CONSTRAINT_COMPILE_TOTAL_S", "inf"),
        ("ANEX_CONSTRAINT_COMPILE_S", "nan"),
    ],
)
def test_a_bound_that_is_not_a_number_is_one_line_naming_it(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(AnexError, match=f"^{name}='{value}' is not a") as raised:
        seen = job_constraints()
        seen.add(_regex("[a-z]+"), 1)
        list(compile_problems(seen, "/no/such/model"))
    assert "\n" not in str(raised.value)


@pytest.mark.subprocess
def test_a_slow_regex_or_grammar_is_named_and_the_ones_after_it_are_still_checked() -> None:
    asked = [
        ("regex", "[a-z]+"),
        ("regex", SLOW_REGEX),
        ("grammar", 'root ::= "yes" | "no"'),
        ("grammar", SLOW_LARK),  # no `::=`: compiled as Lark, as vLLM takes it
        ("regex", "(unclosed"),  # does not compile: the engine fails that row, not this check
        ("regex", "[0-9]{3}"),
    ]
    started = time.monotonic()
    assert list(slow_constraints(str(prepare_default_chat_model()), asked, BOUND_S)) == [(1, SLOW), (3, SLOW)]
    # two children killed at the bound and a third for the rest, never a slow compile waited out
    assert time.monotonic() - started < 60


@pytest.mark.subprocess
def test_the_compiles_of_a_job_stop_at_their_total_bound() -> None:
    """The total counts every compile of the job and the loads of the children started after a
    kill: what is not compiled by then is refused as out of time, not as slow."""
    model = str(prepare_default_chat_model())
    # The cheap pattern compiles in milliseconds; the slow one, given a minute of its own, is cut
    # by the job's half second.
    asked = [("regex", "[a-z]+"), ("regex", SLOW_REGEX), ("regex", "[0-9]+")]
    assert list(slow_constraints(model, asked, 60.0, total=0.5)) == [(1, OUT_OF_TIME), (2, OUT_OF_TIME)]
    # The first slow pattern is killed at its bound; loading the next child takes seconds, more
    # than the total has left, so the rest are not compiled.
    asked = [("regex", SLOW_REGEX), ("grammar", SLOW_LARK), ("regex", "[0-9]+")]
    found = list(slow_constraints(model, asked, BOUND_S, total=1.0))
    assert found == [(0, SLOW), (1, OUT_OF_TIME), (2, OUT_OF_TIME)]


@pytest.mark.subprocess
def test_a_model_whose_tokenizer_is_not_here_is_not_checked(tmp_path: Path) -> None:
    assert list(slow_constraints(str(tmp_path / "no-such-model"), [("regex", SLOW_REGEX)], BOUND_S, 1.0)) == []


def _rows(tmp_path: Path) -> Path:
    hi = [{"role": "user", "content": "hi"}]
    rows = [
        {"custom_id": "plain", "body": {"messages": hi}},
        {"custom_id": "slow", "body": {"messages": hi, "structured_outputs": {"regex": SLOW_REGEX}}},
        {"custom_id": "fine", "body": {"messages": hi, "structured_outputs": {"regex": "[0-9]+"}}},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src


@pytest.mark.subprocess
@pytest.mark.parametrize("command", ["run", "validate"])
def test_the_command_refuses_a_slow_pattern_with_its_line_and_field(
    command: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    refusing_cli: None,  # noqa: F811
) -> None:
    monkeypatch.setenv("ANEX_CONSTRAINT_COMPILE_S", str(BOUND_S))
    out = tmp_path / "out.jsonl"
    code = main([command, str(_rows(tmp_path)), *(["-o", str(out)] if command == "run" else [])])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert "line 2, field 'body.structured_outputs.regex': took longer than 0.3 s to compile" in err, err
    assert "line 3" not in err and "line 1" not in err
    assert not out.exists()
    assert not any((tmp_path / "work").glob("*/manifest.json"))


@pytest.mark.parametrize("command", ["run", "validate"])
def test_the_command_refuses_more_distinct_patterns_than_a_job_may_ask_for(
    command: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    refusing_cli: None,  # noqa: F811
) -> None:
    monkeypatch.setenv("ANEX_CONSTRAINT_MAX_DISTINCT", "2")
    hi = [{"role": "user", "content": "hi"}]
    patterns = ["[a-z]+", "[0-9]+", "[a-z]+", "x{2}", "y{3}", "[0-9]+"]  # lines 4 and 5 ask for a third and fourth
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps({"custom_id": f"r{n}", "body": {"messages": hi, "structured_outputs": {"regex": p}}}) + "\n"
            for n, p in enumerate(patterns)
        )
    )
    out = tmp_path / "out.jsonl"
    code = main([command, str(src), *(["-o", str(out)] if command == "run" else [])])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    named = [line.strip() for line in err.splitlines() if line.strip().startswith("line ")]
    past = "past the 2 distinct regexes and grammars one job may ask for"
    assert len(named) == 2 and all(past in line for line in named), err
    assert named[0].startswith("line 4, field 'body.structured_outputs.regex': asks for a regex past")
    assert named[1].startswith("line 5, field 'body.structured_outputs.regex'")
    assert not out.exists()
    assert not any((tmp_path / "work").glob("*/manifest.json"))


_PARENT = """
import sys
from anex_pipeline.engine.constraint_check import slow_constraints
print(list(slow_constraints(sys.argv[1], [("regex", sys.argv[2])] * 50, 600.0)))
"""


def _loaded(pid: int, library: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return library in f.read()
    except OSError:
        return False


@pytest.mark.subprocess
def test_the_compiling_child_ends_with_the_process_that_started_it() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(prepare_default_chat_model()), SLOW_REGEX])
    try:
        deadline = time.monotonic() + 120
        child = None
        while child is None and time.monotonic() < deadline:  # till the child has xgrammar: it then compiles
            child = next(
                (p for p, (ppid, _) in process_table().items() if ppid == parent.pid and _loaded(p, b"xgrammar")), None
            )
            time.sleep(0.05)
        assert child is not None and cmdline_has(child, CHILD), "the check started no compiling child"
        started = start_time(child)
        assert started is not None and parent.poll() is None  # 50 slow patterns: about 100 s of compiling
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while running(child, started) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(child, started), "the compiling child outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


@pytest.mark.subprocess
def test_a_batch_with_a_slow_pattern_fails_validation_naming_its_line(
    tmp_path: Path, fake_runner: JobRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANEX_CONSTRAINT_COMPILE_S", str(BOUND_S))
    with serving(fake_runner) as url:
        sdk = client(url)
        batch = wait(sdk, submit(sdk, _rows(tmp_path)).id)
    assert batch.status == "failed" and batch.errors is not None and batch.errors.data is not None
    assert [(e.line, e.param) for e in batch.errors.data] == [(2, "body.structured_outputs.regex")]
    assert not list((tmp_path / "work").glob("*/manifest.json"))
