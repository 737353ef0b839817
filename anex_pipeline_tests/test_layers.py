"""The package's layers hold: no module imports one of a higher layer, at module level or inside a
function (the imports a function makes late to stay fast to start are arrows all the same).

The layers, lowest first, are data below; ``docs/architecture.md`` describes the same order. A
module belongs to the layer of the longest prefix that names it. An import within one layer is
fine. The arrows that run up today are listed in ``KNOWN_UPWARD``, each with the change that
removes it; an arrow that is not listed fails, and so does a listed one that no longer exists, so
the list only shrinks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import anex_pipeline

PACKAGE = "anex_pipeline"

LAYERS: Sequence[tuple[str, Sequence[str]]] = (
    ("leaf", ("errors", "settings", "paths", "request_fields")),
    # media.refs (what counts as a media reference) imports nothing of the package; the row checks use it
    ("core", ("spec", "responses", "validate", "metrics", "console", "media.refs")),
    # storage and stopping know a job's work folder
    (
        "formats, work folders, media, net, records",
        ("formats", "workdir", "media", "net", "batches", "storage", "stopping"),
    ),
    ("engine", ("engine",)),
    # options checks parser names against the engine's parsers
    ("stages, and the options a job is submitted with", ("stages", "options")),
    ("orchestration", ("orchestration", "instance", "job_admin")),
    ("runner", ("runner",)),
    ("applications, and the fakes shipped for tests of them", ("cli", "batch_api", "testing")),
)

# importer -> imported, for the arrows that run up the layers today, and the change that removes
# each. Empty this as those changes land.
KNOWN_UPWARD: Mapping[tuple[str, str], str] = {
    ("anex_pipeline.formats.jsonl_input", "anex_pipeline.engine.models"): "none yet: Matryoshka lengths below engine/",
}


def layer_of(module: str, layers: Sequence[tuple[str, Sequence[str]]], package: str) -> int | None:
    """The index of the layer holding ``module``, by the longest matching prefix; None for the
    package itself."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            name = f"{package}.{prefix}"
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[0]):
                best = (len(name), index)
    return None if best is None else best[1]


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under ``root``, by its dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = (package, *path.relative_to(root).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, known: Mapping[str, Path], package: str) -> Iterator[str]:
    """The package's modules that ``name`` imports anywhere in its file (``from x import y`` names
    module ``x.y`` when that is a module, else ``x``)."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == package)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            if source.split(".")[0] != package:
                continue
            for alias in node.names:
                yield full if (full := f"{source}.{alias.name}") in known else source


def upward_imports(
    root: Path, package: str, layers: Sequence[tuple[str, Sequence[str]]]
) -> tuple[set[tuple[str, str]], list[str]]:
    """Every import that runs from a lower layer up to a higher one, and the modules no layer holds."""
    known = modules(root, package)
    unplaced = [m for m in known if m != package and layer_of(m, layers, package) is None]
    upward = set()
    for name, path in known.items():
        low = layer_of(name, layers, package)
        for target in imports_of(name, path, known, package):
            high = layer_of(target, layers, package)
            if low is not None and high is not None and high > low:
                upward.add((name, target))
    return upward, unplaced


def test_no_import_runs_up_the_layers() -> None:
    upward, unplaced = upward_imports(Path(anex_pipeline.__file__).parent, PACKAGE, LAYERS)
    assert not unplaced, f"put these modules into a layer of LAYERS: {unplaced}"
    new = sorted(upward - set(KNOWN_UPWARD))
    assert not new, "imports that run up the layers (importer -> imported): " + "; ".join(f"{a} -> {b}" for a, b in new)
    gone = sorted(set(KNOWN_UPWARD) - upward)
    assert not gone, f"no longer imported, take them out of KNOWN_UPWARD: {gone}"


def test_the_checker_catches_a_planted_upward_import(tmp_path: Path) -> None:
    root = tmp_path / "planted"
    (root / "low").mkdir(parents=True)
    (root / "high").mkdir()
    (root / "__init__.py").write_text("")
    (root / "low" / "__init__.py").write_text("")
    (root / "high" / "__init__.py").write_text("from planted.low import base\n")
    (root / "low" / "base.py").write_text("def f():\n    from ..high import top\n    return top\n")
    (root / "high" / "top.py").write_text("from planted.low.base import f\n")
    (root / "loose.py").write_text("")
    layers = (("low", ("low",)), ("high", ("high",)))
    upward, unplaced = upward_imports(root, "planted", layers)
    assert upward == {("planted.low.base", "planted.high.top")}
    assert unplaced == ["planted.loose"]
