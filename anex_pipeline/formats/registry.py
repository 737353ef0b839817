"""The file formats by name: every place that handles a format looks it up here. A new format
is a :class:`~anex_pipeline.formats.base.Format` and one line below."""

from __future__ import annotations

from pathlib import Path

from anex_pipeline.formats.base import Format
from anex_pipeline.formats.jsonl import JsonlFormat
from anex_pipeline.formats.parquet import ParquetFormat

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        JsonlFormat(),
        ParquetFormat(),
    )
}
# The format of a file whose first bytes are no format's magic.
_FALLBACK = next(f for f in FORMATS.values() if f.magic is None)


def sniff(path: Path) -> Format | None:
    """The format a file's first bytes show; None for an empty file."""
    size = max(len(f.magic or b"") for f in FORMATS.values())
    with path.open("rb") as f:
        head = f.read(size)
    if not head:
        return None
    return next((f for f in FORMATS.values() if f.magic and head.startswith(f.magic)), _FALLBACK)


def misnamed(path: Path, found: Format) -> str | None:
    """Why a file's name contradicts the format its bytes show, or None."""
    for named in FORMATS.values():
        if named.magic and named is not found and path.suffix.lower() == named.suffix:
            magic = named.magic.decode("ascii")
            return (
                f"{path.name} is named {named.suffix} but is not a {named.title} file (no {magic} header); "
                f"is it {found.title}?"
            )
    return None
