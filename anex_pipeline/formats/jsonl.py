"""JSONL in the OpenAI batch format: request lines in (read and checked by
:mod:`~anex_pipeline.formats.jsonl_input`), batch output envelopes out; shards are JSON lines
``{"i", "key", "body"}``, and so are their checkpoints (:mod:`~anex_pipeline.formats.jsonl_checkpoint`)."""

from __future__ import annotations

import bisect
import errno
import itertools
import json
import multiprocessing
import os
import shutil
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from anex_pipeline import responses
from anex_pipeline.formats import StoredOutcome, decode_stored_outcome, jsonl_checkpoint, jsonl_input
from anex_pipeline.formats.base import Format, MergeInput, RowCounter, ShardCheckpoint
from anex_pipeline.formats.envelope import answered_line
from anex_pipeline.spec import Endpoint, InputRow, JobOptions, Problem, RowOutcome
from anex_pipeline.validate.answers import Constraints

COPY_BLOCK = 1 << 20
PARALLEL_MERGE_ROWS = 100_000  # a job this big is merged by one process per core


class JsonlFormat(Format):
    """OpenAI batch JSONL: each line a request, each result line a batch output envelope."""

    name = "jsonl"
    title = "JSONL"
    shard_file = "requests.jsonl"
    checkpoint_file = "results.jsonl"
    error_field = "error"

    def job_endpoint(self, path: Path, options: JobOptions) -> Endpoint:
        return jsonl_input.job_endpoint(path, options)

    def read_chunks(
        self,
        path: Path,
        endpoint: Endpoint,
        model_names: frozenset[str],
        options: JobOptions,
        priority: bool | None = None,
        constraints: Constraints | None = None,
    ) -> Iterator[list[bytes] | Problem]:
        return jsonl_input.read_chunks(path, endpoint, model_names, options, priority, constraints)

    def chunk_rows(self, chunk: list[bytes], endpoint: Endpoint, options: JobOptions) -> Iterator[InputRow]:
        for line in chunk:
            yield shard_row(line, endpoint, options)

    def staging(self, path: Path) -> Staging:
        return Staging(path)

    def split_staging(self, staging: Path, shards: list[tuple[Path, int]]) -> None:
        split_staging(staging, shards)

    def read_shard(self, path: Path, endpoint: Endpoint, options: JobOptions) -> Iterator[InputRow]:
        """The job's system prompt is applied to each row."""
        with path.open("rb") as f:
            for line in f:
                row = shard_row(line, endpoint, options)
                yield responses.chat_row(row) if endpoint == "responses" else row

    def append_checkpoint(self, path: Path, outcomes: Iterable[RowOutcome], endpoint: Endpoint) -> None:
        jsonl_checkpoint.append_outcomes(path, outcomes)

    def checkpoint_outcomes(self, path: Path, start: int, stop: int, endpoint: Endpoint) -> Iterator[StoredOutcome]:
        """The bodies stay the stored JSON, and the file is streamed, never read whole."""
        return jsonl_checkpoint.latest_records(path, start, stop, decode_stored_outcome)

    def merge(self, job: MergeInput, out: Path, counter: RowCounter) -> None:
        """Streams each shard's checkpoint into envelopes. A big job's shards are written by one
        process per core, each into a part file, and the parts appended in shard order."""
        shards = job.shards
        workers = min(os.cpu_count() or 1, len(shards))
        if sum(s.stop - s.start for s in shards) < PARALLEL_MERGE_ROWS or workers < 2:
            for n, shard in enumerate(shards):
                counter.absorb(self._write_part(shard, out, job.endpoint, type(counter), append=n > 0))
            return
        parts = [out.with_name(f"{out.name}.{n}") for n in range(len(shards))]
        try:
            # fork: the workers need no imports, and they only read checkpoints and write their part
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                kinds = [type(counter)] * len(parts)
                for counted in pool.map(self._write_part, shards, parts, [job.endpoint] * len(parts), kinds):
                    counter.absorb(counted)
            with out.open("wb") as f:
                for part in parts:
                    with part.open("rb") as src:
                        _copy(src, f)
        finally:
            for part in parts:
                part.unlink(missing_ok=True)

    def _write_part(
        self, shard: ShardCheckpoint, path: Path, endpoint: Endpoint, counter: type[RowCounter], append: bool = False
    ) -> RowCounter:
        """Writes the result lines of one shard's finished rows, in input order; returns a new
        counter (of the merge's own kind) of them."""
        counted = counter()
        add = counted.add
        outcomes = self.checkpoint_outcomes(shard.path, shard.start, shard.stop, endpoint)
        write_results(path, (add(o) for o in outcomes), append=append)
        return counted

    def result_keys(self, path: Path) -> Iterator[str]:
        with path.open(encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["custom_id"]


def _copy(source: BinaryIO, target: BinaryIO) -> None:
    """Appends one file to another, inside the kernel where the filesystem allows it."""
    left = os.fstat(source.fileno()).st_size
    try:
        while left:
            left -= os.copy_file_range(source.fileno(), target.fileno(), left)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        shutil.copyfileobj(source, target, 1 << 20)


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


def write_results(path: Path, outcomes: Iterable[StoredOutcome], append: bool = False) -> int:
    """Writes (or with ``append``, adds) one batch output envelope per outcome (the stored body
    passes through as it is); returns the number of lines."""
    count = 0
    lines: list[bytes] = []
    with path.open("ab" if append else "wb") as f:
        for o in outcomes:
            lines.append(answered_line(o))
            if len(lines) == jsonl_input.CHUNK_ROWS:
                f.write(b"".join(lines))
                count += len(lines)
                lines.clear()
        f.write(b"".join(lines))
    return count + len(lines)
