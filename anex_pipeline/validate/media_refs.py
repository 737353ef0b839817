"""Finding the media a request body references: which content parts hold media and where."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# Content part type -> (key of the reference inside the part's object, the kind of media it holds).
MEDIA_PARTS = {
    "image_url": ("url", "image"),
    "audio_url": ("url", "audio"),
    "video_url": ("url", "video"),
    "input_audio": ("data", "audio"),
}


# Request body fields that hold media by URL -> the kind of media (a transcription row's sound).
MEDIA_FIELDS = {"file_url": "audio"}

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
INLINE_SCHEME = "data:"  # media carried in the request itself
FETCHED_SCHEMES = ("http", "https")  # the only URLs the media stage downloads


def fetch_problem(url: str) -> str | None:
    """Why the media stage would not download ``url`` for its scheme or a missing host (the stage's
    address policy comes on top), or None."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError as exc:  # an unclosed IPv6 bracket, a port that is no number
        return f"the URL is malformed ({exc})"
    if parts.scheme.lower() not in FETCHED_SCHEMES:
        scheme = f"{parts.scheme}: URLs" if parts.scheme else "a URL without a scheme"
        return f"only http and https URLs are fetched, not {scheme}"
    if not host:
        return "the URL names no host"
    return None


def reference_problem(url: str) -> str | None:
    """Why a row's media URL can never be used (checked at submit), or None: inline ``data:`` URLs
    and http(s) URLs that name a host pass."""
    if url.startswith(INLINE_SCHEME):
        return None
    why = fetch_problem(url)
    return f"{why}; give the media as an http(s) URL or inline as a data: URL" if why else None


@dataclass(frozen=True)
class MediaRef:
    """One content part that holds media: where it is in the messages, and its URL."""

    message: int  # -1 for a body field's media (MEDIA_FIELDS)
    part: int
    type: str  # the content part type, a key of MEDIA_PARTS, or the body field, a key of MEDIA_FIELDS
    url: str

    @property
    def kind(self) -> str:
        return MEDIA_FIELDS[self.type] if self.type in MEDIA_FIELDS else MEDIA_PARTS[self.type][1]

    @property
    def param(self) -> str:
        return self.type if self.type in MEDIA_FIELDS else f"messages[{self.message}].content[{self.part}]"

    @property
    def remote(self) -> bool:
        """Anything but an inline data: URL has to be fetched (or is refused)."""
        return not self.url.startswith(INLINE_SCHEME)


def media_references(body: dict[str, Any]) -> list[MediaRef]:
    """Every media reference in a chat body's content parts, and a transcription body's file_url."""
    refs = [MediaRef(-1, -1, name, body[name]) for name in MEDIA_FIELDS if isinstance(body.get(name), str)]
    for m, message in enumerate(body.get("messages") or []):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            url = part_reference(part)
            if url is not None:
                refs.append(MediaRef(m, p, part["type"], url))
    return refs


def part_reference(part: Any) -> str | None:
    """The media URL a content part holds, or None. ``input_audio`` parts normally carry raw
    base64 (no reference); they count when their ``data`` is a URL."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in MEDIA_PARTS:
        return None
    value = part.get(kind)
    if isinstance(value, dict):
        value = value.get(MEDIA_PARTS[kind][0])
    if isinstance(value, str) and (kind != "input_audio" or _SCHEME.match(value)):
        return value
    return None
