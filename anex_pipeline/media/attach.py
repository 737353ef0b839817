"""Rows made ready for an engine: each media reference replaced by its media, inline as data, or
the row failed with the reason its media could not be had."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from anex_pipeline.errors import RowErrorType
from anex_pipeline.media.fetcher import MediaFetcher, MediaFetchError
from anex_pipeline.spec import InputRow, MediaOptions, RowError, RowOutcome
from anex_pipeline.validate.media_refs import MediaRef, media_references


def media_failure(row: InputRow, ref: MediaRef, error: MediaFetchError) -> RowOutcome:
    """A row that fails because one of its media could not be fetched."""
    return RowOutcome(
        index=row.index,
        key=row.key,
        status_code=error.status,
        error=RowError(message=str(error), type=RowErrorType.MEDIA_FETCH, code=error.status, param=ref.param),
    )


def attach_media(
    rows: Sequence[InputRow],
    options: MediaOptions,
    recorded: dict[int, RowOutcome] | None = None,
    cache_dir: Path | None = None,
) -> tuple[list[InputRow], list[RowOutcome]]:
    """Splits rows into those ready for the engine, their media now inline as data, and failures.

    ``recorded`` are the media stage's failures; media that stage did not leave in the cache are
    fetched here, so rows can also be prepared without it.
    """
    recorded = recorded or {}
    ready: list[InputRow] = []
    failed: list[RowOutcome] = []
    with ExitStack() as stack:
        fetcher: MediaFetcher | None = None
        for row in rows:
            if row.index in recorded:
                failed.append(recorded[row.index])
                continue
            refs = media_references(row.body)
            if not refs:
                ready.append(row)
                continue
            fetcher = fetcher or stack.enter_context(MediaFetcher(options, cache_dir))
            values = {}
            for ref in refs:
                try:
                    values[ref] = fetcher.inline_value(ref)
                except MediaFetchError as exc:
                    failed.append(media_failure(row, ref, exc))
                    break
            else:
                ready.append(dataclasses.replace(row, body=_with_values(row.body, values)))
    return ready, failed


def _with_values(body: dict[str, Any], values: dict[MediaRef, Any]) -> dict[str, Any]:
    """A copy of the body with each reference's part given its new value (the input is not changed)."""
    fields = {ref.type: value for ref, value in values.items() if ref.message < 0 and value is not None}
    if "messages" not in body:
        return {**body, **fields}
    messages = list(body["messages"])
    for ref, value in values.items():
        if value is None or ref.message < 0:
            continue
        message = dict(messages[ref.message])
        content = list(message["content"])
        part = dict(content[ref.part])
        inner = part[ref.type]
        if ref.type == "input_audio":
            part[ref.type] = {**inner, **value}
        else:
            part[ref.type] = {**inner, "url": value} if isinstance(inner, dict) else {"url": value}
        content[ref.part] = part
        message["content"] = content
        messages[ref.message] = message
    return {**body, **fields, "messages": messages}
