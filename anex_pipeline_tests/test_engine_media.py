"""Media on the real engine: the embedded model reads text only, so a row with an image fails alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai.types.chat import ChatCompletion

from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.jobs import chat_row, read_jsonl, run_job, write_jsonl
from anex_pipeline_tests.harness.media import MediaServer, image, media_row

pytestmark = pytest.mark.engine


def test_image_row_fails_alone_on_a_text_only_model(
    tmp_path: Path, real_runner: JobRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANEX_MEDIA_CACHE_DIR", str(tmp_path / "media-cache"))
    server = MediaServer()
    try:
        rows = [chat_row(f"text-{i}", f"Name a colour, number {i}.", temperature=0) for i in range(3)]
        rows.insert(1, media_row("picture", image(server.url("/img/cat.png"))))
        src = write_jsonl(tmp_path / "in.jsonl", rows)
        out = tmp_path / "out.jsonl"
        options = {"max_tokens": 8, "media": {"allowed_hosts": [f"127.0.0.1:{server.port}"]}}

        report = run_job(real_runner, src, out, options)
    finally:
        server.close()

    assert server.hits["/img/cat.png"] == 1  # fetched by the media stage; the engine got the bytes
    picture = read_jsonl(out)[1]
    assert picture["custom_id"] == "picture"
    assert picture["response"]["status_code"] == 400 and picture["response"]["body"] is None
    error = picture["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages[0].content[1]"
    assert "takes text only and cannot read images" in error["message"]
    for line in read_jsonl(out):
        if line["custom_id"] != "picture":
            assert line["error"] is None
            ChatCompletion.model_validate(line["response"]["body"])
    assert report.status == "completed"
    assert (report.request_counts.completed, report.request_counts.failed) == (3, 1)
