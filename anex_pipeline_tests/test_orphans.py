"""The guard that kills a process's descendants when that process is killed, on real processes:
a spawned child holding shared memory (as vLLM's engine does), a child with a child of its own, a
forked child; the process under guard shares the test's process group, as a command started
from a shell script would."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from anex_pipeline.engine.orphans import (
    RESOURCE_TRACKER,
    descendants,
    kill_all,
    running,
    signal_child_group,
    signal_if_same,
    start_time,
)

GUARDED = """
import json, multiprocessing, os, subprocess, sys, time
from multiprocessing import shared_memory
from anex_pipeline.engine import orphans

def hold(name):
    memory = shared_memory.SharedMemory(name=name, create=True, size=4096)
    time.sleep(600)

if __name__ == "__main__":
    orphans.guard_descendants()
    holder = multiprocessing.get_context("spawn").Process(target=hold, args=(sys.argv[1],))
    holder.start()
    subprocess.Popen(["sh", "-c", "sleep 600 & exec sleep 601"])
    if os.fork() == 0:
        time.sleep(600)
        os._exit(0)
    while not os.path.exists("/dev/shm/" + sys.argv[1]):
        time.sleep(0.01)
    time.sleep(2 * orphans.SCAN_INTERVAL_S)  # the guard has looked at the family since
    print("ready", flush=True)
    time.sleep(600)
"""


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def command_line(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.mark.subprocess
def test_a_killed_process_takes_its_descendants_along_but_not_its_caller(tmp_path: Path) -> None:
    memory = f"anex-test-{uuid.uuid4().hex[:12]}"
    bystander = subprocess.Popen(["sleep", "600"])  # the caller's own child: not the guarded one's
    script = tmp_path / "guarded.py"  # a file: spawned children import their target from it
    script.write_text(GUARDED)
    guarded = subprocess.Popen([sys.executable, str(script), memory], stdout=subprocess.PIPE, text=True)
    family: dict[int, int] = {}
    try:
        assert guarded.stdout is not None
        assert select.select([guarded.stdout], [], [], 60)[0], "the guarded process never got its family ready"
        assert guarded.stdout.readline() == "ready\n"
        family = descendants(guarded.pid)
        lines = {pid: command_line(pid) for pid in family}
        trackers = [pid for pid, line in lines.items() if RESOURCE_TRACKER in line]
        assert len(trackers) == 1 and len(family) == 6, lines  # guard, tracker, holder, two sleeps, fork
        assert sum(b"sleep" in line for line in lines.values()) == 2, lines

        guarded.kill()
        guarded.wait()
        wait_until(
            lambda: all(start_time(pid) != start for pid, start in family.items() if pid not in trackers),
            15,  # the guard scans every 0.2 s; the margin is for a machine loaded far past its cores
            "descendants of the killed process were alive 15 s after it",
        )
        # The resource tracker was left to finish: it removed the shared memory the holder left.
        wait_until(lambda: not Path("/dev/shm", memory).exists(), 5, "the shared memory was not removed")
        wait_until(lambda: start_time(trackers[0]) != family[trackers[0]], 5, "the resource tracker lives on")
        assert bystander.poll() is None  # nothing outside the family was touched
    finally:
        guarded.kill()
        bystander.kill()
        kill_all(family)


@pytest.mark.subprocess
def test_a_pid_that_now_names_another_process_is_spared() -> None:
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        started = start_time(sleeper.pid)
        assert started is not None
        assert not signal_if_same(sleeper.pid, started + 1, signal.SIGKILL)  # as if its pid were another's now
        assert sleeper.poll() is None
        assert signal_if_same(sleeper.pid, started, signal.SIGKILL)
        assert sleeper.wait(timeout=5) == -signal.SIGKILL
    finally:
        sleeper.kill()


@pytest.mark.subprocess
def test_a_group_is_signalled_only_through_the_leader_it_was_recorded_with() -> None:
    leader = subprocess.Popen(["sh", "-c", "sleep 600 & wait"], start_new_session=True)  # a group of two
    member = subprocess.Popen(["sleep", "600"])  # in the test's group, led by someone else
    try:
        wait_until(lambda: len(descendants(leader.pid)) == 1, 5, "the group's second process did not start")
        [(child, child_start)] = descendants(leader.pid).items()
        started = start_time(leader.pid)
        assert started is not None
        assert not signal_if_same(leader.pid, started + 1, signal.SIGKILL, group=True)
        assert not signal_if_same(member.pid, start_time(member.pid) or 0, signal.SIGKILL, group=True), "no leader"
        assert not signal_if_same(child, child_start, signal.SIGKILL, group=True), "a member leads no group"
        assert leader.poll() is None and member.poll() is None and running(child, child_start)
        assert signal_child_group(leader, signal.SIGKILL)
        assert leader.wait(timeout=5) == -signal.SIGKILL
        wait_until(lambda: not running(child, child_start), 5, "the group's other process lives on")
        assert not signal_child_group(leader, signal.SIGKILL), "a reaped child's pid may be another's"
        assert member.poll() is None
    finally:
        leader.kill()
        member.kill()
        member.wait()


GUARDED_WITH_SERVER = """
import subprocess, sys, time
from anex_pipeline.engine import orphans

orphans.guard_descendants()
# Named like the shared model server's supervisor, with a child of its own.
server = subprocess.Popen(["sh", "-c", "sleep 600 & wait", orphans.DETACHED.decode()], start_new_session=True)
time.sleep(3 * orphans.SCAN_INTERVAL_S)  # the guard has looked at the family since
print(server.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.subprocess
def test_the_shared_model_server_outlives_the_guarded_process_that_started_it(tmp_path: Path) -> None:
    script = tmp_path / "guarded.py"
    script.write_text(GUARDED_WITH_SERVER)
    guarded = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    server: dict[int, int] = {}
    try:
        assert guarded.stdout is not None
        assert select.select([guarded.stdout], [], [], 60)[0], "the guarded process never started its server"
        supervisor = int(guarded.stdout.readline())
        server = descendants(supervisor) | {supervisor: start_time(supervisor) or 0}
        assert len(server) == 2  # the supervisor and the sleep under it
        guards = [pid for pid in descendants(guarded.pid) if b"orphans.py" in command_line(pid)]
        assert len(guards) == 1 and supervisor not in descendants(guarded.pid)
        guard_started = start_time(guards[0])
        guarded.kill()
        guarded.wait()
        wait_until(lambda: start_time(guards[0]) != guard_started, 5, "the guard did not finish")
        assert all(start_time(pid) == start for pid, start in server.items()), "the server was killed"
    finally:
        guarded.kill()
        for pid, start in server.items():  # kill_all spares them, as the guard does
            signal_if_same(pid, start, signal.SIGKILL)
