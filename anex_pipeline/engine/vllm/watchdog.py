"""Turns the death of vLLM's engine process into an error of the call, instead of a hang.

In multiprocess mode (vLLM 0.32's default) the offline ``LLM`` hands requests to an EngineCore
process and reads its outputs from a queue that a socket thread fills. When that process dies
without a word (the OOM killer, SIGKILL, a crash in native code), vLLM's own monitor notices
within a second and shuts the client down, but it puts nothing on the queue: ``LLM.generate``
then waits on it for ever. :func:`watch_engine` waits on the engine processes while a call runs;
when one ends it puts vLLM's ``EngineDeadError`` on that queue, so the call raises at once, and
it turns the error into :class:`EngineProcessDied`, which says how the process ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import Pipe, connection
from multiprocessing.process import BaseProcess
from typing import Any

from anex_pipeline.errors import EngineProcessDied


class EngineWatch:
    """Whether an engine's vLLM engine process has died, as the calls it watched found."""

    def __init__(self) -> None:
        self.dead = False

    @contextmanager
    def call(self, llm: Any) -> Iterator[None]:
        """Runs the body under :func:`watch_engine`: a dead engine process fails the call instead
        of hanging it, and marks the engine dead for good (the loader then replaces it, so the
        shard's retry gets a new one)."""
        try:
            with watch_engine(llm):
                yield
        except EngineProcessDied:
            self.dead = True
            raise


def engine_processes(llm: Any) -> list[BaseProcess]:
    """The EngineCore processes of a ``vllm.LLM`` (none when the core runs in this process)."""
    client = llm.llm_engine.engine_core
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def engine_gone(llm: Any) -> bool:
    """Whether an engine process of ``llm`` has ended, or vLLM's client has given its engine up.
    It looks without reaping the process (see :func:`_exit_code`)."""
    if getattr(getattr(llm.llm_engine.engine_core, "resources", None), "engine_dead", False):
        return True
    processes = engine_processes(llm)
    return bool(processes) and bool(connection.wait([p.sentinel for p in processes], timeout=0))


@contextmanager
def watch_engine(llm: Any) -> Iterator[None]:
    """Runs the body while a thread watches the engine processes of ``llm``.

    If a process ends, the body's vLLM call fails at once with :class:`EngineProcessDied`
    instead of blocking; any other ``EngineDeadError`` of vLLM is raised as one too.
    """
    from vllm.v1.engine.exceptions import EngineDeadError

    processes = engine_processes(llm)
    outputs = getattr(llm.llm_engine.engine_core, "outputs_queue", None)
    calm, end_of_call = Pipe(duplex=False)  # closing end_of_call wakes the watchdog at once

    def watch() -> None:
        if calm not in connection.wait([calm, *(p.sentinel for p in processes)]):
            outputs.put_nowait(EngineDeadError(suppress_context=True))

    thread = threading.Thread(target=watch, name="anex-engine-watchdog", daemon=True)
    if processes and outputs is not None:  # an in-process core has no process of its own to lose
        thread.start()
    try:
        yield
    except EngineDeadError as exc:
        raise EngineProcessDied(_how_it_ended(processes)) from exc
    finally:
        end_of_call.close()
        if thread.ident is not None:
            thread.join()
        calm.close()


def _how_it_ended(processes: list[BaseProcess]) -> str:
    how = ""
    ended = connection.wait([p.sentinel for p in processes], timeout=1) if processes else []
    for p in processes:
        if p.sentinel in ended:
            code = _exit_code(p)
            if code is not None:
                how = f" (signal {-code})" if code < 0 else f" (exit code {code})"
            break
    return f"the vLLM engine process died{how} during generation; finished rows are kept, rerun to resume"


def _exit_code(process: BaseProcess, timeout: float = 2.0) -> int | None:
    """The exit code of an ended process. vLLM's monitor thread reaps it too: when it wins the
    race, our own wait finds nothing to reap and the code appears only once that thread has
    stored it, so it is polled for."""
    deadline = time.monotonic() + timeout
    process.join(timeout=timeout)
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return process.exitcode
