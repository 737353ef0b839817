"""The environment is read in one place: no module outside ``settings.py`` (and ``engine/``, which
owns its variables) reads ``os.environ`` or calls ``os.getenv``, and every setting is read when
asked, so a variable set after the import counts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import anex_pipeline
from anex_pipeline import settings

ROOT = Path(anex_pipeline.__file__).parent
OWNERS = {ROOT / "settings.py", *(ROOT / "engine").rglob("*.py")}


def environment_reads(tree: ast.AST) -> list[int]:
    """Lines that read the environment: ``os.environ.get(...)``, ``os.getenv(...)``,
    ``os.environ[...]`` read (a write sets the process's environment for what it starts)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(f := node.func, ast.Attribute):
            if f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os":
                lines.append(node.lineno)
            if f.attr == "get" and ast.unparse(f.value) == "os.environ":
                lines.append(node.lineno)
        reads = isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
        if reads and ast.unparse(node.value) == "os.environ":
            lines.append(node.lineno)
    return lines


def test_only_settings_reads_the_environment() -> None:
    found = [
        f"{path.relative_to(ROOT.parent)}:{line}"
        for path in sorted(ROOT.rglob("*.py"))
        if path not in OWNERS
        for line in environment_reads(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not found, f"read these through anex_pipeline.settings: {found}"


def test_the_scan_sees_each_way_of_reading() -> None:
    code = "import os\na = os.environ.get('X')\nb = os.getenv('Y')\nc = os.environ['Z']\nos.environ['W'] = '1'\n"
    assert environment_reads(ast.parse(code)) == [2, 3, 4]


def test_a_setting_is_read_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANEX_RETRY_LIMIT", raising=False)
    assert settings.RETRY_LIMIT.get_int() == 3 and not settings.RETRY_LIMIT.is_set()
    monkeypatch.setenv("ANEX_RETRY_LIMIT", "9")
    assert settings.RETRY_LIMIT.get_int() == 9 and settings.RETRY_LIMIT.is_set()
