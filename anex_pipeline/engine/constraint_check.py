"""Bounds on compiling the regexes and grammars rows ask for, checked at submit.

A row's ``structured_outputs`` regex or grammar is compiled by vLLM's grammar backend (xgrammar)
against the model's vocabulary before the row generates. Within the 16 KiB size bound a pattern
can still take seconds (``(.{1,500}){1,500}`` takes about 2 s on the bundled model's 49,152
tokens), and a grammar has no time bound in vLLM at all: a row stuck compiling holds its shard
open. :func:`slow_constraints` compiles each distinct constraint of a job once, in a child process
of its own with the model's tokenizer, and names those that take longer than
``ANEX_CONSTRAINT_COMPILE_S`` seconds; the child is killed at that moment and a new one goes on
with the rest. A constraint that does not compile at all is not this check's business: the engine
fails that row alone with a 400 naming the field.

One job's check is bounded as a whole too, since each compile's bound alone would let a job of
thousands of slow patterns hold the submit step (and, in the Batch API, a checking slot) for
hours: a job may ask for at most ``ANEX_CONSTRAINT_MAX_DISTINCT`` distinct regexes and grammars
(the lines asking for more are refused and nothing is compiled), and the compiles may take
``ANEX_CONSTRAINT_COMPILE_TOTAL_S`` seconds in all, from the moment the first child is ready, the
loads of the children started after a kill included; the constraints not compiled by then are
refused.

The check is skipped when the model's tokenizer is not on this machine (a job sent to a model
server elsewhere, which bounds its own compiles), and costs nothing for a job with no regex or
grammar. The child is this module run as a script: ``python -m anex_pipeline.engine.constraint_check
PARENT_PID MODEL`` reads the constraints as JSON lines on its standard input, and writes one line
per constraint as it finishes it.
"""

from __future__ import annotations

import json
import math
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

from anex_pipeline.engine.models import local_model_path
from anex_pipeline.errors import RejectedError
from anex_pipeline.settings import Setting
from anex_pipeline.spec import Problem
from anex_pipeline.validate.answers import Constraints

COMPILE_SECONDS = Setting(
    "ANEX_CONSTRAINT_COMPILE_S", "10", "Seconds a row's structured_outputs regex or grammar may take to compile."
)
TOTAL_SECONDS = Setting(
    "ANEX_CONSTRAINT_COMPILE_TOTAL_S",
    "60",
    "Seconds the submit step may spend compiling one job's structured_outputs regexes and grammars in all.",
)
MOST_DISTINCT = Setting(
    "ANEX_CONSTRAINT_MAX_DISTINCT", "256", "Distinct structured_outputs regexes and grammars one job may ask for."
)
SETUP_SECONDS = 120.0  # the child's imports and the tokenizer's load, on a machine under load

READY, SKIP = "ready", "skip"  # the child's first line: it can compile, or it cannot (and why)
SLOW, OUT_OF_TIME = "slow", "out of time"  # why a constraint is refused: its own compile, or the job's


def job_constraints() -> Constraints:
    """An empty collection of a job's constraints, keeping at most ``ANEX_CONSTRAINT_MAX_DISTINCT``."""
    return Constraints(most=int(_number(MOST_DISTINCT, "a whole number of regexes and grammars", int)))


def compile_problems(constraints: Constraints, model: str) -> Iterator[Problem]:
    """A problem for each line whose regex or grammar is past the job's most distinct ones (and
    then nothing is compiled: the job is refused anyway), took longer than the bound to compile for
    ``model`` (a reference from :func:`~anex_pipeline.engine.models.resolve_model`), or was not
    compiled because the job's compiles took the total bound."""
    if not constraints:
        return
    refused = False
    for line, kind in constraints.past_most():
        refused = True
        yield Problem(
            f"asks for a {kind} past the {constraints.most:,} distinct regexes and grammars one job may ask for "
            "(each is compiled against the model's vocabulary before its rows run); reuse the same ones across "
            "rows or split the rows into several jobs",
            line=line,
            field=f"body.structured_outputs.{kind}",
        )
    if refused:
        return
    asked = list(constraints.lines)
    bound = _number(COMPILE_SECONDS, "a number of seconds")
    total = _number(TOTAL_SECONDS, "a number of seconds")
    for index, why in slow_constraints(local_model_path(model), asked, bound, total):
        kind = asked[index][0]
        if why == SLOW:
            message = (
                f"took longer than {bound:g} s to compile against the model's vocabulary, which vLLM does before "
                f"the row generates; simplify the {kind} (fewer or smaller nested repetitions)"
            )
        else:
            message = (
                f"was not compiled: the job's regexes and grammars had taken the {total:g} s one job may spend "
                "compiling them against the model's vocabulary; use fewer distinct or simpler ones, or split the "
                "rows into several jobs"
            )
        for line in constraints.lines[asked[index]]:
            yield Problem(message, line=line, field=f"body.structured_outputs.{kind}")


def _number(setting: Setting, what: str, kind: type[int] | type[float] = float) -> float:
    """A setting's value as a finite number that is not negative; RejectedError (one line) otherwise."""
    try:
        value = kind(setting.get())
    except ValueError:
        value = -1
    if not 0 <= value < math.inf:
        raise RejectedError(f"{setting.name}={setting.get()!r} is not {what}; unset it or give one ({setting.default})")
    return value


def slow_constraints(
    model: str, constraints: Sequence[tuple[str, str]], bound: float, total: float = math.inf
) -> Iterator[tuple[int, str]]:
    """Why each constraint of ``constraints`` (``(kind, text)`` pairs, each kind one of
    :data:`~anex_pipeline.validate.answers.COMPILE_CHECKED`) that is refused is, in order, for the
    model in folder (or cached hub id) ``model``: ``(position, SLOW)`` when its compile took longer
    than ``bound`` seconds (the child compiling it is killed then, and a new one goes on after it),
    and once the check has taken ``total`` seconds, ``(position, OUT_OF_TIME)`` for the one then
    compiling and every one after it. The total runs from the first child's readiness (before it,
    the tokenizer's load, the same for every job, is bounded by :data:`SETUP_SECONDS`) and counts
    the later children's loads too."""
    start = 0
    stop_at: float | None = None  # the check's end, once the first child is ready
    while start < len(constraints):
        with _Child(model, constraints[start:]) as child:
            left = SETUP_SECONDS if stop_at is None else min(SETUP_SECONDS, stop_at - time.monotonic())
            if child.first_line(left) != READY:
                if stop_at is not None and time.monotonic() >= stop_at:
                    yield from ((i, OUT_OF_TIME) for i in range(start, len(constraints)))
                return  # a child that cannot load the tokenizer is no check
            if stop_at is None:
                stop_at = time.monotonic() + total
            done = start
            while done < len(constraints):
                left = stop_at - time.monotonic()
                if child.finished(min(bound, left)) is None:
                    break
                done += 1
        if done == len(constraints):
            return
        if left < bound:  # cut by the job's total, not by its own bound
            yield from ((i, OUT_OF_TIME) for i in range(done, len(constraints)))
            return
        yield done, SLOW
        start = done + 1


class _Child:
    """One compiling child: started with its constraints, read a line at a time with a deadline."""

    def __init__(self, model: str, constraints: Sequence[tuple[str, str]]):
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "TOKENIZERS_PARALLELISM": "false",
        }
        with tempfile.TemporaryFile() as given:  # a file, not a pipe: no write can wait on the child
            given.write(b"".join(json.dumps(c).encode() + b"\n" for c in constraints))
            given.seek(0)
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(os.getpid()), model],
                stdin=given,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
            )
        assert self.process.stdout is not None
        self.out = self.process.stdout
        self.pending = b""

    def __enter__(self) -> _Child:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.out.close()

    def _line(self, seconds: float) -> str | None:
        """The child's next line, or None when none came within ``seconds`` (or it ended). Read
        unbuffered, so that a line already read is never waited for."""
        deadline = time.monotonic() + seconds
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.out], [], [], left)[0]:
                return None
            data = os.read(self.out.fileno(), 4096)
            if not data:
                return None
            self.pending += data
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode().strip()

    def first_line(self, seconds: float) -> str | None:
        """What the child says once it has loaded the tokenizer (:data:`READY`, or why it could
        not); None when it said nothing within ``seconds``."""
        return self._line(seconds)

    def finished(self, bound: float) -> float | None:
        """Seconds the next constraint took, or None when it was still compiling at ``bound``."""
        line = self._line(bound)
        return float(line) if line else None


def _compile_each(model: str, lines: Iterator[str]) -> None:
    """The child: compiles each constraint as vLLM's xgrammar backend would, printing the seconds
    it took (an error is printed the same way: the engine names it when the row runs)."""
    try:
        import xgrammar as xgr
        from transformers import AutoConfig, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        try:
            vocab_size = AutoConfig.from_pretrained(model).vocab_size
        except (OSError, ValueError, AttributeError):
            vocab_size = None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)
    except Exception as exc:  # the model is not here (a server's): the check is skipped
        print(f"{SKIP} {type(exc).__name__}", flush=True)
        return
    print(READY, flush=True)
    for line in lines:
        kind, text = json.loads(line)
        started = time.monotonic()
        try:
            if kind == "regex":
                compiler.compile_regex(text)
            else:  # vLLM takes a grammar without an EBNF rule (`::=`) as Lark
                try:
                    compiler.compile_grammar(text)
                except Exception:
                    compiler.compile_lark(text)
        except Exception:
            pass
        print(f"{time.monotonic() - started:.3f}", flush=True)


def _main(argv: list[str]) -> None:
    from anex_pipeline.engine.orphans import dies_with

    dies_with(int(argv[0]))()  # a pattern may compile for minutes: never beyond the submit that asked
    _compile_each(argv[1], iter(sys.stdin))


if __name__ == "__main__":
    _main(sys.argv[1:])
