"""Identical deterministic requests are generated once per job.

Two rows whose requests agree in everything that shapes the answer, and that are deterministic
(greedy sampling with temperature 0, a fixed seed, or an embedding), get the same answer. The
first is generated; the others receive a copy under their own response id, made at their own
time, with their own request's echo (a Responses object's ``instructions``, say) and no prompt
tokens served from a cache they never used. Answers are kept in the job's work folder (a small
SQLite file, :mod:`anex_pipeline.workdir.answer_table`), so later shards and reruns reuse the
answers of earlier ones; the checkpoints stay the record of what each row got.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import sqlite3
import time
from collections.abc import Iterable

import msgspec

from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.request_fields import POOLING
from anex_pipeline.responses import echo, uncached
from anex_pipeline.spec import RowOutcome
from anex_pipeline.workdir import layout
from anex_pipeline.workdir.answer_table import AnswerTable, UnsafeFolder
from anex_pipeline.workdir.manifest import JobDir

log = logging.getLogger(__name__)


def fingerprint(req: EngineRequest) -> str | None:
    """A digest of everything that decides the request's answer; None when sampling is random."""
    deterministic = (
        req.endpoint in POOLING or req.sampling.get("temperature") == 0 or req.sampling.get("seed") is not None
    )
    if not deterministic:
        return None
    shape = [
        req.endpoint,
        req.body,
        req.sampling,
        req.max_tokens,
        req.response_format,
        req.chat_template_kwargs,
        req.reasoning_budget,
        req.parse_thinking,
        req.parse_tool_calls,
    ]
    if req.adapter is not None:  # the job's adapter shapes the answer of a row that names none
        shape.append(req.adapter)
    if req.labels is not None:  # whether the answer keeps the logprobs its label was read from
        shape.append(req.labels_only_logprobs)
    return hashlib.sha256(msgspec.json.encode(shape, order="sorted")).hexdigest()


def copy_for(outcome: RowOutcome, req: EngineRequest) -> RowOutcome:
    """The answer another row got, delivered as this row's: its index, key and response id, made
    now, with none of its prompt tokens served from a cache (the copy used none), and, for a
    Responses object, the settings this row's own request echoes."""
    body = outcome.body
    if body is not None:
        body = dict(body)
        if isinstance(body.get("id"), str):
            body["id"] = _renamed(body["id"], req.request_id)
            if isinstance(body.get("output"), list):  # a Responses object's output items have ids too
                body["output"] = [{**item, "id": _renamed(item["id"], req.request_id)} for item in body["output"]]
        created = int(time.time())
        for name in ("created", "created_at"):
            if name in body:
                body[name] = created
        if body.get("completed_at") is not None:
            body["completed_at"] = created
        if isinstance(body.get("usage"), dict):
            body["usage"] = uncached(body["usage"])
        if req.respond is not None:
            body.update(echo(req.respond))
    usage = {**outcome.usage, "cached_prompt_tokens": 0} if outcome.usage.get("cached_prompt_tokens") else outcome.usage
    return dataclasses.replace(outcome, index=req.index, key=req.key, body=body, usage=usage, reused=True)


_ID_PREFIX = re.compile(r"[A-Za-z]+[-_]")


def _renamed(object_id: str, request_id: str) -> str:
    """An object id (``chatcmpl-...``, ``resp_...``, ``msg_...``) as made for another request id."""
    prefix = _ID_PREFIX.match(object_id)
    return f"{prefix.group(0) if prefix else ''}{request_id}"


class AnswerBook:
    """The job's answers to deterministic requests, by fingerprint (successful answers only, so a
    row that failed is generated again on a rerun). The book only saves work: when it cannot be
    opened, read or written (a full disk, say), rows are generated as without it."""

    def __init__(self, job: JobDir):
        self.job_id = job.job_id
        try:
            self._table: AnswerTable | None = AnswerTable(job.root / layout.ANSWERS_DIR)
        except (UnsafeFolder, sqlite3.Error, OSError) as exc:
            log.warning("the job's answer book cannot be used; identical rows are generated each: %s", exc)
            self._table = None

    def get(self, key: str) -> RowOutcome | None:
        if self._table is None:
            return None
        try:
            return self._table.get(key)
        except (sqlite3.Error, OSError) as exc:
            log.warning("could not read the job's answer book: %s", exc)
            return None

    def add(self, answers: Iterable[tuple[str, RowOutcome]]) -> None:
        """Keeps the successful answers; when they cannot be written, their twins in later shards
        are generated."""
        if self._table is None:
            return
        try:
            self._table.put(answers, self.job_id)
        except (sqlite3.Error, OSError) as exc:
            log.warning("could not keep answers for reuse in %s: %s", self._table.path, exc)

    def close(self) -> None:
        if self._table is not None:
            self._table.close()
