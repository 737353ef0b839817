"""The file formats by name: every place that handles a format by its name looks it up here."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from anex_pipeline.formats import FileFormat, jsonl, parquet

FORMATS: dict[FileFormat, ModuleType] = {"jsonl": jsonl, "parquet": parquet}


def misnamed(path: Path, kind: FileFormat) -> str | None:
    """Why a file's name contradicts the format its bytes show, or None."""
    if path.suffix.lower() == ".parquet" and kind != "parquet":
        return f"{path.name} is named .parquet but is not a Parquet file (no PAR1 header); is it JSONL?"
    return None
