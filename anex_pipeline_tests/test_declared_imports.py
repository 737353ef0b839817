"""Every third-party package the project imports is declared in pyproject.toml (scripts/check_imports.sh
goes further: a clean venv with only the declared packages imports every module)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib

from anex_pipeline_tests.harness.jobs import REPO


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        specs += extra
    return {_normalized(re.split(r"[\[=<>!~; ]", spec, maxsplit=1)[0]) for spec in specs}


def _imported() -> dict[str, str]:
    """Top-level module -> a file importing it, for every import outside the standard library."""
    found: dict[str, str] = {}
    for path in sorted((REPO / "anex_pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in (name.split(".")[0] for name in names):
                if top not in sys.stdlib_module_names and top != "anex_pipeline":
                    found.setdefault(top, str(path.relative_to(REPO)))
    return found


def test_every_third_party_import_is_declared() -> None:
    declared = _declared()
    distributions = importlib.metadata.packages_distributions()
    imported = _imported()
    assert {"dagster", "pyarrow", "httpx", "vllm"} <= set(imported), "the scan found the project's imports"
    missing = {
        module: where
        for module, where in imported.items()
        if not {_normalized(d) for d in distributions.get(module, [module])} & declared
    }
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
