"""A Parquet job's image_column: URL strings or image bytes become the rows' image parts (fake
engine; test_engine_vision.py runs the same on a real vision model)."""

from __future__ import annotations

import base64
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anex_pipeline.formats.images import image_part, image_type
from anex_pipeline.formats.parquet_input import request_body
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobOptions
from anex_pipeline.stages.submit import prepare_job
from anex_pipeline_tests.harness.media import MediaServer, png_bytes

PNG = png_bytes(5)


@pytest.mark.parametrize(
    ("data", "mime"),
    [
        (PNG, "image/png"),
        (b"\xff\xd8\xff\xe0" + b"\0" * 16, "image/jpeg"),
        (b"GIF89a" + b"\0" * 16, "image/gif"),
        (b"RIFF\x10\0\0\0WEBPVP8 ", "image/webp"),
        (b"BM" + b"\0" * 16, "image/bmp"),
        (b"%PDF-1.7", None),
        (b"", None),
    ],
)
def test_image_types_are_known_by_their_first_bytes(data: bytes, mime: str | None) -> None:
    assert image_type(data) == mime


def test_bytes_become_a_data_url_and_strings_stay_urls() -> None:
    assert image_part(PNG) == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()},
    }
    assert image_part("https://images.example/a.png")["image_url"] == {"url": "https://images.example/a.png"}
    with pytest.raises(ValueError, match="not a PNG, JPEG"):
        image_part(b"plain text")


def test_the_image_follows_the_prompt_in_the_last_message() -> None:
    options = JobOptions(image_column="picture", system_prompt="Be brief.")
    url = "https://images.example/a.png"
    part = {"type": "image_url", "image_url": {"url": url}}

    assert request_body("What is it?", "chat", options, url) == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is it?"}, part]},
        ]
    }
    conversation = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}]},
    ]
    body = request_body(conversation, "chat", JobOptions(image_column="picture"), url)
    assert body["messages"][:2] == conversation[:2]
    assert body["messages"][2]["content"] == [{"type": "text", "text": "And this?"}, part]
    assert request_body("What is it?", "chat", options, None)["messages"][1] == {
        "role": "user",
        "content": "What is it?",
    }


def test_a_parquet_job_fetches_its_image_column_urls_once(
    tmp_path: Path, fake_runner: JobRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANEX_MEDIA_CACHE_DIR", str(tmp_path / "media-cache"))
    server = MediaServer()
    try:
        pictures = [server.url("/img/a.png"), server.url("/img/b.png"), None, server.url("/img/a.png")]
        src = tmp_path / "in.parquet"
        pq.write_table(pa.table({"prompt": [f"question {i}" for i in range(4)], "picture": pictures}), src)
        options = {"image_column": "picture", "max_tokens": 8, "media": {"allowed_hosts": ["127.0.0.1"]}}
        job = prepare_job(src, str(tmp_path / "peek.parquet"), JobOptions.model_validate(options), tmp_path / "peek")
        bodies = [row.body for row in job.read_requests(0)]

        report = fake_runner.run(fake_runner.submit(str(src), str(tmp_path / "out.parquet"), options))
    finally:
        server.close()

    contents = [body["messages"][0]["content"] for body in bodies]
    assert contents[2] == "question 2"  # a null cell: a text-only row
    assert [contents[i][1]["image_url"]["url"] for i in (0, 1, 3)] == [pictures[0], pictures[1], pictures[3]]
    assert report.request_counts.completed == 4
    assert server.hits["/img/a.png"] == server.hits["/img/b.png"] == 1
    result = pq.read_table(tmp_path / "out.parquet").to_pydict()
    assert result["picture"] == pictures and all(result["output"])
