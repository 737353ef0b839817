"""The ``anex-pipeline`` command as installed (``anex_pipeline.cli.entry``), with measuring added
from outside, for ``bench.overhead``: nothing of the package is changed or replaced.

    python -m bench.overhead_command [--fake] [--record FILE] [--steps FILE] [--profile FILE] -- run IN -o OUT ...

- ``--fake``: the job runs on the fake engine that ships with the package
  (``anex_pipeline.testing``, engine kind ``fake``), as ``ANEX_ENGINE=fake`` selects it.
- ``--record FILE``: the seconds of the command's ``main`` (from the arguments read to the report
  printed: submit to merge and publish), and the collections Python's cyclic garbage collector
  made meanwhile and their seconds, by generation, as JSON.
- ``--steps FILE``: every vLLM engine step's start and end (``bench.step_timing``).
- ``--profile FILE``: a cProfile of the command, every thread it starts included (each thread has
  a profiler of its own; the file holds their sum, for ``pstats``). ``--profile-clock cpu`` counts
  each thread's CPU time instead of the wall clock: time spent waiting (on vLLM's engine process,
  a lock, a disk) is then left out.

Everything is written by an exit handler: the command runs its exit handlers and then leaves with
``os._exit``, skipping the interpreter's teardown.
"""

from __future__ import annotations

import argparse
import atexit
import cProfile
import gc
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _profile_threads(profiles: list[cProfile.Profile], new: Callable[[], cProfile.Profile]) -> None:
    """Every thread started from now on runs under a profiler of its own (made by ``new``), kept in
    ``profiles``."""
    original = threading.Thread.run

    def run(self: threading.Thread) -> None:
        profiler = new()
        profiles.append(profiler)
        profiler.enable()
        try:
            original(self)
        finally:
            profiler.disable()

    threading.Thread.run = run  # type: ignore[method-assign]


def _save_profiles(profiles: list[cProfile.Profile], path: Path) -> None:
    import pstats

    for profiler in profiles:
        profiler.disable()  # the calling thread's; a thread still running stops adding when it next returns
    merged = None
    for profiler in profiles:
        try:
            merged = pstats.Stats(profiler) if merged is None else merged.add(profiler)
        except (TypeError, ValueError):  # a thread that never called anything
            continue
    if merged is not None:
        merged.dump_stats(str(path))


def _timed(main: Callable[..., int], record: dict[str, Any]) -> Callable[..., int]:
    def timed_main(*args: Any, **kwargs: Any) -> int:
        started = time.perf_counter()
        try:
            return main(*args, **kwargs)
        finally:
            record["main_s"] = time.perf_counter() - started

    return timed_main


def _count_collections(record: dict[str, Any]) -> None:
    """Adds the cyclic garbage collector's collections and their seconds, by generation, to ``record``."""
    counts, seconds = [0, 0, 0], [0.0, 0.0, 0.0]
    record["gc_collections"], record["gc_seconds"] = counts, seconds
    began: list[float] = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            counts[info["generation"]] += 1
            seconds[info["generation"]] += time.perf_counter() - began[0]

    gc.callbacks.append(callback)


def run(argv: list[str]) -> None:
    if "--" not in argv:
        raise SystemExit("usage: python -m bench.overhead_command [options] -- <anex-pipeline arguments>")
    split = argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--fake", action="store_true")
    parser.add_argument("--record", type=Path)
    parser.add_argument("--steps", type=Path)
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--profile-clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args(argv[:split])
    if args.fake:
        import anex_pipeline.testing  # noqa: F401  registers the engine kind "fake"

        os.environ["ANEX_ENGINE"] = "fake"
    if args.steps:
        from bench import step_timing

        step_timing.install()
    from anex_pipeline import cli

    record: dict[str, Any] = {}
    _count_collections(record)
    cli.main = _timed(cli.main, record)  # entry() calls it by its module-level name
    profiles: list[cProfile.Profile] = []

    def save() -> None:
        if args.record:
            args.record.write_text(json.dumps(record))
        if args.steps:
            from bench import step_timing

            step_timing.write(args.steps)
        if args.profile:
            _save_profiles(profiles, args.profile)

    atexit.register(save)  # registered first, so it runs after the command's own exit handlers
    if args.profile:

        def new() -> cProfile.Profile:
            return cProfile.Profile(time.thread_time) if args.profile_clock == "cpu" else cProfile.Profile()

        _profile_threads(profiles, new)
        main_thread = new()
        profiles.append(main_thread)
        main_thread.enable()
    sys.argv = ["anex-pipeline", *argv[split + 1 :]]
    cli.entry()


if __name__ == "__main__":
    run(sys.argv[1:])
