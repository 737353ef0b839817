"""Checking a sound before a model reads it, so that a row with bad audio gets a clear reason.

vLLM decodes audio with the first of torchcodec, soundfile and PyAV it finds; this project ships
soundfile. Data that soundfile cannot open would otherwise reach vLLM's PyAV fallback, whose
error, when PyAV is absent, names a missing package rather than the row's data. And vLLM brings
a sound to its model's sampling rate with torchaudio: where that is absent (the CPU build), a
sound at another rate cannot be read at all.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any


def sound_bytes(kind: str, value: Any) -> bytes:
    """The encoded sound of an ``input_audio`` part's object or an ``audio_url`` part's object
    (whose URL the media stage has made a ``data:`` URL). Raises ValueError saying what is wrong."""
    if not isinstance(value, dict):
        raise ValueError(f"the {kind} part must hold an object")
    if kind == "input_audio":
        data = value.get("data")
        if not isinstance(data, str):
            raise ValueError("input_audio.data must be a base64 string")
    else:
        url = value.get("url")
        if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
            raise ValueError("audio_url.url must be an http(s) URL or a base64 data: URL")
        data = url.split(";base64,", 1)[1]
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"the {kind} data is not valid base64") from None


def sound_seconds(data: bytes) -> float | None:
    """A sound's length in seconds, read from its header; None when soundfile cannot read it."""
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(data))
    except (RuntimeError, ValueError, soundfile.SoundFileError):
        return None
    return info.frames / info.samplerate if info.samplerate else None


def audio_problem(kind: str, value: Any, rate: int | None) -> str | None:
    """Why the sound of a part cannot be read, or None. ``rate`` is the only sampling rate
    accepted (None: any, the engine resamples)."""
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(sound_bytes(kind, value)))
    except ValueError as exc:
        return str(exc)
    except soundfile.SoundFileError as exc:
        reason = getattr(exc, "error_string", "") or str(exc)
        return f"the {kind} data is not a readable sound ({reason.rstrip('.')}); send WAV, FLAC, OGG or MP3"
    if info.frames == 0:
        return f"the {kind} sound is empty"
    if rate is not None and info.samplerate != rate:
        return (
            f"the {kind} sound is sampled at {info.samplerate} Hz but the model reads {rate} Hz and this "
            f"engine cannot resample (torchaudio is not installed); resample the sound to {rate} Hz"
        )
    return None
