"""A Parquet job's sound column (for transcription and translation jobs): each value a sound's URL,
or its encoded bytes, which become a ``data:`` URL."""

from __future__ import annotations

import base64

from anex_pipeline.validate.media_refs import reference_problem

# The first bytes of the encoded sounds the engine reads -> their media type.
_MAGIC = ((b"RIFF", "audio/wav"), (b"fLaC", "audio/flac"), (b"OggS", "audio/ogg"), (b"ID3", "audio/mpeg"))


def sound_type(data: bytes) -> str | None:
    """The media type of encoded sound bytes (WAV, FLAC, OGG or MP3), or None."""
    for magic, mime in _MAGIC:
        if data.startswith(magic) and (magic != b"RIFF" or data[8:12] == b"WAVE"):
            return mime
    return "audio/mpeg" if data[:2] in (b"\xff\xfb", b"\xff\xf3", b"\xff\xf2") else None


def sound_url(value: str | bytes) -> str:
    """A row's ``file_url``: a string is the URL itself (fetched by the media stage, or inline as
    ``data:``); bytes become a ``data:`` URL. Raises ValueError for a URL that can never be used
    and for bytes of no sound type."""
    if isinstance(value, str):
        if (why := reference_problem(value)) is not None:
            raise ValueError(why)
        return value
    mime = sound_type(value)
    if mime is None:
        raise ValueError("holds bytes that are not a WAV, FLAC, OGG or MP3 sound")
    return f"data:{mime};base64,{base64.b64encode(value).decode('ascii')}"
