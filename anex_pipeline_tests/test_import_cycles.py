"""No ring of module-level imports runs across the package's folders.

Python can live with a ring of imports only while each module reaches the others' names after they
are defined, which depends on which module a process happens to import first: such a ring once
let the test process work while every `anex-pipeline run` died at start (``workdir.manifest`` ->
``formats`` -> ``engine`` -> ``workdir.manifest``). A package whose ``__init__`` imports its own
modules is a ring of that kind too, but it stays inside one folder and always starts at the
``__init__``; those are allowed. Imports inside functions and under ``if`` blocks (such as
``TYPE_CHECKING``) run later and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

from anex_pipeline_tests.harness.jobs import REPO

PACKAGE = REPO / "anex_pipeline"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported_at_load(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project's modules that importing ``name`` imports first, its parent packages included."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            named.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            named.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    imported = set()
    for target in named:
        parts = target.split(".")
        imported.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
    return {m for m in imported if m in modules and m != name}


def _rings(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    rings = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    ring = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        ring.append(member)
                        if member == node:
                            break
                    if len(ring) > 1:
                        rings.append(sorted(ring))
    return rings


def _folder(module: str, modules: dict[str, Path]) -> Path:
    return modules[module].parent


def test_no_ring_of_imports_spans_two_folders() -> None:
    modules = _modules()
    graph = {name: _imported_at_load(name, path, modules) for name, path in modules.items()}
    across = [ring for ring in _rings(graph) if len({_folder(m, modules) for m in ring}) > 1]
    assert not across, f"module-level imports that run in a ring across folders: {across}"


def test_the_check_sees_a_ring_across_folders() -> None:
    modules = {"a.x": Path("a/x.py"), "b.y": Path("b/y.py"), "a": Path("a/__init__.py")}
    graph = {"a.x": {"a", "b.y"}, "b.y": {"a.x"}, "a": {"a.x"}}
    assert [sorted(r) for r in _rings(graph)] == [["a", "a.x", "b.y"]]
    assert {_folder(m, modules) for m in ["a", "a.x", "b.y"]} == {Path("a"), Path("b")}
