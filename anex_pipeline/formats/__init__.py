"""Reading request files and writing result files, one module per file format.

Both readers yield the same two things, in input order: :class:`InputRow` for a row that passed
its checks, :class:`~anex_pipeline.spec.Problem` for one that did not. Both writers take row
outcomes in input order and write to a path the caller later renames into place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

FileFormat = Literal["jsonl", "parquet"]

PARQUET_MAGIC = b"PAR1"


@dataclass
class InputRow:
    """A request that passed its submit-time checks, normalised to an OpenAI request body."""

    index: int  # 0-based position in the input
    key: str  # the row identity: custom_id, the Parquet id column, or the row index
    body: dict[str, Any]


def sniff_format(path: Path) -> FileFormat | None:
    """Tells a Parquet file from anything else by its magic bytes; None for an empty file."""
    with path.open("rb") as f:
        head = f.read(4)
    if not head:
        return None
    return "parquet" if head == PARQUET_MAGIC else "jsonl"


def result_text(endpoint: str, body: dict[str, Any]) -> str:
    """The answer text of a completion body, or the whole body as JSON when it has no text."""
    import json

    choice = (body.get("choices") or [{}])[0]
    text = choice.get("text") if endpoint == "completions" else (choice.get("message") or {}).get("content")
    return text if isinstance(text, str) and text else json.dumps(body, ensure_ascii=False)
