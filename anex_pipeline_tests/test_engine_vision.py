"""Images reaching a real multimodal model: the tiny random Idefics3 of tiny_models.py on vLLM.

The pixels must reach the model, not just the request: each row's ``prompt_tokens`` is the count
the model's own processor gives for its text and images, and at temperature 0 the same image
gives the same answer (by URL, again by URL, inline) while another image gives another.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from openai.types.chat import ChatCompletion

from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.conftest import read_jsonl, run_job, write_jsonl
from anex_pipeline_tests.test_media import MediaServer, image, image_for
from anex_pipeline_tests.tiny_models import IMAGE_TOKEN, VISION_IMAGE_TOKENS

pytestmark = pytest.mark.engine

QUESTION = "What is in the picture?"


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("ANEX_MEDIA_CACHE_DIR", str(tmp_path / "media-cache"))
    s = MediaServer()
    yield s
    s.close()


def vision_row(cid: str, *parts: dict[str, Any]) -> dict[str, Any]:
    content = [{"type": "text", "text": QUESTION}, *parts]
    return {
        "custom_id": cid,
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": content}]},
    }


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def vision_options(model: Path, server: MediaServer, **more: Any) -> dict[str, Any]:
    # reuse_answers off: identical rows must each be generated, or "same image, same answer"
    # would only show that the answer book deduplicates them.
    return {
        "model": str(model),
        "max_tokens": 16,
        "temperature": 0,
        "reuse_answers": False,
        "media": {"allowed_hosts": [f"127.0.0.1:{server.port}"]},
        **more,
    }


def expected_prompt_tokens(model: Path, paths: list[str]) -> int:
    """The prompt length the model's own (Hugging Face) processor gives a question with these
    images: vLLM's chat renderer puts one placeholder per image before the text, and the
    processor expands each into the image's tokens."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    content = "\n".join([IMAGE_TOKEN] * len(paths) + [QUESTION])
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    images = [Image.open(io.BytesIO(image_for(p))) for p in paths]
    ids = processor(text=prompt, images=images or None, add_special_tokens=False)["input_ids"][0]
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert sum(1 for t in ids if t == image_id) == VISION_IMAGE_TOKENS * len(paths)
    return len(ids)


def media_metadata(runner: JobRunner) -> dict[str, Any]:
    """The metadata of the latest fetched_media materialization on the runner's instance."""
    records = runner.instance.fetch_materializations(dg.AssetKey("fetched_media"), limit=1).records
    materialization = records[0].asset_materialization
    assert materialization is not None
    return {k: v.value for k, v in materialization.metadata.items()}


def answers(out: Path) -> dict[str, dict[str, Any]]:
    return {line["custom_id"]: line for line in read_jsonl(out)}


def text_of(line: dict[str, Any]) -> str:
    return ChatCompletion.model_validate(line["response"]["body"]).choices[0].message.content or ""


def test_images_by_url_and_inline_reach_the_model(
    tmp_path: Path, real_runner: JobRunner, vision_model: Path, server: MediaServer
) -> None:
    a, b = server.url("/img/a.png"), server.url("/img/b.png")
    rows = [
        vision_row("a", image(a)),
        vision_row("a-again", image(a)),
        vision_row("a-inline", image(data_url(image_for("/img/a.png")))),
        vision_row("b", image(b)),
        vision_row("a-and-b", image(a), image(b)),
        vision_row("gone", image(server.url("/missing.png"))),
        vision_row("text"),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    host = f"127.0.0.1:{server.port}"

    report = run_job(real_runner, src, out, vision_options(vision_model, server))

    assert (report.request_counts.completed, report.request_counts.failed) == (6, 1)
    lines = answers(out)
    gone = lines["gone"]
    assert gone["response"]["status_code"] == 404
    assert gone["error"]["type"] == "media_fetch_error" and gone["error"]["param"] == "messages[0].content[1]"
    for cid, paths in {
        "a": ["/img/a.png"],
        "a-inline": ["/img/a.png"],
        "a-and-b": ["/img/a.png", "/img/b.png"],
        "text": [],
    }.items():
        assert lines[cid]["response"]["body"]["usage"]["prompt_tokens"] == expected_prompt_tokens(vision_model, paths)
    assert text_of(lines["a"]) == text_of(lines["a-again"]) == text_of(lines["a-inline"])
    assert text_of(lines["a"]) != text_of(lines["b"])
    assert len({text_of(lines[c]) for c in ("a", "b", "a-and-b", "text")}) == 4
    assert server.hits["/img/a.png"] == server.hits["/img/b.png"] == 1
    first = media_metadata(real_runner)
    assert first["by_host"] == {host: {"downloaded": 2, "from_cache": 0, "failed": 1}}

    again = tmp_path / "again.jsonl"
    report = run_job(real_runner, src, again, vision_options(vision_model, server))

    assert (report.request_counts.completed, report.request_counts.failed) == (6, 1)
    assert server.hits["/img/a.png"] == server.hits["/img/b.png"] == 1  # the cache answered
    assert server.hits["/missing.png"] == 2  # a failure is not cached
    second = media_metadata(real_runner)
    assert (second["fetched"], second["from_cache"]) == (0, 2)
    assert second["by_host"] == {host: {"downloaded": 0, "from_cache": 2, "failed": 1}}
    assert {c: text_of(line) for c, line in answers(again).items() if c != "gone"} == {
        c: text_of(line) for c, line in lines.items() if c != "gone"
    }
