"""One model server per machine for the step processes: started once however many steps (or
racing processes) need it, replaced when it dies, ending by itself when idle, its processes
ending with its supervisor; a state is trusted only as far as it is safe, and nothing is
signalled that fails the pid and start-time check. Real ``vllm serve`` processes on loopback and
real multi-process Dagster runs (engine tests); real supervisors over a stand-in server, real
processes to spare or end, and real loopback servers (fast tests)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import dagster as dg
import pytest

from anex_pipeline.cli import main as cli_main
from anex_pipeline.engine.config import EngineSettings
from anex_pipeline.engine.loader import _loaded
from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL, local_model_path
from anex_pipeline.engine.orphans import RESOURCE_TRACKER, cmdline_has, descendants, running, signal_if_same, start_time
from anex_pipeline.engine.server import machine_server
from anex_pipeline.engine.server.machine_server import (
    ServerBusy,
    UnsafeStateFolder,
    alive,
    knows_token,
    read_state,
    server_for,
    settings_key,
    starts,
    stop_server,
)
from anex_pipeline.orchestration.partitions import JOBS
from anex_pipeline.runner import QUIET_LOGGERS
from anex_pipeline_tests.harness.deployment import Deployment
from anex_pipeline_tests.harness.jobs import REPO, chat_row, read_jsonl, write_jsonl

SETTINGS_CODE = (
    "from anex_pipeline.engine.vllm.engine import EngineSettings\n"
    "from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL, local_model_path\n"
    "settings = EngineSettings(model=str(local_model_path(DEFAULT_CHAT_MODEL)), model_name=DEFAULT_CHAT_MODEL,"
    " max_model_len=2048)\n"
)


def tiny_settings() -> EngineSettings:
    return EngineSettings(
        model=str(local_model_path(DEFAULT_CHAT_MODEL)), model_name=DEFAULT_CHAT_MODEL, max_model_len=2048
    )


@pytest.fixture
def server_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = tmp_path / "machine-server"
    monkeypatch.setenv("ANEX_MACHINE_SERVER_DIR", str(folder))
    yield folder
    stop_server(folder)


def wait_until(condition: object, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.mark.subprocess
@pytest.mark.vllm_serve
@pytest.mark.engine
def test_racing_processes_start_one_server_a_killed_one_is_replaced_an_idle_one_ends(server_dir: Path) -> None:
    code = SETTINGS_CODE + (
        "import sys\nfrom pathlib import Path\nfrom anex_pipeline.engine.server.machine_server import server_for\n"
        "print(server_for(settings, idle_s=600, folder=Path(sys.argv[1])).url)\n"
    )
    racers = [
        subprocess.Popen([sys.executable, "-c", code, str(server_dir)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    urls = {racer.communicate(timeout=600)[0].strip() for racer in racers}
    assert all(racer.returncode == 0 for racer in racers)
    assert len(urls) == 1 and starts(server_dir) == 1, "both processes use the one server the first started"

    first = read_state(server_dir)
    assert first is not None and first.url in urls
    family = dict(first.processes)
    names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in family}
    assert {"VLLM::EngineCor", "VLLM::Worker"} <= names, names  # comm keeps 15 characters
    # As the OOM killer or a kill -9 would: the supervisor alone. vllm serve gets its death signal;
    # its engine processes, which that signal does not reach, are the supervisor's guard's.
    assert signal_if_same(first.pid, first.start, signal.SIGKILL)
    engine = {pid: start for pid, start in family.items() if not cmdline_has(pid, RESOURCE_TRACKER)}
    wait_until(lambda: not any(running(pid, start) for pid, start in engine.items()), "vLLM outlived it", 10)
    wait_until(lambda: not any(running(pid, start) for pid, start in family.items()), "the tracker lived on", 30)
    second = server_for(tiny_settings(), idle_s=3, folder=server_dir)
    assert second == read_state(server_dir) and second.pid != first.pid
    assert starts(server_dir) == 2, "the dead server was noticed and replaced"

    wait_until(lambda: not alive(second), "an idle server ends by itself", timeout_s=150)
    assert read_state(server_dir) is None, "and leaves no state behind"


def run_multiprocess(deployment: Deployment, request: dg.RunRequest) -> dg.DagsterRun:
    """Runs what the driver asked for as the daemon would: each step in a process of its own."""
    job = dg.build_reconstructable_job(
        "anex_pipeline_tests.harness.shared_engine_location",
        "job_named",
        reconstructable_args=(request.job_name,),
        reconstructor_working_directory=str(REPO),
    )
    tags = {**request.tags, "dagster/partition": request.partition_key}
    run_config = {**request.run_config, "loggers": QUIET_LOGGERS}
    with dg.execute_job(job, deployment.instance, run_config=run_config, tags=tags) as result:
        assert result.success, [str(e.event_specific_data)[-2500:] for e in result.all_events if e.is_failure]
        return result.dagster_run


@pytest.mark.vllm_serve
@pytest.mark.engine
def test_a_jobs_step_processes_share_one_loaded_engine(
    tmp_path: Path, server_dir: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANEX_WORK_DIR", str(tmp_path / "work"))
    monkeypatch.setenv("ANEX_EXECUTOR", "multiprocess")  # each step a process of its own
    from anex_pipeline_tests.harness.shared_engine_location import defs

    deployment = Deployment(defs, instance)
    src = write_jsonl(tmp_path / "in.jsonl", [chat_row(f"r{i}", f"Count to {i}.") for i in range(6)])
    out = tmp_path / "out.jsonl"
    # No max_tokens: the estimate step runs on the engine too, before the two shards.
    config = {"input": str(src), "output": str(out), "options": {"shards": 2}}
    instance.add_dynamic_partitions(JOBS, ["shared"])
    submit = dg.RunRequest(partition_key="shared", run_config={"ops": {"validated_input": {"config": config}}})
    run_multiprocess(deployment, submit.with_replaced_attrs(job_name="submit_job"))
    engine_steps = 0
    for _ in range(10):
        requests = deployment.tick("job_driver").run_requests or []
        if not requests:
            break
        for request in requests:
            run_multiprocess(deployment, request)
            engine_steps += request.job_name in ("estimate_job", "shard_job")
    assert engine_steps == 3, "the estimate and two shards ran, each in step processes of their own"
    assert starts(server_dir) == 1, "the model was loaded once for every step"
    assert not _loaded, "and never in this process"
    rows = read_jsonl(out)
    assert [r["custom_id"] for r in rows] == [f"r{i}" for i in range(6)]
    assert all(r["response"]["status_code"] == 200 for r in rows)
    assert all(r["response"]["body"]["choices"][0]["message"]["content"] for r in rows)


# -- fast tests: real supervisors over a stand-in server, real processes, real loopback servers --
FAKE_SERVER = Path(__file__).parent / "harness" / "fake_model_server.py"


@pytest.fixture
def fake_servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Supervisors started by ``server_for`` run the stand-in server; it is busy while the returned
    file exists."""
    busy = tmp_path / "busy"
    monkeypatch.setattr(
        machine_server,
        "server_command",
        lambda settings, port: [sys.executable, str(FAKE_SERVER), "--port", str(port), "--busy-file", str(busy)],
    )
    return busy


def settings_of(model_name: str) -> EngineSettings:
    return EngineSettings(model=f"/models/{model_name}", model_name=model_name)


def forge_state(folder: Path, **fields: object) -> None:
    """Writes a state file as a step would (the lock file beside it), with ``fields`` changed."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    (folder / "lock").touch()
    state = {
        "pid": 2**22 - 1, "start": 1, "group": 2**22 - 1, "port": 9, "key": "k", "model_name": "m",
        "log": str(folder / "server.log"), "token": "t", "processes": [],
    }  # fmt: skip
    state.update(fields)
    (folder / "state.json").write_text(json.dumps(state), encoding="utf-8")


@pytest.fixture
def leader() -> Iterator[tuple[int, int]]:
    """An unrelated process leading a group of its own (a sleep in its own session), with its start."""
    sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        started = start_time(sleeper.pid)
        assert started is not None
        yield sleeper.pid, started
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.subprocess
def test_a_state_naming_an_unrelated_group_leader_signals_nothing_of_it(
    server_dir: Path, leader: tuple[int, int]
) -> None:
    pid, started = leader
    # A pid whose start time differs (a reboot, a container restart, the supervisor killed and its
    # pid given to another process); then the right start time, but no supervisor there.
    for start in (started + 1, started):
        forge_state(server_dir, pid=pid, start=start, group=pid, processes=[[pid, started + 1]])
        state = read_state(server_dir)
        assert state is not None and not alive(state)
        assert stop_server(server_dir) == state
        assert running(pid, started), "the unrelated group leader was signalled"
        assert not (server_dir / "state.json").exists(), "and the state that named it is gone"


@pytest.mark.subprocess
@pytest.mark.parametrize("finder", ["the next step", "machine-server stop"])
def test_a_dead_supervisors_strays_are_ended_by_pid_and_start_time(
    server_dir: Path, fake_servers: Path, leader: tuple[int, int], finder: str
) -> None:
    stray = subprocess.Popen(["sleep", "600"], start_new_session=True)  # as vLLM's engine would be
    try:
        stray_start = start_time(stray.pid)
        pid, started = leader
        processes = [[stray.pid, stray_start], [pid, started + 1]]  # the second is no longer the one recorded
        forge_state(server_dir, pid=pid, start=started + 1, group=pid, processes=processes)
        if finder == "the next step":
            assert server_for(settings_of("a"), folder=server_dir).pid not in (pid, stray.pid)
        else:
            assert cli_main(["machine-server", "stop"]) == 0
            assert not (server_dir / "state.json").exists()
        assert stray.wait(timeout=10) == -signal.SIGKILL, "the stray the state recorded was ended"
        assert running(pid, started), "the process that reused a recorded pid was spared"
    finally:
        stray.kill()
        stray.wait()


NAMESPACE_CHECK = """
import json, os, signal, subprocess, sys, time
from pathlib import Path
from anex_pipeline.engine.server.machine_server import read_state, stop_server
from anex_pipeline.engine.orphans import running, signal_if_same, start_time

folder = Path(sys.argv[1])
assert os.getpid() == 1
own_group = subprocess.Popen(["sleep", "600"])  # in this process's group: pid 0's
other = subprocess.Popen(["sleep", "600"], start_new_session=True)  # only kill(-1) reaches it
time.sleep(0.2)
bystanders = [(p.pid, start_time(p.pid)) for p in (own_group, other)]
for pid in (0, 1):
    start = start_time(1) if pid == 1 else 0
    assert not signal_if_same(pid, start, signal.SIGKILL), pid
    assert not signal_if_same(pid, start, signal.SIGKILL, group=True), pid
    state = {"pid": pid, "start": start, "group": pid, "port": 9, "key": "k", "model_name": "m",
             "log": "x", "token": "t", "processes": [[pid, start]]}
    (folder / "state.json").write_text(json.dumps(state))
    assert read_state(folder) is None, pid
    stop_server(folder)
    state["pid"] = state["group"] = own_group.pid  # a group of its own is fine, a recorded pid 0 or 1 is not
    (folder / "state.json").write_text(json.dumps(state))
    assert read_state(folder) is None, pid
    stop_server(folder)
time.sleep(0.5)
assert all(running(pid, start) for pid, start in bystanders), bystanders
print("spared", flush=True)
"""


@pytest.mark.subprocess
def test_pids_0_and_1_in_a_state_are_refused_without_a_signal(server_dir: Path) -> None:
    """Run as pid 1 of a throwaway pid namespace: there, a signal to group 1 (``kill(-1)``) or to
    group 0 reaches only the namespace's processes, so a failure cannot harm the machine."""
    if os.geteuid() != 0:
        pytest.skip("a pid namespace needs root")
    forge_state(server_dir)
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", NAMESPACE_CHECK, str(server_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "spared", done.stderr[-3000:]


@pytest.mark.parametrize(
    "change",
    [
        {"pid": "abc"},
        {"port": "x"},
        {"pid": True, "group": True},
        {"pid": 2**40, "group": 2**40},
        {"processes": [[2**40, 1]]},
        {"start": 1.5},
        {"processes": [["1", 2]]},
        {"processes": {"5": 1}},
        {"token": ""},
        {"port": 70000},
        {"group": 12345},  # not the supervisor's own group
        {"extra": 1},
    ],
)
def test_a_state_with_wrong_fields_or_types_counts_as_no_state(
    server_dir: Path, change: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    me = {"pid": os.getpid(), "group": os.getpid(), "start": start_time(os.getpid())}
    forge_state(server_dir, **me)
    assert read_state(server_dir) is not None, "the state as a step writes it is read"
    forge_state(server_dir, **{**me, **change})
    assert read_state(server_dir) is None
    assert stop_server(server_dir) is None
    assert cli_main(["machine-server", "status"]) == 0
    assert "no model server runs" in capsys.readouterr().err


def test_an_unreadable_state_counts_as_no_state(server_dir: Path) -> None:
    forge_state(server_dir)
    valid = (server_dir / "state.json").read_text(encoding="utf-8")
    for text in ("[1, 2]", "{", "[" * 100_000, "", valid + " " * (1 << 20)):
        (server_dir / "state.json").write_text(text, encoding="utf-8")
        assert read_state(server_dir) is None


@pytest.mark.subprocess
def test_a_state_folder_or_file_others_can_write_is_refused(
    server_dir: Path, fake_servers: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    forge_state(server_dir)
    cases = [
        (server_dir, 0o777, "state folder", "may be written by other users (mode 0777)"),
        (server_dir, 0o770, "state folder", "may be written by other users (mode 0770)"),
        (server_dir / "state.json", 0o666, "state file", "may be written by other users (mode 0666)"),
    ]
    for path, mode, what, problem in cases:
        path.chmod(mode)
        with pytest.raises(UnsafeStateFolder, match=re.escape(f"{what} {path} {problem}")):
            read_state(server_dir)
        with pytest.raises(UnsafeStateFolder):
            server_for(settings_of("a"), folder=server_dir)
        assert cli_main(["machine-server", "stop"]) == 2
        line = capsys.readouterr().err.strip()
        assert line.startswith("error: ") and "chmod go-w" in line and "\n" not in line, line
        path.chmod(0o700 if path.is_dir() else 0o600)
    os.chown(server_dir, 65534, 65534)
    with pytest.raises(UnsafeStateFolder, match="belongs to uid 65534, not to this user"):
        read_state(server_dir)
    os.chown(server_dir, os.getuid(), os.getgid())
    assert starts(server_dir) == 0, "no server was started from an unsafe folder"


class AnswersAll(BaseHTTPRequestHandler):
    """Some other program on a loopback port: it answers every request, whatever key it carries."""

    requests: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.requests.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def other_program() -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), AnswersAll)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        thread.join()


@pytest.mark.subprocess
def test_a_forged_state_pointing_at_another_loopback_port_is_not_used(
    server_dir: Path, fake_servers: Path, other_program: ThreadingHTTPServer
) -> None:
    # A live process under the supervisor's name, so the state passes every check but the token.
    sleep = [sys.executable, "-c", "import time; time.sleep(600)", machine_server.DETACHED.decode()]
    named = subprocess.Popen(sleep, start_new_session=True)
    try:
        wait_until(lambda: cmdline_has(named.pid, machine_server.DETACHED), "its command line never showed", 10)
        settings = settings_of("a")
        port = other_program.server_address[1]
        started = start_time(named.pid)
        forge_state(server_dir, pid=named.pid, start=started, group=named.pid, port=port, key=settings_key(settings))
        forged = read_state(server_dir)
        assert forged is not None and alive(forged) and not knows_token(forged)
        server = server_for(settings, folder=server_dir)
        assert server.port != port and knows_token(server), "a server of its own was started and checked"
        assert starts(server_dir) == 1
        assert all(path in ("/health", "/v1/models") for path in AnswersAll.requests), "no row went to it"
    finally:
        named.kill()
        named.wait()


@pytest.mark.subprocess
def test_a_step_gives_up_waiting_for_a_busy_server_of_other_settings(
    server_dir: Path, fake_servers: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = server_for(settings_of("a"), folder=server_dir)
    fake_servers.touch()  # its rows are running
    asked = time.monotonic()
    busy = r"still ran rows for a \(other engine settings\) after 2 s"
    with caplog.at_level(logging.INFO, logger="anex_pipeline.progress"), pytest.raises(ServerBusy, match=busy):
        server_for(settings_of("b"), folder=server_dir, wait_s=2)
    assert time.monotonic() - asked < 10
    assert "waiting up to 2 s for them to finish" in caplog.text
    assert alive(first) and read_state(server_dir) == first, "the busy server was left alone"
    fake_servers.unlink()  # its rows are done: the next step replaces it
    second = server_for(settings_of("b"), folder=server_dir, wait_s=2)
    assert second.pid != first.pid and starts(server_dir) == 2
    wait_until(lambda: not any(running(pid, start) for pid, start in first.processes), "the first server ended", 15)


@pytest.mark.subprocess
def test_a_command_uses_a_warm_server_but_never_starts_or_replaces_one(server_dir: Path, fake_servers: Path) -> None:
    """What ``run`` asks without --keep-engine: the server up for its settings, or none."""
    assert server_for(settings_of("a"), folder=server_dir, start=False) is None
    assert starts(server_dir) == 0, "nothing was started"
    warm = server_for(settings_of("a"), folder=server_dir)
    assert server_for(settings_of("a"), folder=server_dir, start=False) == warm
    assert server_for(settings_of("b"), folder=server_dir, start=False) is None, "other settings: not that server"
    assert read_state(server_dir) == warm and alive(warm), "and it was left up for the job it serves"
    assert starts(server_dir) == 1


@pytest.mark.subprocess
def test_a_supervisor_killed_with_sigkill_takes_its_server_along(server_dir: Path, fake_servers: Path) -> None:
    state = server_for(settings_of("a"), folder=server_dir)
    family = descendants(state.pid)
    assert len(family) >= 3, "the server, its child and the supervisor's guard"
    assert set(state.processes) == set(family.items()), "the state records them"
    assert signal_if_same(state.pid, state.start, signal.SIGKILL)  # the supervisor alone
    wait_until(lambda: not any(running(pid, start) for pid, start in family.items()), "its processes live on", 10)
