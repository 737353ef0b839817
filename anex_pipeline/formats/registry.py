"""The file formats by name: every place that handles a format by its name looks it up here."""

from __future__ import annotations

from types import ModuleType

from anex_pipeline.formats import FileFormat, jsonl, parquet

FORMATS: dict[FileFormat, ModuleType] = {"jsonl": jsonl, "parquet": parquet}
