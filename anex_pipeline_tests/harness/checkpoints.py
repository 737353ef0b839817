"""Rows for a shard checkpoint, written and read back in either of its two forms (JSON lines, or
Arrow for a Parquet job), for tests of who may write a checkpoint."""

from __future__ import annotations

from pathlib import Path

from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.formats import arrow_checkpoint, jsonl_checkpoint
from anex_pipeline.spec import RowOutcome
from anex_pipeline.testing import FakeEngine


def outcomes(indices: range, said: str) -> list[RowOutcome]:
    """The fake engine's answers to chat rows ``indices``, each prompt starting with ``said``."""
    asked = [
        EngineRequest(i, f"r{i}", f"req-{i}", "chat", {"messages": [{"role": "user", "content": f"{said} {i}"}]})
        for i in indices
    ]
    return FakeEngine().run(asked)


def append(path: Path, rows: list[RowOutcome], kind: str) -> None:
    if kind == "arrow":
        arrow_checkpoint.append(path, rows, "chat")
    else:
        jsonl_checkpoint.append_outcomes(path, rows)


def latest_answers(path: Path, kind: str) -> dict[int, str]:
    """Each row's answer text, as the checkpoint's reader gives it (the latest row written wins)."""
    if kind == "arrow":
        found: dict[int, str] = {}
        for table in arrow_checkpoint.latest(path, "chat"):
            found |= dict(zip(table.column("i").to_pylist(), table.column("value").to_pylist(), strict=True))
        return found
    return {i: o.body["choices"][0]["message"]["content"] for i, o in jsonl_checkpoint.read_outcomes(path).items()}
