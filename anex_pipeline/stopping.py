"""Asking a running job to stop, and noticing it quickly and cheaply while its rows generate.

One mechanism serves every way a job is stopped: a Batch API cancel, Ctrl-C or SIGTERM to the
command, Dagster terminating a run from its UI, and the job's time limit. A stop is written to the
job's stop file (its reason ends up in the report); :func:`request_stop` also marks the job in
this process's memory, so generation in the same process sees it on its next engine step without
touching the disk. :class:`StopCheck` is what generation calls once per engine step: a dictionary
look-up, plus a look at the stop file and the time limit at most every :data:`DISK_CHECK_S`
seconds for stops written by another process.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TypeVar

from anex_pipeline.errors import EngineProcessDied, JobStopped
from anex_pipeline.workdir.manifest import JobDir

T = TypeVar("T")

DISK_CHECK_S = 0.2  # how stale a stop written by another process may be when it is noticed
ENGINE_DEATH_GRACE_S = 3.0  # how long after the engine died a stop still explains its death
USER_STOP = "cancelled by the user"
FIRST_SIGNAL_LINE = (
    b"[anex] stopping: aborting the rows in flight and keeping the finished ones "
    b"(press Ctrl-C again to quit at once; the checkpoints are safe and a rerun resumes)\n"
)


_asked: dict[str, str] = {}  # job folder -> reason, for the stops asked in this process
_signals = {"seen": 0, "depth": 0, "loading": 0}  # signals received, nested handlers, engine loads waited on


def request_stop(job: JobDir, reason: str) -> None:
    """Asks the job to stop: its stop file for every process, and this process's memory."""
    job.record_stop(reason)
    _asked[str(job.root)] = reason


def clear_stop(job: JobDir) -> None:
    """Forgets an earlier stop of the job, so that running it again resumes it."""
    _asked.pop(str(job.root), None)
    job.stop_path.unlink(missing_ok=True)


def stop_asked_here() -> bool:
    """Whether a job of this process was asked to stop (and has not been run again since): in the
    command, that a Ctrl-C already stopped its job, so another one quits at once."""
    return bool(_asked)


class StopCheck:
    """Raises :class:`JobStopped` when called once the job was asked to stop or ran out of time."""

    def __init__(self, job: JobDir):
        self.job = job
        self._key = str(job.root)
        self._next_look = 0.0
        self.reason: str | None = None

    def asked(self) -> str | None:
        """Why the job must stop, or None."""
        if self.reason is None:
            self.reason = _asked.get(self._key)
        if self.reason is None and (now := time.monotonic()) >= self._next_look:
            self._next_look = now + DISK_CHECK_S
            self.reason = self.job.stop_reason()
            late = self.job.out_of_time() if self.reason is None else None
            if late is not None:
                self.job.record_stop(late)
                self.reason = late
        return self.reason

    def __call__(self) -> None:
        if (reason := self.asked()) is not None:
            raise JobStopped(reason)

    def wait(self, seconds: float) -> str | None:
        """The stop asked within the next ``seconds`` (at once when there is one already), or None."""
        deadline = time.monotonic() + seconds
        while (reason := self.asked()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
            self._next_look = 0.0
        return reason


def _tell(line: bytes) -> None:
    """Writes a line to the terminal with one system call, safe inside a signal handler. The
    terminal is ``sys.stderr``'s descriptor: the command may have pointed descriptor 2 at its log."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stand-in stream without a descriptor
        fd = 2
    os.write(fd, line)


@contextmanager
def stopping_on_signals(job: JobDir) -> Iterator[StopCheck]:
    """While the body runs, SIGINT and SIGTERM ask the job to stop instead of interrupting it,
    and an engine death that comes with a stop is that stop, not a fault of the engine.

    The handlers are installed only on the main thread (the only one that receives signals); the
    previous ones come back afterwards. The first signal prints one line and asks the job to stop:
    generation aborts the rows in flight at its next engine step and checkpoints the finished
    ones. A second signal ends the process at once. A terminal's Ctrl-C reaches vLLM's engine
    process too (it shares the process group) and ends it: the engine's death is then reported as
    the stop, within :data:`ENGINE_DEATH_GRACE_S` of it, so that no retry loads a new engine.
    """
    check = StopCheck(job)
    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():

        def handler(signum: int, _: FrameType | None) -> None:
            _signals["seen"] += 1
            if _signals["seen"] > 1:
                _tell(b"[anex] stopped at once; rerun the same command to resume\n")
                os._exit(130 if signum == signal.SIGINT else 143)
            _tell(FIRST_SIGNAL_LINE)
            reason = f"{USER_STOP} ({signal.Signals(signum).name})"
            request_stop(job, reason)
            if _signals["loading"]:  # an engine load cannot notice the stop; leave it
                raise JobStopped(reason)

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
    _signals["depth"] += 1
    try:
        yield check
    except EngineProcessDied:
        if (reason := check.wait(ENGINE_DEATH_GRACE_S)) is None:
            raise
        raise JobStopped(reason) from None
    finally:
        _signals["depth"] -= 1
        if not _signals["depth"]:
            _signals["seen"] = 0
        for sig, old in previous.items():
            signal.signal(sig, old)  # type: ignore[arg-type]


def load_interruptibly(load: Callable[[], T]) -> T:
    """Waits for an engine load that a stop signal may cut short (by :class:`JobStopped`): a load
    notices no stop by itself and takes up to minutes."""
    _signals["loading"] += 1
    try:
        return load()
    finally:
        _signals["loading"] -= 1


def engine_loading() -> bool:
    """Whether a step of this process is waiting for an engine load right now."""
    return _signals["loading"] > 0


def on_stop_signals(action: Callable[[], None]) -> None:
    """Runs ``action`` first whenever SIGINT or SIGTERM arrives, then the handler already in place
    (e.g. a web server's, which winds down and only then closes what runs the jobs). Only on the
    main thread; elsewhere it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: FrameType | None, previous: object = previous) -> None:
            action()
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:  # the default action: end the process
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)

        signal.signal(sig, handler)
