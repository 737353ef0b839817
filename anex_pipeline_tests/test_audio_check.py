"""The check a sound gets before an audio model reads it (no engine: soundfile on real bytes)."""

from __future__ import annotations

import base64

import pytest

from anex_pipeline.media.audio import audio_problem, sound_bytes
from anex_pipeline_tests.harness.media import WAV, tone_wav


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def test_a_readable_sound_passes_inline_or_as_a_data_url() -> None:
    tone = tone_wav(440)
    assert audio_problem("input_audio", {"data": b64(tone), "format": "wav"}, 16000) is None
    assert audio_problem("audio_url", {"url": "data:audio/wav;base64," + b64(tone)}, 16000) is None
    assert audio_problem("input_audio", {"data": b64(WAV)}, None) is None  # any rate when the engine resamples
    assert sound_bytes("audio_url", {"url": "data:audio/wav;base64," + b64(tone)}) == tone


@pytest.mark.parametrize(
    ("kind", "value", "reason"),
    [
        ("input_audio", {"data": b64(b"RIFF but no sound")}, "not a readable sound (Format not recognised)"),
        ("input_audio", {"data": "not base64 !"}, "the input_audio data is not valid base64"),
        ("input_audio", {"format": "wav"}, "input_audio.data must be a base64 string"),
        ("input_audio", "abc", "the input_audio part must hold an object"),
        ("audio_url", {"url": "https://example.com/a.wav"}, "audio_url.url must be an http(s) URL or a base64 data:"),
        ("input_audio", {"data": b64(tone_wav(440, seconds=0))}, "the input_audio sound is empty"),
        ("input_audio", {"data": b64(WAV)}, "sampled at 8000 Hz but the model reads 16000 Hz"),
    ],
)
def test_an_unreadable_sound_says_why(kind: str, value: object, reason: str) -> None:
    problem = audio_problem(kind, value, 16000)
    assert problem is not None and reason in problem
