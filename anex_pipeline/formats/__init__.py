"""Reading request files and writing result files, one module per file format.

Each format module reads its input in chunks, in input order: a
:class:`~anex_pipeline.spec.Problem` for a row that failed its checks, or a run of consecutive
accepted rows in the form the job's shards store them (a list of JSON lines for JSONL, an Arrow
record batch for Parquet); it stages, splits and reads back its own shard files. Each writer
takes the stored outcomes (:class:`StoredOutcome`) in input order and writes to a path the
caller later renames into place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import msgspec

from anex_pipeline import responses
from anex_pipeline.spec import error_kind

FileFormat = Literal["jsonl", "parquet"]

PARQUET_MAGIC = b"PAR1"
JSON_NULL = msgspec.Raw(b"null")


class StoredUsage(msgspec.Struct, frozen=True):
    """The token counts of a row the report adds up."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_prompt_tokens: int = 0


class StoredOutcome(msgspec.Struct):
    """One checkpoint line of a finished row (``RowOutcome.to_record``), read without building
    the body: ``body`` stays the JSON text it was stored as."""

    i: int
    key: str
    status_code: int | None = None
    body: msgspec.Raw = JSON_NULL
    error: dict[str, Any] | None = None
    flag: str | None = None
    format_error: bool = False
    usage: StoredUsage = StoredUsage()
    reused: bool = False

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def error_type(self) -> str | None:
        """What a failed row counts as (:func:`~anex_pipeline.spec.error_kind`), else the
        completion's flag ("length", ...)."""
        if self.error is None:
            return self.flag
        return error_kind(self.error["type"], self.error.get("code"))


decode_stored_outcome = msgspec.json.Decoder(StoredOutcome).decode


def sniff_format(path: Path) -> FileFormat | None:
    """Tells a Parquet file from anything else by its magic bytes; None for an empty file."""
    with path.open("rb") as f:
        head = f.read(4)
    if not head:
        return None
    return "parquet" if head == PARQUET_MAGIC else "jsonl"


def write_error(exc: OSError, path: Path) -> OSError:
    """The same error about ``path``, the file the job meant to write (not a temp file)."""
    return OSError(exc.errno, exc.strerror or str(exc), str(path))


def finish_reason_of(endpoint: str, body: dict[str, Any] | None) -> str | None:
    """Why a completion body's answer ended (``stop``, ``length``, ``tool_calls``); None for an
    embedding or a row without a body."""
    if body is None or endpoint == "embeddings":
        return None
    if endpoint == "responses":
        return responses.finish_reason(body)
    return (body.get("choices") or [{}])[0].get("finish_reason")


def text_of(endpoint: str, body: dict[str, Any]) -> str:
    """The answer text of a completion body, or the whole body as JSON when it has no text."""
    choice = (body.get("choices") or [{}])[0]
    if endpoint == "responses":
        text = responses.output_text(body)
    else:
        text = choice.get("text") if endpoint == "completions" else (choice.get("message") or {}).get("content")
    return text if isinstance(text, str) and text else json.dumps(body, ensure_ascii=False)
