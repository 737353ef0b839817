"""An image given as a table cell (a URL, or the image file's bytes) as a chat content part."""

from __future__ import annotations

import base64
from typing import Any

from anex_pipeline.validate.media_refs import reference_problem

# The first bytes of each image format vLLM's image loader (Pillow) reads, and its media type.
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)


def image_type(data: bytes) -> str | None:
    """The media type of an image file's bytes, or None when they are none of the known formats."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((mime for magic, mime in _SIGNATURES if data.startswith(magic)), None)


def image_part(value: str | bytes) -> dict[str, Any]:
    """An ``image_url`` content part: a string is the URL itself (fetched by the media stage, or
    inline as ``data:``); bytes become a ``data:`` URL. Raises ValueError for a URL that can never
    be used (see :func:`~anex_pipeline.validate.media_refs.reference_problem`) and for bytes of no image type."""
    if isinstance(value, str):
        if (why := reference_problem(value)) is not None:
            raise ValueError(why)
        return {"type": "image_url", "image_url": {"url": value}}
    mime = image_type(value)
    if mime is None:
        raise ValueError("holds bytes that are not a PNG, JPEG, GIF, BMP or WebP image")
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(value).decode('ascii')}"}}
