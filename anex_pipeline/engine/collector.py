"""Python's cyclic garbage collector held off while a process starts and builds a vLLM engine.

Importing Dagster, vLLM, torch and transformers and building an engine allocate millions of
objects that live as long as the process, and each burst of allocations sets off collections that
walk the whole growing heap again: `from vllm import LLM` took 12.6 s with the collector running
and 10.6-11.4 s without it on the 2-core build machine, the command's own imports 1.7-2.0 s against
1.4-1.5 s. That work leaves no cycles worth collecting (vLLM's engine build collects once at its
end and freezes what is left, see its ``freeze_gc_heap``), so the collector is off while:

- :func:`paused` spans run (vLLM's imports and an engine's build, on whichever threads);
- the command's start-up holds it (:func:`hold_for_start_up`), until :func:`end_start_up`: the
  job's engine is in hand (or failed to load), or the command ends.

It comes back on when the last of them ends, if it was on before the first.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_spans = 0  # paused spans and the start-up hold, together
_was_enabled = False
_start_up = False  # the start-up hold is one of the spans


def _enter() -> None:
    global _spans, _was_enabled
    with _lock:
        if _spans == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _spans += 1


def _leave() -> None:
    global _spans
    with _lock:
        _spans -= 1
        if _spans == 0 and _was_enabled:
            gc.enable()


@contextmanager
def paused() -> Iterator[None]:
    _enter()
    try:
        yield
    finally:
        _leave()


def hold_for_start_up() -> None:
    """Keeps the collector off until :func:`end_start_up` (once per process)."""
    global _start_up
    if not _start_up:
        _start_up = True
        _enter()


def end_start_up() -> None:
    """Ends the start-up hold, if there is one; later calls do nothing."""
    global _start_up
    with _lock:
        held, _start_up = _start_up, False
    if held:
        _leave()
