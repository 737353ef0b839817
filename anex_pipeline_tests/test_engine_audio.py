"""Sounds reaching a real audio model: the tiny random Qwen2-Audio of tiny_models.py on vLLM.

As with images, the samples must reach the model: each row's ``prompt_tokens`` is the count the
model's own processor gives for its text and sounds, and at temperature 0 the same sound gives
the same answer (inline, again inline, by ``audio_url``, by an ``input_audio`` URL) while another
sound gives another. The tests share one engine for the model (the session's ``audio_model``).
"""

from __future__ import annotations

import base64
import io
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.jobs import answers, chat_row, run_job, text_of, write_jsonl
from anex_pipeline_tests.harness.media import WAV, MediaServer, image, image_for, media_metadata, tone_wav
from anex_pipeline_tests.harness.tiny_models import AUDIO_RATE, AUDIO_TOKEN, AUDIO_TOKENS

pytestmark = pytest.mark.engine

QUESTION = "What do you hear?"
LOW, HIGH = 250, 2000  # Hz


def audio_row(cid: str, *parts: dict[str, Any]) -> dict[str, Any]:
    return chat_row(cid, [{"type": "text", "text": QUESTION}, *parts])


def sound(data: bytes | str, fmt: str = "wav") -> dict[str, Any]:
    """An input_audio part: base64 of the bytes, or a URL as given."""
    value = base64.b64encode(data).decode("ascii") if isinstance(data, bytes) else data
    return {"type": "input_audio", "input_audio": {"data": value, "format": fmt}}


def samples(wav: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(wav)) as w:
        frames = w.readframes(w.getnframes())
    return np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768


def expected_prompt_tokens(model: Path, sounds: list[bytes]) -> tuple[int, int]:
    """The prompt length the model's own (Hugging Face) processor gives the question with these
    sounds, and how many of its tokens are audio tokens. vLLM's chat renderer puts one
    "Audio i: <|audio_bos|><|AUDIO|><|audio_eos|>" line per sound before the text, and the
    processor expands each audio token into the sound's tokens."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    lines = [f"Audio {i}: {''.join(AUDIO_TOKENS)}" for i in range(1, len(sounds) + 1)]
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "\n".join([*lines, QUESTION])}], add_generation_prompt=True, tokenize=False
    )
    audio = [samples(s) for s in sounds] or None
    ids = processor(text=prompt, audio=audio, sampling_rate=AUDIO_RATE)["input_ids"][0]
    audio_id = processor.tokenizer.convert_tokens_to_ids(AUDIO_TOKEN)
    return len(ids), sum(1 for t in ids if t == audio_id)


def test_sounds_inline_and_by_url_reach_the_model(
    tmp_path: Path, real_runner: JobRunner, audio_model: Path, media_server: MediaServer
) -> None:
    low, high = tone_wav(LOW), tone_wav(HIGH)
    low_url = media_server.url(f"/tone/{LOW}.wav")
    rows = [
        audio_row("low", sound(low)),
        audio_row("low-again", sound(low)),
        audio_row("low-audio-url", {"type": "audio_url", "audio_url": {"url": low_url}}),
        audio_row("low-input-audio-url", sound(low_url)),
        audio_row("high", sound(high)),
        audio_row("low-and-high", sound(low), sound(high)),
        audio_row("text"),
        audio_row("broken", sound(b"RIFF, but not a sound at all")),
        audio_row("not-base64", sound("this is not base64 !!")),
        audio_row("picture", image("data:image/png;base64," + base64.b64encode(image_for("/a")).decode())),
        audio_row("8khz", sound(WAV)),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    options = {
        "model": str(audio_model),
        "max_tokens": 16,
        "temperature": 0,
        "reuse_answers": False,  # identical rows must each be generated
        "media": {"allowed_hosts": [f"127.0.0.1:{media_server.port}"]},
    }

    report = run_job(real_runner, src, out, options)

    lines = answers(out)
    assert (report.request_counts.completed, report.request_counts.failed) == (7, 4)
    for cid, sounds in {"low": [low], "high": [high], "low-and-high": [low, high], "text": []}.items():
        total, audio_tokens = expected_prompt_tokens(audio_model, sounds)
        assert audio_tokens == 12 * len(sounds)  # 0.5 s: 50 mel frames, 25 after the convolution, 12 pooled
        assert lines[cid]["response"]["body"]["usage"]["prompt_tokens"] == total
    same = {text_of(lines[c]) for c in ("low", "low-again", "low-audio-url", "low-input-audio-url")}
    assert len(same) == 1
    assert len({text_of(lines[c]) for c in ("low", "high", "low-and-high", "text")}) == 4
    assert media_server.hits[f"/tone/{LOW}.wav"] == 1  # one download for both URL rows
    assert media_metadata(real_runner)["fetched"] == 1
    for cid in ("broken", "not-base64", "picture", "8khz"):
        error = lines[cid]["error"]
        assert lines[cid]["response"]["status_code"] == 400 and error["type"] == "invalid_request_error"
        assert error["param"] == "messages[0].content[1]", cid
    messages = {cid: lines[cid]["error"]["message"] for cid in ("broken", "not-base64", "picture", "8khz")}
    assert "input_audio data is not a readable sound (Format not recognised)" in messages["broken"]
    assert messages["not-base64"] == "the input_audio data is not valid base64"
    assert "reads audio but cannot read images" in messages["picture"]
    assert "sampled at 8000 Hz but the model reads 16000 Hz" in messages["8khz"]
