"""Reading request files and writing result files, one :class:`~anex_pipeline.formats.base.Format`
per file format, looked up by name in :mod:`~anex_pipeline.formats.registry`.

This module holds what every format shares: the stored outcome of a finished row as the merge
and the report read it (:class:`StoredOutcome`), and what a row's answer says (its text, why it
ended, its tokens' logprobs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from anex_pipeline import responses
from anex_pipeline.request_fields import AUDIO, POOLING
from anex_pipeline.spec import error_kind

FileFormat = str  # the name of a format in registry.FORMATS

JSON_NULL = msgspec.Raw(b"null")


class StoredUsage(msgspec.Struct, frozen=True):
    """The token counts of a row the report adds up."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_prompt_tokens: int = 0


class StoredOutcome(msgspec.Struct):
    """One checkpoint line of a finished row (``RowOutcome.to_record``), read without building
    the body: ``body`` stays the JSON text it was stored as."""

    i: int
    key: str
    status_code: int | None = None
    body: msgspec.Raw = JSON_NULL
    error: dict[str, Any] | None = None
    flag: str | None = None
    format_error: bool = False
    usage: StoredUsage = StoredUsage()
    reused: bool = False

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def error_type(self) -> str | None:
        """What a failed row counts as (:func:`~anex_pipeline.spec.error_kind`), else the
        completion's flag ("length", ...)."""
        if self.error is None:
            return self.flag
        return error_kind(self.error["type"], self.error.get("code"))


decode_stored_outcome = msgspec.json.Decoder(StoredOutcome).decode


def write_error(exc: OSError, path: Path) -> OSError:
    """The same error about ``path``, the file the job meant to write (not a temp file)."""
    return OSError(exc.errno, exc.strerror or str(exc), str(path))


def finish_reason_of(endpoint: str, body: dict[str, Any] | None) -> str | None:
    """Why a completion body's answer ended (``stop``, ``length``, ``tool_calls``); None for an
    embedding, a score or a row without a body."""
    if body is None or endpoint in POOLING | AUDIO:
        return None
    if endpoint == "responses":
        return responses.finish_reason(body)
    return (body.get("choices") or [{}])[0].get("finish_reason")


def text_of(endpoint: str, body: dict[str, Any]) -> str:
    """The answer text of a completion body, or the whole body as JSON when it has no text."""
    choice = (body.get("choices") or [{}])[0]
    if endpoint in AUDIO:
        text = body.get("text")
    elif endpoint == "responses":
        text = responses.output_text(body)
    else:
        text = choice.get("text") if endpoint == "completions" else (choice.get("message") or {}).get("content")
    return text if isinstance(text, str) and text else json.dumps(body, ensure_ascii=False)


def token_logprobs_of(endpoint: str, body: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """The first choice's logprobs as one entry per generated token, ``{token, logprob,
    top_logprobs: [{token, logprob}]}``, from either endpoint's shape (chat's ``content`` list,
    completions' four lists, whose alternatives come best first here as in chat's); None when the
    answer carries none."""
    if body is None or endpoint not in ("chat", "completions"):
        return None
    found = (body.get("choices") or [{}])[0].get("logprobs")
    if not isinstance(found, dict):
        return None
    if endpoint == "chat":
        content = found.get("content")
        if content is None:
            return None
        return [
            {
                "token": t["token"],
                "logprob": t.get("logprob"),
                "top_logprobs": [{"token": a["token"], "logprob": a["logprob"]} for a in t.get("top_logprobs") or []],
            }
            for t in content
        ]
    tokens = found.get("tokens") or []
    logprobs = found.get("token_logprobs") or [None] * len(tokens)
    alternatives = found.get("top_logprobs") or [None] * len(tokens)
    return [
        {
            "token": token,
            "logprob": logprob,
            "top_logprobs": [
                {"token": t, "logprob": lp} for t, lp in sorted((top or {}).items(), key=lambda item: -item[1])
            ],
        }
        for token, logprob, top in zip(tokens, logprobs, alternatives, strict=True)
    ]
