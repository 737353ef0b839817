"""Images reaching a real multimodal model: the tiny random Idefics3 of tiny_models.py on vLLM.

The pixels must reach the model, not just the request: each row's ``prompt_tokens`` is the count
the model's own processor gives for its text and images, and at temperature 0 the same image
gives the same answer (by URL, again by URL, inline) while another image gives another. The
tests share one engine for the model (the session's ``vision_model``), except the Batch API one,
whose ``serve`` process loads its own.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types.chat import ChatCompletion

from anex_pipeline.orchestration.definitions import build_definitions
from anex_pipeline.orchestration.names import CARRIED_RUN, LAUNCHED_BY_TAG
from anex_pipeline.orchestration.partitions import JOBS, job_shard_key
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.batch_api import content, wait
from anex_pipeline_tests.harness.commands import Served
from anex_pipeline_tests.harness.jobs import (
    answers,
    chat_row,
    local_instance,
    real_engine_resource,
    run_job,
    text_of,
    write_jsonl,
)
from anex_pipeline_tests.harness.media import WAV, MediaServer, image, image_for, media_metadata
from anex_pipeline_tests.harness.tiny_models import IMAGE_TOKEN, VISION_IMAGE_TOKENS

pytestmark = pytest.mark.engine

QUESTION = "What is in the picture?"


def vision_row(cid: str, *parts: dict[str, Any]) -> dict[str, Any]:
    return chat_row(cid, [{"type": "text", "text": QUESTION}, *parts])


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def vision_options(model: Path, media_server: MediaServer, **more: Any) -> dict[str, Any]:
    # reuse_answers off: identical rows must each be generated, or "same image, same answer"
    # would only show that the answer book deduplicates them.
    return {
        "model": str(model),
        "max_tokens": 16,
        "temperature": 0,
        "reuse_answers": False,
        "media": {"allowed_hosts": [f"127.0.0.1:{media_server.port}"]},
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


def test_images_by_url_and_inline_reach_the_model(
    tmp_path: Path, real_runner: JobRunner, vision_model: Path, media_server: MediaServer
) -> None:
    a, b = media_server.url("/img/a.png"), media_server.url("/img/b.png")
    rows = [
        vision_row("a", image(a)),
        vision_row("a-again", image(a)),
        vision_row("a-inline", image(data_url(image_for("/img/a.png")))),
        vision_row("b", image(b)),
        vision_row("a-and-b", image(a), image(b)),
        vision_row("gone", image(media_server.url("/missing.png"))),
        vision_row("text"),
        vision_row(
            "sound", {"type": "input_audio", "input_audio": {"data": base64.b64encode(WAV).decode(), "format": "wav"}}
        ),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    host = f"127.0.0.1:{media_server.port}"

    report = run_job(real_runner, src, out, vision_options(vision_model, media_server))

    assert (report.request_counts.completed, report.request_counts.failed) == (6, 2)
    lines = answers(out)
    sound = lines["sound"]
    assert sound["response"]["status_code"] == 400 and sound["error"]["param"] == "messages[0].content[1]"
    assert "reads images but cannot read audio" in sound["error"]["message"]
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
    assert media_server.hits["/img/a.png"] == media_server.hits["/img/b.png"] == 1
    first = media_metadata(real_runner)
    assert first["by_host"] == {host: {"downloaded": 2, "from_cache": 0, "failed": 1}}

    # Other ids make another job (the same input would resume the finished one).
    src = write_jsonl(tmp_path / "again-in.jsonl", [{**row, "custom_id": f"again-{row['custom_id']}"} for row in rows])
    again = tmp_path / "again.jsonl"
    report = run_job(real_runner, src, again, vision_options(vision_model, media_server))

    assert (report.request_counts.completed, report.request_counts.failed) == (6, 2)
    assert media_server.hits["/img/a.png"] == media_server.hits["/img/b.png"] == 1  # the cache answered
    assert media_server.hits["/missing.png"] == 2  # a failure is not cached
    second = media_metadata(real_runner)
    assert (second["fetched"], second["from_cache"]) == (0, 2)
    assert second["by_host"] == {host: {"downloaded": 0, "from_cache": 2, "failed": 1}}
    assert {c: text_of(line) for c, line in answers(again).items() if line["error"] is None} == {
        f"again-{c}": text_of(line) for c, line in lines.items() if line["error"] is None
    }


def test_parquet_image_column_of_urls_or_bytes(
    tmp_path: Path, real_runner: JobRunner, vision_model: Path, media_server: MediaServer
) -> None:
    a, b = media_server.url("/img/a.png"), media_server.url("/img/b.png")
    by_url = pq_input(tmp_path / "urls.parquet", [a, b, None, media_server.url("/missing.png")])
    by_bytes = pq_input(tmp_path / "bytes.parquet", [image_for("/img/a.png"), image_for("/img/b.png")])
    options = vision_options(vision_model, media_server, image_column="picture")

    url_report = run_job(real_runner, by_url, tmp_path / "urls-out.parquet", options)
    bytes_report = run_job(real_runner, by_bytes, tmp_path / "bytes-out.parquet", options)

    assert (url_report.request_counts.completed, url_report.request_counts.failed) == (3, 1)
    assert (bytes_report.request_counts.completed, bytes_report.request_counts.failed) == (2, 0)
    urls = pq.read_table(tmp_path / "urls-out.parquet").to_pydict()
    from_bytes = pq.read_table(tmp_path / "bytes-out.parquet").to_pydict()
    assert urls["picture"][:2] == [a, b] and from_bytes["picture"] == [image_for("/img/a.png"), image_for("/img/b.png")]
    assert urls["error_type"][3] == "media_fetch_error" and urls["output"][3] is None
    assert all(urls["output"][:3]) and all(from_bytes["output"])
    assert urls["output"][:2] == from_bytes["output"]  # the same pixels, by URL or as bytes
    assert len({*urls["output"][:3]}) == 3  # image a, image b and no image: three answers
    assert media_server.hits["/img/a.png"] == media_server.hits["/img/b.png"] == 1


def pq_input(path: Path, pictures: list[Any]) -> Path:
    pq.write_table(pa.table({"prompt": [QUESTION] * len(pictures), "picture": pictures}), path)
    return path


def test_a_vision_job_from_dagster_shows_media_per_host(
    tmp_path: Path, real_runner: JobRunner, vision_model: Path, media_server: MediaServer
) -> None:
    """The job launched from Dagster as the UI's launchpad does: its submit run carries the
    one-shard job through its other steps, and the shard's run shows the media it fetched."""
    rows = [
        vision_row("a", image(media_server.url("/img/a.png"))),
        vision_row("gone", image(media_server.url("/missing.png"))),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "ui.jsonl"
    d = build_definitions(StorageResource(work_root=str(tmp_path / "work")), real_engine_resource(keep_loaded=True))
    with local_instance() as instance:
        instance.add_dynamic_partitions(JOBS, ["vision"])
        config = {"input": str(src), "output": str(out), "options": vision_options(vision_model, media_server)}
        result = d.resolve_job_def("submit_job").execute_in_process(
            instance=instance, partition_key="vision", run_config={"ops": {"validated_input": {"config": config}}}
        )
        assert result.success
        carried = {r.job_name: r.tags.get(LAUNCHED_BY_TAG) for r in instance.get_runs()}
        assert carried == {
            "submit_job": None,
            "shard_job": CARRIED_RUN,
            "finish_job": CARRIED_RUN,
        }  # max_tokens is set: the submit step records the estimate
        (record,) = instance.fetch_materializations(dg.AssetKey("fetched_media"), limit=10).records
        assert record.partition_key == job_shard_key("vision", 0)
        media = record.asset_materialization.metadata
    host = f"127.0.0.1:{media_server.port}"
    assert media["by_host"].value == {host: {"downloaded": 1, "from_cache": 0, "failed": 1}}
    assert media["failed_by_code"].value == {"404": 1}
    lines = answers(out)
    assert lines["a"]["error"] is None and text_of(lines["a"])
    assert lines["gone"]["error"]["type"] == "media_fetch_error"


@pytest.mark.subprocess
def test_a_vision_batch_through_serve(tmp_path: Path, vision_model: Path, media_server: MediaServer) -> None:
    """The openai SDK against ``anex-pipeline serve`` in its own process, which loads the model."""
    rows = [
        vision_row("a", image(media_server.url("/img/a.png"))),
        vision_row("inline", image(data_url(image_for("/b")))),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    allowed = ["--model", str(vision_model), "--media-allowed-host", f"127.0.0.1:{media_server.port}"]
    served = Served(tmp_path, *allowed, "--max-model-len", "2048")
    try:
        with src.open("rb") as f:
            uploaded = served.sdk.files.create(file=f, purpose="batch")
        options = {"model": str(vision_model), "max_tokens": 8, "temperature": 0}
        created = served.sdk.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"anex_options": json.dumps(options)},
        )
        batch = wait(served.sdk, created.id, timeout=400)
        assert batch.status == "completed" and batch.error_file_id is None, str(batch.errors)
        output = content(served.sdk, batch.output_file_id)
    finally:
        served.terminate(timeout=30)
    assert batch.model == str(vision_model)
    assert [r["custom_id"] for r in output] == ["a", "inline"]
    for row in output:
        body = ChatCompletion.model_validate(row["response"]["body"])
        assert body.usage is not None and body.usage.prompt_tokens > VISION_IMAGE_TOKENS
    assert media_server.hits["/img/a.png"] == 1
