"""Identical deterministic requests are generated once per job.

Two rows whose requests agree in everything that shapes the answer, and that are deterministic
(greedy sampling with temperature 0, a fixed seed, or an embedding), get the same answer. The
first is generated; the others receive a copy under their own response id. Answers are kept in
the job's work folder (a small SQLite store through diskcache), so later shards and reruns reuse
the answers of earlier ones; the checkpoints stay the record of what each row got.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import sqlite3
from collections.abc import Iterable

import diskcache
import msgspec

from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.request_fields import POOLING
from anex_pipeline.spec import RowOutcome
from anex_pipeline.workdir import layout
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
    return hashlib.sha256(msgspec.json.encode(shape, order="sorted")).hexdigest()


def copy_for(outcome: RowOutcome, req: EngineRequest) -> RowOutcome:
    """The answer another row got, delivered as this row's: its index, key and response id."""
    body = outcome.body
    if body is not None and isinstance(body.get("id"), str):
        body = {**body, "id": _renamed(body["id"], req.request_id)}
        if isinstance(body.get("output"), list):  # a Responses object's output items have ids too
            body["output"] = [{**item, "id": _renamed(item["id"], req.request_id)} for item in body["output"]]
    return dataclasses.replace(outcome, index=req.index, key=req.key, body=body, reused=True)


_ID_PREFIX = re.compile(r"[A-Za-z]+[-_]")


def _renamed(object_id: str, request_id: str) -> str:
    """An object id (``chatcmpl-...``, ``resp_...``, ``msg_...``) as made for another request id."""
    prefix = _ID_PREFIX.match(object_id)
    return f"{prefix.group(0) if prefix else ''}{request_id}"


class AnswerBook:
    """The job's answers to deterministic requests, by fingerprint (successful answers only, so a
    row that failed is generated again on a rerun)."""

    def __init__(self, job: JobDir):
        self._cache = diskcache.Cache(str(job.root / layout.ANSWERS_DIR))

    def get(self, key: str) -> RowOutcome | None:
        record = self._cache.get(key)
        return RowOutcome.from_record(record) if record is not None else None

    def add(self, answers: Iterable[tuple[str, RowOutcome]]) -> None:
        """Keeps the successful answers. The book only saves work: when it cannot be written (a
        full disk, say) the answers are left out and their twins in later shards are generated."""
        try:
            with self._cache.transact():
                for key, outcome in answers:
                    if outcome.ok:
                        self._cache.set(key, outcome.to_record())
        except (sqlite3.Error, OSError) as exc:
            log.warning("could not keep answers for reuse in %s: %s", self._cache.directory, exc)

    def close(self) -> None:
        self._cache.close()
