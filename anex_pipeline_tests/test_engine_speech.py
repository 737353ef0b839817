"""Transcription and translation jobs on a tiny random Whisper built offline: the in-process engine
against a real ``vllm serve`` of the same model, token for token at temperature 0, asked directly
at its ``/v1/audio/...`` endpoints and through the HTTP engine.

The model's text is noise, mostly timestamp tokens (which stay in the text): equal texts are equal
tokens. Every row caps its answer (``max_completion_tokens``), as Whisper's 448-token context
would otherwise make each piece of sound 444 tokens long."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from anex_pipeline.engine.config import EngineConfig
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.jobs import answers, local_instance, real_engine_resource, run_job, write_jsonl
from anex_pipeline_tests.harness.media import MediaServer, tone_wav
from anex_pipeline_tests.harness.tiny_models import build_tiny_whisper
from anex_pipeline_tests.harness.vllm_serve import START_TIMEOUT_S, Served, start_server, stop_group, wait_healthy

pytestmark = [pytest.mark.engine, pytest.mark.vllm_serve]

CAP = 8
SHORT = tone_wav(440, seconds=1.0)
LONG = tone_wav(330, seconds=35.0)  # past Whisper's 30 s window: split in two, as the server splits it
URLS = {"transcriptions": "/v1/audio/transcriptions", "translations": "/v1/audio/translations"}


def data_url(sound: bytes) -> str:
    return "data:audio/wav;base64," + base64.b64encode(sound).decode()


def rows_of(media: MediaServer) -> dict[str, list[tuple[str, bytes | None, dict[str, Any]]]]:
    """Each endpoint's rows: (id, the sound the server is sent, the row's body)."""
    fetched = media.url("/tone/660.wav")
    common = {"temperature": 0, "max_completion_tokens": CAP}
    return {
        "transcriptions": [
            ("inline", SHORT, {"file_url": data_url(SHORT), "language": "en", **common}),
            ("fetched", tone_wav(660), {"file_url": fetched, "language": "en", "response_format": "text", **common}),
            ("missing", None, {"file_url": media.url("/no-such.wav"), **common}),
            ("detected", SHORT, {"file_url": data_url(SHORT), **common}),  # the language detected first
            ("prompted", SHORT, {"file_url": data_url(SHORT), "language": "en", "prompt": "Hello world", **common}),
            (
                "verbose",
                SHORT,
                {"file_url": data_url(SHORT), "language": "en", "response_format": "verbose_json", **common},
            ),
            ("long", LONG, {"file_url": data_url(LONG), "language": "en", **common}),
        ],
        "translations": [
            ("inline", SHORT, {"file_url": data_url(SHORT), "language": "fr", **common}),
            ("fetched", tone_wav(660), {"file_url": fetched, "language": "fr", **common}),
            ("missing", None, {"file_url": media.url("/no-such.wav"), **common}),
        ],
    }


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_whisper(tmp_path_factory.mktemp("models") / "tiny-whisper")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, whisper: Path) -> Iterator[Served]:
    """``vllm serve`` of the Whisper, started now and awaited by the test, so it loads while the
    in-process engine does."""
    server = start_server(tmp_path_factory.mktemp("vllm-serve") / "server.log", model=str(whisper))
    try:
        yield server
    finally:
        stop_group(server.proc)


@pytest.fixture
def media(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[MediaServer]:
    monkeypatch.setenv("ANEX_MEDIA_CACHE_DIR", str(tmp_path / "media-cache"))
    server = MediaServer()
    yield server
    server.close()


def run_rows(engine: EngineConfig, folder: Path, model: Path, media: MediaServer) -> dict[str, dict[str, Any]]:
    """Both endpoints' rows as JSONL jobs on one engine: endpoint -> id -> output line."""
    folder.mkdir(parents=True, exist_ok=True)
    options = {"model": str(model), "media": {"allowed_hosts": [f"127.0.0.1:{media.port}"]}}
    got = {}
    with local_instance() as instance:
        runner = JobRunner(instance, StorageResource(work_root=str(folder / "work")), engine)
        try:
            for endpoint, rows in rows_of(media).items():
                lines = [{"custom_id": cid, "url": URLS[endpoint], "body": body} for cid, _, body in rows]
                src = write_jsonl(folder / f"{endpoint}.jsonl", lines)
                report = run_job(runner, src, folder / f"{endpoint}.out.jsonl", options)
                assert report.status == "completed" and report.request_counts.failed == 1, report.failure_reason
                got[endpoint] = answers(folder / f"{endpoint}.out.jsonl")
        finally:
            runner.close()
    return got


def served_answer(served: Served, endpoint: str, sound: bytes, body: dict[str, Any], model: Path) -> dict[str, Any]:
    """What the server answers the row's sound and fields, posted as its form takes them."""
    fields = {k: str(v) for k, v in body.items() if k != "file_url"}
    answer = httpx.post(
        f"{served.url}{URLS[endpoint]}",
        files={"file": ("sound.wav", sound, "audio/wav")},
        data={**fields, "model": str(model)},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_in_process_texts_match_vllm_serve_token_for_token(
    tmp_path: Path, whisper: Path, served: Served, media: MediaServer
) -> None:
    local = run_rows(real_engine_resource(), tmp_path / "local", whisper, media)
    for endpoint in URLS:
        missing = local[endpoint]["missing"]
        assert missing["error"]["type"] == "media_fetch_error" and missing["response"]["status_code"] == 404
    transcribed = local["transcriptions"]
    inline = transcribed["inline"]["response"]["body"]
    assert set(inline) == {"text", "usage"} and inline["usage"] == {"type": "duration", "seconds": 1}
    assert set(local["translations"]["inline"]["response"]["body"]) == {"text"}
    assert transcribed["long"]["response"]["body"]["usage"]["seconds"] == 35
    assert transcribed["verbose"]["response"]["body"]["language"] == "en"
    assert transcribed["inline"]["response"]["body"]["text"] != transcribed["fetched"]["response"]["body"]["text"]

    wait_healthy(served, time.monotonic() + START_TIMEOUT_S)
    for endpoint, rows in rows_of(media).items():
        for cid, sound, body in rows:
            if sound is None:
                continue
            theirs = served_answer(served, endpoint, sound, body, whisper)
            mine = local[endpoint][cid]["response"]["body"]
            if body.get("response_format") == "verbose_json":  # the logprobs' mean to float32's last digits
                for a, b in zip(mine.pop("segments"), theirs.pop("segments"), strict=True):
                    assert a.pop("avg_logprob") == pytest.approx(b.pop("avg_logprob"), abs=1e-3), cid
                    assert a == b, cid
            assert mine == theirs, (endpoint, cid)

    remote = run_rows(EngineConfig(base_url=served.url), tmp_path / "http", whisper, media)
    for endpoint in URLS:
        for cid, line in remote[endpoint].items():
            if cid != "verbose":  # compared above, segment by segment
                assert line["response"]["body"] == local[endpoint][cid]["response"]["body"], (endpoint, cid)
