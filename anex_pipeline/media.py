"""Media that rows reference by URL (SPEC section 7).

This stage currently finds and counts the media references of a shard; downloading them into
the media cache is the next step of the media work (issue 4). Rows pass through unchanged, and
a text-only engine refuses a row with media on its own with a 400.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from anex_pipeline.jobs import JobDir
from anex_pipeline.spec import MediaOptions

MEDIA_KEYS = {"image_url": "url", "audio_url": "url", "video_url": "url", "input_audio": "data"}


def media_references(body: dict[str, Any]) -> Iterator[str]:
    """Every media URL (http(s) or data:) in a chat body's content parts."""
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            ref = part.get(part.get("type", ""), None) if isinstance(part, dict) else None
            if isinstance(ref, dict):
                value = ref.get(MEDIA_KEYS.get(part["type"], "url"))
                if isinstance(value, str):
                    yield value
            elif isinstance(ref, str):
                yield ref


def fetch_shard(job: JobDir, shard: int, options: MediaOptions) -> dict[str, int]:
    """Counts the shard's media references (downloads come with the media stage proper)."""
    rows = urls = inline = 0
    for row in job.read_requests(shard):
        rows += 1
        for ref in media_references(row.body):
            if ref.startswith("data:"):
                inline += 1
            else:
                urls += 1
    return {"rows": rows, "urls_seen": urls, "inline_media": inline}
