"""Kernel file locks, the one idiom of every lock between processes in the package.

Two kinds, both ``flock`` on a file (a lock dies with its process, however the process ends):

- :func:`locked`, a block of work that one process at a time does (updating a shared file,
  starting the machine's model server, converting the embedded model, creating the Dagster home),
  through ``filelock``, which waits in short sleeps so a stop signal still gets through;
- :func:`try_flock` and :func:`flock` on a file a process keeps open for as long as it holds
  what the lock stands for (a job's lease), with shared locks to look without taking.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from anex_pipeline.errors import AnexError


class LockTimeout(AnexError):
    """Another process held the lock for longer than the caller waits."""


@contextmanager
def locked(path: Path, timeout: float | None = None) -> Iterator[None]:
    """Runs the block while this process holds the lock on ``path`` (created if missing); waits
    for another holder, at most ``timeout`` seconds (then :class:`LockTimeout`; None: for ever)."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(path), timeout=-1 if timeout is None else timeout)
    try:
        lock.acquire()
    except Timeout:
        raise LockTimeout(f"{path} is held by another process") from None
    try:
        yield
    finally:
        lock.release()


def try_flock(file: IO[bytes], shared: bool = False) -> bool:
    """Takes the lock on an open file if no other process holds it (True), without waiting."""
    try:
        fcntl.flock(file, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def flock(file: IO[bytes]) -> None:
    """Takes the exclusive lock on an open file, waiting for its holder; closing the file lets go."""
    fcntl.flock(file, fcntl.LOCK_EX)
