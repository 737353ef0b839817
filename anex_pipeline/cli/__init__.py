"""The ``anex-pipeline`` command: run, validate, backfill, results, report, serve, and list, delete and prune jobs.

Exit codes (:class:`~anex_pipeline.errors.ExitCode`): 0 when the job completed with at least one row
answered (other rows may have failed), 1 when it failed, stopped early or no row succeeded, 2 when
it was rejected at submit (nothing ran, no result file).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
from types import FrameType

from anex_pipeline.cli.admin_commands import cmd_delete, cmd_list, cmd_machine_server, cmd_prune
from anex_pipeline.cli.commands import cmd_backfill, cmd_report, cmd_results, cmd_run, cmd_serve, cmd_validate
from anex_pipeline.cli.parser import build_parser
from anex_pipeline.engine import collector
from anex_pipeline.errors import AnexError, ExitCode


def main(argv: list[str] | None = None, *, own_terminal: bool = False) -> int:
    """Runs one command. With ``own_terminal`` (the installed command) the engine's and libraries'
    messages go to a log file unless ``--verbose``; called from Python, stderr is left alone."""
    args = build_parser().parse_args(argv)
    args.own_terminal = own_terminal
    if own_terminal and args.command in ("run", "backfill"):  # until the job's engine is in hand (see collector)
        collector.hold_for_start_up()
    handlers = {
        "run": cmd_run,
        "validate": cmd_validate,
        "backfill": cmd_backfill,
        "report": cmd_report,
        "results": cmd_results,
        "serve": cmd_serve,
        "list": cmd_list,
        "delete": cmd_delete,
        "prune": cmd_prune,
        "machine-server": cmd_machine_server,
    }
    try:
        return handlers[args.command](args)
    except AnexError as exc:
        print(exc.render(), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C outside generation (which stops the job more gently)
        print("stopped: cancelled by the user; rerun the same command to resume", file=sys.stderr)
        return ExitCode.STOPPED


def entry() -> None:
    """The ``anex-pipeline`` command: :func:`main`, then an exit that skips the interpreter's
    teardown. With torch and vLLM loaded, that teardown takes seconds after everything is
    written (2.7 s measured on the 2-core build machine); the exit handlers still run. Python's
    garbage collector is off in ``run`` and ``backfill`` until the job's engine is in hand
    (:mod:`anex_pipeline.engine.collector`).

    A reader of stdout that goes away early (``anex-pipeline list | head``) ends the command with
    status 1 and no traceback. Ctrl-C outside a job's generation (which stops the job itself, see
    :mod:`anex_pipeline.stopping`) ends the command through :func:`main`'s one line; a second one
    ends it at once (status 130)."""
    signal.signal(signal.SIGINT, _interrupted)
    sys.unraisablehook = _quiet_interrupts
    try:
        code = main(own_terminal=True)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is still buffered goes nowhere
        code = ExitCode.STOPPED
    finally:
        collector.end_start_up()
    atexit._run_exitfuncs()
    with contextlib.suppress(OSError):
        sys.stderr.flush()
    os._exit(code)


_interrupts = {"seen": 0}


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """SIGINT while no job generates: the first raises KeyboardInterrupt; a later one (or one after
    a Ctrl-C during generation already stopped the job), which would land wherever the first is
    being unwound (a clean-up of Dagster's or SQLAlchemy's, the exit handlers) and print a
    traceback there, ends the process at once."""
    _interrupts["seen"] += 1
    stopping = sys.modules.get("anex_pipeline.stopping")  # loaded by every command that runs a job
    if _interrupts["seen"] == 1 and not (stopping is not None and stopping.stop_asked_here()):
        raise KeyboardInterrupt
    with contextlib.suppress(OSError, ValueError):
        os.write(sys.stderr.fileno(), b"stopped at once; rerun the same command to resume\n")
    os._exit(128 + signum)


def _quiet_interrupts(unraisable: sys.UnraisableHookArgs) -> None:
    """Python's report of an exception it cannot raise (one in a garbage collector's callback or
    an exit handler), except for an interrupt that arrived there (a KeyboardInterrupt, or Dagster's
    form of it during a run): the interrupt is lost either way, and the next Ctrl-C ends the command."""
    dagster_errors = sys.modules.get("dagster._core.errors")
    interrupts = (KeyboardInterrupt, *([dagster_errors.DagsterExecutionInterruptedError] if dagster_errors else []))
    if not isinstance(unraisable.exc_value, interrupts):
        sys.__unraisablehook__(unraisable)
