"""A real Ray cluster on this machine for the Ray tests: a head with no CPUs and worker "nodes",
each node a ``ray start`` in its own PID, UTS and mount namespace (``unshare``) with its own
hostname, its own ``/proc`` and one logical GPU. Killing the one process the harness started for
a node takes the whole node down, as losing a machine does; freezing it stops every process of
its PID namespace. Everything is stopped through the PIDs started here, never with ``ray stop``
(which would stop every Ray process of the machine, other people's included).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anex_pipeline_tests.harness.ports import free_port

OBJECT_STORE_BYTES = 80 * 1024 * 1024  # Ray's floor is 75 MiB; nothing here puts objects in it
STARTUP_S = 300.0  # a busy 2-core machine took over 120 s for one node
# Ray's GCS declares a node dead after this many missed health checks of this period: about 4 s
# instead of Ray's 30 s, so that a killed or frozen node is noticed quickly.
HEAD_ENV = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "4",
}
# Ray's own start-up timeouts are meant for quiet machines: a raylet gives its dashboard agent 15 s
# and a worker process 60 s to register, and a busy 2-core machine needed more.
NODE_ENV = {"RAY_agent_register_timeout_ms": "180000", "RAY_worker_register_timeout_seconds": "300"}
WORKER_PORTS = 40  # each node's own range of worker ports, so nodes on one machine never share one
HOST_RESOURCE = "anex-host-"  # a custom resource naming each node's hostname, to find it in Ray's node list


def ray_command() -> str:
    return str(Path(sys.executable).with_name("ray"))


def wait_for(condition: Callable[[], object], timeout: float, what: str, every: float = 0.2) -> object:
    """Polls ``condition`` until it returns something true, for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def _pid_namespace(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with suppress(OSError), open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


@dataclass
class Node:
    """One namespaced ``ray start``: ``process`` is the ``unshare`` the harness started."""

    hostname: str
    process: subprocess.Popen[bytes]
    log: Path

    def namespace_pids(self) -> list[int]:
        """Every process of the node (its PID namespace), as this machine numbers them."""
        inner = _children(self.process.pid)  # unshare's child: pid 1 of the namespace
        ns = _pid_namespace(inner[0]) if inner else None
        if ns is None:
            return []
        return [int(p) for p in os.listdir("/proc") if p.isdigit() and _pid_namespace(int(p)) == ns]

    def kill(self) -> None:
        """SIGKILL of the node's one process: ``--kill-child`` takes its namespace down with it."""
        with suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def freeze(self) -> list[int]:
        """SIGSTOP to every process of the node; returns them, for :meth:`thaw`."""
        frozen: list[int] = []
        for _ in range(3):  # a process may fork while we go through the list: go again
            for pid in self.namespace_pids():
                if pid not in frozen:
                    with suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGSTOP)
                        frozen.append(pid)
        return frozen

    @staticmethod
    def thaw(pids: list[int]) -> None:
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class RayCluster:
    root: Path
    env: dict[str, str]
    gcs_port: int = 0
    dashboard_port: int = 0
    head: Node | None = None
    nodes: list[Node] = field(default_factory=list)
    _next_ports: int = 20000

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _start(self, hostname: str, args: list[str], extra_env: dict[str, str] | None = None) -> Node:
        log = self.root / f"{hostname}.log"
        first, last = self._next_ports, self._next_ports + WORKER_PORTS - 1
        self._next_ports += WORKER_PORTS
        unshare = ["unshare", "--pid", "--fork", "--uts", "--mount", "--mount-proc", "--kill-child"]
        if os.geteuid() != 0:
            unshare.append("--map-root-user")
        command = [
            *unshare, "sh", "-c", 'hostname "$0" && exec "$@"', hostname,
            ray_command(), "start", *args, "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
            f"--object-store-memory={OBJECT_STORE_BYTES}", f"--min-worker-port={first}", f"--max-worker-port={last}",
            f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
        ]  # fmt: skip
        with log.open("ab") as out:
            process = subprocess.Popen(
                command,
                env={**self.env, **NODE_ENV, **(extra_env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.root,
            )
        return Node(hostname, process, log)

    def start_head(self) -> None:
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        args = [
            "--head", f"--port={self.gcs_port}", "--num-cpus=0", "--num-gpus=0", "--include-dashboard=true",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={free_port()}", f"--temp-dir={self.root / 'ray'}",
        ]  # fmt: skip
        self.head = self._start("ray-head", args, HEAD_ENV)

    def live_nodes(self) -> list[dict[str, Any]]:
        """The worker nodes Ray counts as alive (the head left out)."""
        from ray.util.state import list_nodes

        try:
            nodes = list_nodes(address=self.dashboard, detail=True)
        except Exception:  # the dashboard is still starting
            return []
        return [n.__dict__ for n in nodes if n.state == "ALIVE" and not n.is_head_node]

    def add_node(self, hostname: str, tries: int = 3) -> Node:
        """Starts a worker node and returns once Ray counts it as alive. Nodes start one at a time:
        a starting node names its sockets after the first free name in the session's folder, and
        two starting at once take the same one. A start that fails (a busy machine can time out
        Ray's own start-up waits) is tried again."""
        marker = f"{HOST_RESOURCE}{hostname}"
        for attempt in range(1, tries + 1):
            args = [f"--address={self.gcs_address}", "--num-cpus=1", "--num-gpus=1", f'--resources={{"{marker}": 1}}']
            node = self._start(hostname, args)

            def up(node: Node = node) -> bool:
                return not node.alive or any(marker in n["resources_total"] for n in self.live_nodes())

            wait_for(up, STARTUP_S, f"{hostname} to join the cluster", every=0.5)
            if node.alive:
                self.nodes.append(node)
                return node
            if attempt == tries:
                raise RuntimeError(f"{hostname} did not start in {tries} tries; see {node.log}")
        raise AssertionError("unreachable")

    def wait_for_nodes(self, count: int, timeout: float = STARTUP_S) -> None:
        wait_for(lambda: len(self.live_nodes()) == count, timeout, f"{count} live Ray worker nodes")

    def stop(self) -> None:
        for node in [*self.nodes, self.head]:
            if node is not None and node.alive:
                node.kill()


@contextmanager
def ray_cluster(workers: list[str], env: dict[str, str]) -> Iterator[RayCluster]:
    """A head with no CPUs and one node per hostname in ``workers``, each with one CPU and one
    logical GPU; every process is gone when the block ends."""
    if shutil.which("unshare") is None:
        raise RuntimeError("the Ray tests need util-linux's unshare")
    # Unix socket paths are short: Ray's session folder must not be deep.
    root = Path(tempfile.mkdtemp(prefix="anex-ray-", dir="/tmp"))
    cluster = RayCluster(root, {**env, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        cluster.start_head()
        for name in workers:
            cluster.add_node(name)
        yield cluster
    finally:
        cluster.stop()
        if not os.environ.get("ANEX_KEEP_RAY"):
            shutil.rmtree(root, ignore_errors=True)
