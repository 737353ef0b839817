"""A guard that kills this process's descendants when this process ends, however it ends.

vLLM runs a model in processes of its own (``VLLM::EngineCore`` and the ``VLLM::Worker`` under it,
gigabytes together) and nothing in them watches the process that started them: after a SIGKILL of
that process they live on, and a rerun loads a second engine beside them. Killing the process
group instead is no answer, since a command started without a group of its own shares its
caller's.

:func:`guard_descendants` starts a small guard process that holds the read end of a pipe whose
only write end stays in this process; the kernel closes that end when this process ends, by exit,
crash or signal. Until then the guard notes this process's descendants every ``SCAN_INTERVAL_S``
(pid and start time from /proc, so that a pid the system later gives to an unrelated process is
never taken for one of them). When the pipe closes it looks once more, SIGKILLs every noted
process that is still the same process, and exits. A process that started in the last instant
and whose parent died with this process may be missed by those looks (it has been handed to
init); a process that leads a session of its own, as the shared server's supervisor does, asks
the guard to also kill what is left in its group, where such a process still is. A
multiprocessing resource tracker is spared: it ends by itself once the processes it serves are
gone, after removing the shared memory they left behind. So is the machine's shared model
server (``anex_pipeline.engine.server.machine_server``) with everything under it: it is meant to
outlive the process that started it.

The guard is this file run as a script in an isolated interpreter (standard library only), so it
starts in a few tens of milliseconds and stays small.

:func:`signal_if_same` is the one way the project signals a process it did not just start: by
pid and start time, through a pidfd. :func:`signal_child_group` is its form for the process group
of a child still held as a ``Popen``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

SCAN_INTERVAL_S = 0.2
RESOURCE_TRACKER = b"multiprocessing.resource_tracker"
DETACHED = b"anex_pipeline.engine.server.machine_server"  # the shared model server's supervisor
PPID, PGRP, START = 1, 2, 19  # fields of /proc/<pid>/stat, counted after the command name
PIDFD_SIGNAL_PROCESS_GROUP = 4  # pidfd_send_signal flag (Linux 6.9): the group the process leads
PID_MAX = 1 << 22  # the kernel's largest pid_max
PR_SET_PDEATHSIG = 1  # prctl option: the signal the calling process gets when its parent ends

_lock = threading.Lock()
_guard: subprocess.Popen[bytes] | None = None  # held so that Python does not warn of it running on
_guarded_pid: int | None = None  # the process _guard watches
_pipe_end: int | None = None  # the write end; it closes when the process ends


def guard_descendants(*, own_group: bool = False) -> None:
    """Makes sure a guard kills this process's descendants when it ends (one guard per process;
    a forked child that calls this gets its own). ``own_group``: this process leads a process
    group that holds nothing but its own tree (it was started in a session of its own), so the
    guard also kills what is left in that group: a descendant whose parent died with this process
    is found there even if no scan had noted it yet."""
    global _guard, _guarded_pid, _pipe_end
    with _lock:
        if _guarded_pid == os.getpid():
            return
        read_end, write_end = os.pipe()  # neither end is inherited by the processes we start
        try:
            _guard = subprocess.Popen(
                [sys.executable, "-I", "-S", __file__, str(os.getpid()), *(["--own-group"] if own_group else [])],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,  # nor does it hold the caller's output pipes open
                start_new_session=True,  # a Ctrl-C or a kill of our group must not stop the guard
            )
        finally:
            os.close(read_end)
        _guarded_pid, _pipe_end = os.getpid(), write_end


def _after_fork_in_child() -> None:
    # A forked child must not keep its parent's pipe open: the parent's guard would wait on it.
    global _guard, _guarded_pid, _pipe_end
    if _pipe_end is not None:
        os.close(_pipe_end)
    _guard, _guarded_pid, _pipe_end = None, None, None


os.register_at_fork(after_in_child=_after_fork_in_child)


def process_table() -> dict[int, tuple[int, int]]:
    """Every process on the machine: pid -> (parent pid, start time in clock ticks since boot)."""
    return {pid: (int(fields[PPID]), int(fields[START])) for pid, fields in _all_stats()}


def group_members(group: int) -> dict[int, int]:
    """The processes of a process group: pid -> start time."""
    return {pid: int(fields[START]) for pid, fields in _all_stats() if int(fields[PGRP]) == group}


def _all_stats() -> Iterator[tuple[int, list[bytes]]]:
    for name in os.listdir("/proc"):
        if name.isdigit() and (fields := _stat(int(name))) is not None:
            yield int(name), fields


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot); None when there is no such process."""
    fields = _stat(pid)
    return None if fields is None else int(fields[START])


def running(pid: int, start: int) -> bool:
    """Whether ``pid`` is still the process that started at ``start`` and has not exited (a
    process that exited stays in /proc, as a zombie, until its parent reaps it)."""
    fields = _stat(pid)
    return fields is not None and int(fields[START]) == start and fields[0] != b"Z"


def _stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat that follow the command name (which, in brackets, may hold
    anything); None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()


def descendants(root: int, known: dict[int, int] | None = None) -> dict[int, int]:
    """``known`` (pid -> start time) brought up to date: what ended or is now another process is
    dropped, and every descendant of ``root`` or of a known process still alive is added."""
    table = process_table()
    known = {pid: start for pid, start in (known or {}).items() if table.get(pid, (0, -1))[1] == start}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    me = os.getpid()
    stack = [root, *known]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child != me and child not in known and not cmdline_has(child, DETACHED):
                known[child] = table[child][1]
                stack.append(child)
    return known


def signal_if_same(pid: int, start: int, sig: int, *, group: bool = False) -> bool:
    """Sends ``sig`` to ``pid`` only if it is still the process that started at ``start`` (with
    ``group``, to the process group it leads); returns whether it did.

    The one way the project signals a process it did not just start and still hold. A pid below
    2 is refused: signalling pid 0 or its group hits the caller's own group, and group 1 is
    ``kill(-1)``, every process the caller may signal. The process is pinned by a pidfd before
    its start time is read, so its pid cannot pass to another process between the check and the
    signal, and a group is signalled through that pidfd: the group of that very process, never
    one that took its number later."""
    if not 1 < pid <= PID_MAX:
        return False
    try:
        handle = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        fields = _stat(pid)
        if fields is None or int(fields[START]) != start or (group and int(fields[PGRP]) != pid):
            return False
        try:
            signal.pidfd_send_signal(handle, sig, None, PIDFD_SIGNAL_PROCESS_GROUP if group else 0)
        except OSError as exc:
            if not group or exc.errno != errno.EINVAL:
                raise
            os.killpg(pid, sig)  # a kernel before 6.9: the pinned leader still holds the group's number
        return True
    except OSError:
        return False
    finally:
        os.close(handle)


def signal_child_group(child: subprocess.Popen[Any], sig: int) -> bool:
    """Sends ``sig`` to the process group that a child of this process leads (one started with
    ``start_new_session``) through :func:`signal_if_same`, as long as the child has not been
    reaped: until then its pid, and so the group's number, cannot be another's. Returns whether
    it did."""
    start = None if child.returncode is not None else start_time(child.pid)
    return start is not None and signal_if_same(child.pid, start, sig, group=True)


def dies_with(parent: int) -> Callable[[], None]:
    """What a child of ``parent`` runs before its program (a ``preexec_fn``, or its own first
    call): the kernel then SIGKILLs it when ``parent`` ends, even by SIGKILL. The signal reaches
    that one process only (a child of it does not inherit it), and it comes when the thread that
    started the child ends, so start such a child from a thread that outlives it."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before a fork

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent ended before the call
            os._exit(1)

    return arm


def cmdline_has(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return marker in f.read()
    except OSError:
        return False


def _detached(pid: int) -> bool:
    """Whether ``pid`` is the shared model server's supervisor or runs under it (noted, perhaps,
    in the instant between its start and its program's)."""
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        if cmdline_has(pid, DETACHED):
            return True
        fields = _stat(pid)
        if fields is None:
            return False
        pid = int(fields[PPID])
    return False


def _parent_gone(timeout: float) -> bool:
    """Waits up to ``timeout`` for the pipe on stdin to close (nothing is ever written to it)."""
    ready, _, _ = select.select([0], [], [], timeout)
    return bool(ready) and os.read(0, 1) == b""


def watch(parent: int, own_group: bool = False) -> None:
    """The guard's work: note ``parent``'s descendants until the pipe closes, then kill them
    (with ``own_group``, also what is left in the group ``parent`` leads)."""
    known = descendants(parent)  # at once: the parent may end before the first interval is over
    while not _parent_gone(SCAN_INTERVAL_S):
        known = descendants(parent, known)
    known = descendants(parent, known)  # with what started since the last look
    if own_group:
        known.update((pid, start) for pid, start in group_members(parent).items() if pid != parent)
    kill_all(known)


def kill_all(known: dict[int, int]) -> None:
    """SIGKILLs the processes of ``known`` (pid -> start time) still alive, but for resource
    trackers, which end by themselves once the rest are gone, removing their shared memory, and
    the shared model server."""
    for pid, start in known.items():
        if not cmdline_has(pid, RESOURCE_TRACKER) and not _detached(pid):
            signal_if_same(pid, start, signal.SIGKILL)


if __name__ == "__main__":
    watch(int(sys.argv[1]), own_group="--own-group" in sys.argv[2:])
