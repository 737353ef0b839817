"""Transcription and translation rows: their checks at submit, their sounds through the media
stage (a data: URL, a loopback server, a URL that 404s), the Parquet sound column and the HTTP
engine's form, on the fake engine (the real engine and ``vllm serve`` are in
test_engine_speech.py)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.engine.http.engine import ENDPOINT_PATHS, request_body, speech_form
from anex_pipeline.formats.sounds import sound_type
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobRejected
from anex_pipeline.validate import check_body
from anex_pipeline_tests.harness.jobs import answers, write_jsonl
from anex_pipeline_tests.harness.media import MediaServer, tone_wav
from anex_pipeline_tests.harness.tiny_models import write_config

SOUND = tone_wav(440)
DATA_URL = "data:audio/wav;base64," + base64.b64encode(SOUND).decode()
URLS = {"transcriptions": "/v1/audio/transcriptions", "translations": "/v1/audio/translations"}


def sound_row(cid: str, endpoint: str, file_url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": URLS[endpoint], "body": {"file_url": file_url, **body}}


@pytest.fixture
def server() -> Iterator[MediaServer]:
    s = MediaServer()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def media_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "media-cache"
    monkeypatch.setenv("ANEX_MEDIA_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def model(tmp_path: Path) -> str:
    return str(write_config(tmp_path / "whisper", architectures=["WhisperForConditionalGeneration"]))


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"file": "x"}, "body.file", "give the sound as file_url"),
        ({}, "body.file_url", "got nothing"),
        ({"file_url": "file:///etc/passwd"}, "body.file_url", "only http and https"),
        ({"file_url": DATA_URL, "response_format": "srt"}, "body.response_format", "json, text, verbose_json"),
        ({"file_url": DATA_URL, "prompt": 3}, "body.prompt", "must be a string"),
        ({"file_url": DATA_URL, "temperature": 3}, "body.temperature", "at most 2"),
        ({"file_url": DATA_URL, "messages": []}, "body.messages", "only of chat"),
        ({"file_url": DATA_URL, "timestamp_granularities[]": ["page"]}, "body.timestamp_granularities[]", "segment"),
    ],
)
def test_transcription_row_problems_name_their_field(body: dict[str, Any], field: str, words: str) -> None:
    found = [(p.field, p.message) for p in check_body(body, "transcriptions", frozenset({"w"}))]
    assert field in [f for f, _ in found], found
    assert any(words in m for f, m in found if f == field), found


def test_a_translation_takes_no_timestamp_granularities() -> None:
    found = check_body({"file_url": DATA_URL, "timestamp_granularities[]": ["segment"]}, "translations", frozenset())
    assert [p.field for p in found] == ["body.timestamp_granularities[]"]


@pytest.mark.parametrize("endpoint", ["transcriptions", "translations"])
def test_sounds_by_data_url_and_by_loopback_url_are_answered_and_a_404_is_a_media_error(
    tmp_path: Path, fake_runner: JobRunner, server: MediaServer, model: str, endpoint: str
) -> None:
    rows = [
        sound_row("inline", endpoint, DATA_URL, language="en"),
        sound_row("fetched", endpoint, server.url("/tone/440.wav"), response_format="text"),
        sound_row("missing", endpoint, server.url("/no-such.wav")),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    options = {"model": model, "media": {"allowed_hosts": [f"127.0.0.1:{server.port}"]}}
    report = fake_runner.run(fake_runner.submit(str(src), str(tmp_path / "out.jsonl"), options))
    assert report.status == "completed" and report.request_counts.completed == 2
    assert report.estimate.method.startswith("not needed")
    got = answers(tmp_path / "out.jsonl")
    assert got["inline"]["response"]["body"]["text"] == got["fetched"]["response"]["body"]["text"]  # the same sound
    assert ("usage" in got["inline"]["response"]["body"]) == (endpoint == "transcriptions")
    missing = got["missing"]
    assert missing["error"]["type"] == "media_fetch_error" and missing["error"]["param"] == "file_url"
    assert missing["response"]["status_code"] == 404
    assert server.hits["/tone/440.wav"] == 1


def test_a_parquet_sound_column_of_urls_and_bytes_gives_a_text_column(
    tmp_path: Path, fake_runner: JobRunner, server: MediaServer, model: str
) -> None:
    options = {"model": model, "endpoint": "transcriptions", "media": {"allowed_hosts": [f"127.0.0.1:{server.port}"]}}
    urls = tmp_path / "urls.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "file_url": [DATA_URL, server.url("/tone/440.wav")]}), urls)
    report = fake_runner.run(fake_runner.submit(str(urls), str(tmp_path / "out.parquet"), options))
    assert report.status == "completed" and report.request_counts.completed == 2
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column_names[:3] == ["id", "file_url", "text"]
    texts = table.column("text").to_pylist()
    assert texts[0] == texts[1] and texts[0].startswith("a sound of")

    raw = tmp_path / "raw.parquet"  # a column of the sounds' bytes
    pq.write_table(pa.table({"audio": pa.array([SOUND], pa.binary())}), raw)
    fake_runner.run(fake_runner.submit(str(raw), str(tmp_path / "raw.out.parquet"), options))
    assert pq.read_table(tmp_path / "raw.out.parquet").column("text").to_pylist() == texts[:1]
    assert sound_type(SOUND) == "audio/wav"

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"audio": pa.array([SOUND, b"no sound"], pa.binary())}), bad)
    with pytest.raises(JobRejected) as caught:
        fake_runner.submit(str(bad), str(tmp_path / "bad.out.parquet"), options)
    [problem] = caught.value.problems
    assert (problem.line, problem.field) == (2, "audio") and "not a WAV, FLAC, OGG or MP3" in problem.message


def test_the_http_engine_posts_the_sound_as_a_form_file() -> None:
    req = EngineRequest(
        index=0,
        key="k",
        request_id="r",
        endpoint="transcriptions",
        body={"file_url": DATA_URL, "language": "en", "timestamp_granularities[]": ["segment"]},
        sampling={"temperature": 0.0},
    )
    body = request_body(req, "whisper")
    assert body["model"] == "whisper" and body["temperature"] == 0.0
    form = speech_form(body)
    _, data, mime = form["files"]["file"]
    assert data == SOUND and mime == "audio/wav"
    assert form["data"]["language"] == "en" and form["data"]["timestamp_granularities[]"] == ["segment"]
    assert "file_url" not in form["data"]
    assert ENDPOINT_PATHS["translations"] == "/v1/audio/translations"


def test_inline_media_larger_than_max_bytes_fail_their_row_before_decoding(
    tmp_path: Path, fake_runner: JobRunner, model: str
) -> None:
    """media.max_bytes bounds a data: URL as it bounds a download: a sound, or an image part."""
    small = "data:audio/wav;base64," + base64.b64encode(SOUND[:800]).decode()
    rows = [sound_row("big", "transcriptions", DATA_URL), sound_row("small", "transcriptions", small)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report = fake_runner.run(
        fake_runner.submit(str(src), str(tmp_path / "out.jsonl"), {"model": model, "media": {"max_bytes": 4000}})
    )
    got = answers(tmp_path / "out.jsonl")
    assert report.request_counts.completed == 1 and got["small"]["error"] is None
    big = got["big"]
    assert big["error"]["type"] == "media_fetch_error" and big["error"]["param"] == "file_url"
    assert big["response"]["status_code"] == 413 and "more than media.max_bytes=4000" in big["error"]["message"]
    assert len(big["error"]["message"]) < 200  # the data itself is not repeated in the message

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 8000}}
    chat = [{"custom_id": "img", "body": {"messages": [{"role": "user", "content": [image]}]}}]
    src = write_jsonl(tmp_path / "chat.jsonl", chat)
    fake_runner.run(fake_runner.submit(str(src), str(tmp_path / "chat.out.jsonl"), {"media": {"max_bytes": 4000}}))
    [line] = answers(tmp_path / "chat.out.jsonl").values()
    assert line["error"]["param"] == "messages[0].content[0]" and line["response"]["status_code"] == 413


def test_a_sound_longer_than_max_audio_seconds_fails_its_row(
    tmp_path: Path, fake_runner: JobRunner, server: MediaServer, model: str
) -> None:
    long = "data:audio/wav;base64," + base64.b64encode(tone_wav(440, seconds=3.0)).decode()
    rows = [
        sound_row("long", "transcriptions", long),
        sound_row("long-fetched", "transcriptions", server.url("/tone/440.wav")),  # 0.5 s: fits
        sound_row("short", "transcriptions", DATA_URL),
    ]
    media = {"allowed_hosts": [f"127.0.0.1:{server.port}"], "max_audio_seconds": 2}
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report = fake_runner.run(
        fake_runner.submit(str(src), str(tmp_path / "out.jsonl"), {"model": model, "media": media})
    )
    got = answers(tmp_path / "out.jsonl")
    assert report.request_counts.completed == 2
    error = got["long"]["error"]
    assert (
        error["type"] == "media_fetch_error" and "3.0 s long, more than media.max_audio_seconds=2" in error["message"]
    )
    assert got["long"]["response"]["status_code"] == 413 and len(error["message"]) < 200
