"""When each of vLLM's engine steps began and ended in this process, without touching the code that
calls them: :func:`install` wraps ``LLMEngine.step`` (vLLM's v1 engine, the one both the
pipeline's stepping loop and ``LLM.generate`` drive) as soon as vLLM's module is imported, so
installing it costs no import of vLLM, and :func:`write` saves the steps as JSON.

With vLLM's engine core in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) a step is the
model's whole step, and the time between two steps is time the engine sits idle. With the core in
its own process, ``step`` waits for the core's next output; the core keeps stepping meanwhile, so
the gap is the caller's own time per step, not the engine's idle time.

:func:`gaps` reads a saved file back: the time between one step's end and the next one's start,
per thread.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import itertools
import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MODULE = "vllm.v1.engine.llm_engine"

# (thread id, start, end, outputs returned), perf_counter seconds
_steps: list[tuple[int, float, float, int]] = []


def _wrap(module: Any) -> None:
    engine = module.LLMEngine
    if getattr(engine.step, "_timed", False):
        return
    step = engine.step

    def timed_step(self: Any) -> Any:
        started = time.perf_counter()
        outputs = step(self)
        _steps.append((threading.get_ident(), started, time.perf_counter(), len(outputs)))
        return outputs

    timed_step._timed = True  # type: ignore[attr-defined]
    engine.step = timed_step


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _wrap(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target)  # type: ignore[call-arg]
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Times every ``LLMEngine.step`` of this process from now on."""
    if MODULE in sys.modules:
        _wrap(sys.modules[MODULE])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def write(path: Path) -> None:
    path.write_text(json.dumps(_steps))


def gaps(path: Path) -> dict[str, Any]:
    """The steps saved in ``path``: how many, their total time, and the gaps between one step's end
    and the next one's start in the same thread (median, p90, p99, max, total), in seconds."""
    steps: Sequence[tuple[int, float, float, int]] = json.loads(path.read_text())
    by_thread: dict[int, list[tuple[float, float, int]]] = {}
    for thread, start, end, outputs in steps:
        by_thread.setdefault(thread, []).append((start, end, outputs))
    between = []
    for ordered in by_thread.values():
        ordered.sort()
        between += [nxt[0] - prev[1] for prev, nxt in itertools.pairwise(ordered)]
    stepping = [end - start for _, start, end, _ in steps]
    return {
        "steps": len(steps),
        "step_total_s": sum(stepping),
        "step_median_s": statistics.median(stepping) if stepping else 0.0,
        "gap_total_s": sum(between),
        "gap_median_s": statistics.median(between) if between else 0.0,
        "gap_p90_s": _quantile(between, 0.9),
        "gap_p99_s": _quantile(between, 0.99),
        "gap_max_s": max(between, default=0.0),
        "outputs": sum(n for *_, n in steps),
        "first_to_last_s": max(e for _, _, e, _ in steps) - min(s for _, s, _, _ in steps) if steps else 0.0,
    }


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
