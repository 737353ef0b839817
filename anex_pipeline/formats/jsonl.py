"""JSONL in the OpenAI batch format: request lines in (read and checked by
:mod:`~anex_pipeline.formats.jsonl_input`), batch output envelopes out; shards are JSON lines
``{"i", "key", "body"}``."""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from anex_pipeline import responses
from anex_pipeline.formats import StoredOutcome, decode_stored_outcome, jsonl_checkpoint
from anex_pipeline.formats.envelope import answered_line

# The module registered as the JSONL format reads its input through these.
from anex_pipeline.formats.jsonl_input import CHUNK_ROWS, job_endpoint, read_chunks  # noqa: F401
from anex_pipeline.spec import (
    Endpoint,
    InputRow,
    JobOptions,
    RowOutcome,
)

SHARD_FILE = "requests.jsonl"
# The merge streams stored rows (bodies as JSON) into write_results, not columns of answers.
MERGES_COLUMNS = False
COPY_BLOCK = 1 << 20


def chunk_rows(chunk: list[bytes], endpoint: Endpoint, options: JobOptions) -> Iterator[InputRow]:
    """The rows of a chunk of shard lines, with the job's system prompt applied."""
    for line in chunk:
        yield shard_row(line, endpoint, options)


def shard_row(line: bytes | str, endpoint: Endpoint, options: JobOptions) -> InputRow:
    """A row of a shard line: its body as the input wrote it, with the job's system prompt applied
    (the prompt is kept once, in the job's options, not in every staged line)."""
    rec = msgspec.json.decode(line)
    return InputRow(index=rec["i"], key=rec["key"], body=_apply_job_prompt(rec["body"], endpoint, options))


def _apply_job_prompt(body: dict[str, Any], endpoint: Endpoint, options: JobOptions) -> dict[str, Any]:
    """Prepends the job's system_prompt to a chat row that has no system message of its own, and
    gives it as instructions to a responses row that has none. A row that already has one (a shard
    staged with the prompt in every line, by an earlier version) is left as it is."""
    if endpoint == "responses" and options.system_prompt and not body.get("instructions"):
        return {**body, "instructions": options.system_prompt}
    if endpoint != "chat" or not options.system_prompt:
        return body
    if any(m.get("role") in ("system", "developer") for m in body["messages"]):
        return body
    return {**body, "messages": [{"role": "system", "content": options.system_prompt}, *body["messages"]]}


class Staging:
    """Every accepted row's shard line in one file, until the job knows how to cut it into shards."""

    def __init__(self, path: Path):
        self.path = path
        self.file = path.open("wb")
        self.rows = 0
        self.chunks: list[tuple[int, int]] = []  # (first row, byte offset) of each chunk added

    def add(self, chunk: list[bytes]) -> None:
        self.chunks.append((self.rows, self.file.tell()))
        self.rows += len(chunk)
        self.file.write(b"".join(chunk))

    def close(self) -> None:
        self.file.close()

    def heads(self, windows: list[tuple[int, int]], size: int) -> list[list[bytes]]:
        """The first ``size`` bytes of the request body of each row in each (start, stop) window."""
        found = []
        with self.path.open("rb") as f:
            for start, stop in windows:
                first, offset = self.chunks[bisect.bisect_right(self.chunks, (start, 1 << 62)) - 1]
                f.seek(offset)
                lines = itertools.islice(f, start - first, stop - first)
                found.append([line[line.index(b',"body":') + 8 :][:size] for line in lines])
        return found


def split_staging(staging: Path, shards: list[tuple[Path, int]]) -> None:
    """Cuts the staged lines into shard files holding the given numbers of lines, in order."""
    with staging.open("rb") as src:
        rest = b""
        for path, count in shards:
            with path.open("wb") as dst:
                while count:
                    block, rest = rest or src.read(COPY_BLOCK), b""
                    if not block:
                        raise ValueError(f"{staging} holds fewer rows than the shards need")
                    found = block.count(b"\n")
                    if found < count:
                        dst.write(block)
                        count -= found
                        continue
                    cut = -1
                    for _ in range(count):
                        cut = block.index(b"\n", cut + 1)
                    dst.write(block[: cut + 1])
                    rest, count = block[cut + 1 :], 0


def read_shard(path: Path, endpoint: Endpoint, options: JobOptions) -> Iterator[InputRow]:
    """A shard's rows, with the job's system prompt applied (a /v1/responses row comes as the chat
    row it means)."""
    with path.open("rb") as f:
        for line in f:
            row = shard_row(line, endpoint, options)
            yield responses.chat_row(row) if endpoint == "responses" else row


def write_results(path: Path, outcomes: Iterable[StoredOutcome], append: bool = False) -> int:
    """Writes (or with ``append``, adds) one batch output envelope per outcome (the stored body
    passes through as it is); returns the number of lines."""
    count = 0
    lines: list[bytes] = []
    with path.open("ab" if append else "wb") as f:
        for o in outcomes:
            lines.append(answered_line(o))
            if len(lines) == CHUNK_ROWS:
                f.write(b"".join(lines))
                count += len(lines)
                lines.clear()
        f.write(b"".join(lines))
    return count + len(lines)


def append_checkpoint(path: Path, outcomes: Iterable[RowOutcome], endpoint: Endpoint) -> None:
    """Appends finished rows to a shard's checkpoint (JSON lines), durably."""
    jsonl_checkpoint.append_outcomes(path, outcomes)


def checkpoint_outcomes(path: Path, start: int, stop: int, endpoint: Endpoint) -> Iterator[StoredOutcome]:
    """The latest outcome of each row of a shard's checkpoint, by row order; the bodies stay the
    stored JSON and the file is streamed, never read whole."""
    return jsonl_checkpoint.latest_records(path, start, stop, decode_stored_outcome)


def result_keys(path: Path) -> Iterator[str]:
    """The row identities of a result file, in file order."""
    with path.open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["custom_id"]
