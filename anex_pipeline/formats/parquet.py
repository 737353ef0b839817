"""Parquet jobs: a prompt column in (read and checked by :mod:`~anex_pipeline.formats.parquet_input`),
the input's columns plus output columns out; shards are Arrow IPC files of the prompt values, and
their checkpoints Arrow streams of answers in columns (:mod:`~anex_pipeline.formats.arrow_checkpoint`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from anex_pipeline import responses
from anex_pipeline.formats import StoredOutcome, arrow_checkpoint, parquet_input
from anex_pipeline.formats.base import Format, MergeInput, RowCounter
from anex_pipeline.formats.parquet_input import ParquetInputError, chunk_rows, made_ahead, open_input, result_fields
from anex_pipeline.spec import Endpoint, InputRow, JobOptions, JobRejected, Problem, RowOutcome
from anex_pipeline.validate.answers import Constraints

MERGE_ROWS = 65_536  # input rows per batch, and per row group, of a result file
TOKEN_COLUMNS = ("prompt_tokens", "completion_tokens")


class ParquetFormat(Format):
    """Parquet: a prompt column in; out, the input's own columns and the answers beside them."""

    name = "parquet"
    title = "Parquet"
    magic = b"PAR1"
    shard_file = "requests.arrow"
    checkpoint_file = "results.arrow"
    error_field = "error_type"

    def job_endpoint(self, path: Path, options: JobOptions) -> Endpoint:
        try:
            return parquet_input.job_endpoint(path, options)
        except ParquetInputError as exc:
            raise JobRejected(exc.problems) from None

    def read_chunks(
        self,
        path: Path,
        endpoint: Endpoint,
        model_names: frozenset[str],
        options: JobOptions,
        priority: bool | None = None,
        constraints: Constraints | None = None,
    ) -> Iterator[pa.RecordBatch | Problem]:
        """A Parquet row has no priority (no job option sets one) and no constraint of its own, so
        ``priority`` and ``constraints`` change nothing."""
        return parquet_input.read_chunks(path, endpoint, model_names, options)

    def chunk_rows(self, chunk: pa.RecordBatch, endpoint: Endpoint, options: JobOptions) -> Iterator[InputRow]:
        return chunk_rows(chunk, endpoint, options)

    def staging(self, path: Path) -> Staging:
        return Staging(path)

    def split_staging(self, staging: Path, shards: list[tuple[Path, int]]) -> None:
        """Each shard file is Arrow IPC."""
        with pa.OSFile(str(staging)) as source, pa.ipc.open_stream(source) as reader:  # read, not memory-mapped
            batches = iter(reader)
            rest: pa.RecordBatch | None = None
            for path, count in shards:
                with pa.ipc.new_file(path, reader.schema) as out:
                    while count:
                        batch = rest if rest is not None else next(batches)
                        out.write_batch(batch.slice(0, count))
                        rest = batch.slice(count) if batch.num_rows > count else None
                        count -= min(count, batch.num_rows)

    def read_shard(self, path: Path, endpoint: Endpoint, options: JobOptions) -> Iterator[InputRow]:
        """The request bodies are built from the rows' prompts under the job's options."""
        with pa.OSFile(str(path)) as source, pa.ipc.open_file(source) as reader:
            for n in range(reader.num_record_batches):
                for row in chunk_rows(reader.get_batch(n), endpoint, options):
                    yield responses.chat_row(row) if endpoint == "responses" else row

    def append_checkpoint(self, path: Path, outcomes: Iterable[RowOutcome], endpoint: Endpoint) -> None:
        arrow_checkpoint.append(path, outcomes, endpoint)

    def checkpoint_outcomes(self, path: Path, start: int, stop: int, endpoint: Endpoint) -> Iterator[StoredOutcome]:
        """The merge reads the answers as columns instead (:func:`arrow_checkpoint.latest`)."""
        return arrow_checkpoint.stored_outcomes(arrow_checkpoint.latest(path, endpoint))

    def merge(self, job: MergeInput, out: Path, counter: RowCounter) -> None:
        """Reads each shard's checkpoint as columns, counted column-wise, into the result's columns."""
        answers = (
            counter.add_answers(table)
            for shard in job.shards
            for table in arrow_checkpoint.latest(shard.path, job.endpoint)
        )
        write_results(job.input, out, answers, job.endpoint, job.options)

    def result_keys(self, path: Path) -> Iterator[str]:
        pf = pq.ParquetFile(path, pre_buffer=False)
        column = "id" if "id" in pf.schema_arrow.names else "row_index"
        for batch in pf.iter_batches(columns=[column]):
            yield from (str(v) for v in batch.column(0).to_pylist())


class Staging:
    """Every accepted row in one Arrow stream, until the job knows how to cut it into shards."""

    def __init__(self, path: Path):
        self.path = path
        self.writer: pa.ipc.RecordBatchStreamWriter | None = None

    def add(self, chunk: pa.RecordBatch) -> None:
        if self.writer is None:
            self.writer = pa.ipc.new_stream(self.path, chunk.schema)
        self.writer.write_batch(chunk)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def heads(self, windows: list[tuple[int, int]], size: int) -> list[list[str]]:
        """The first ``size`` characters of the prompt of each row in each (start, stop) window (a
        structured prompt as its JSON text), read in one pass over the staged rows."""
        found: list[list[str]] = [[] for _ in windows]
        with pa.OSFile(str(self.path)) as source, pa.ipc.open_stream(source) as reader:
            first = 0
            for batch in reader:
                for w, (start, stop) in enumerate(windows):
                    lo, hi = max(start, first), min(stop, first + batch.num_rows)
                    if lo < hi:
                        values = batch.column("value").slice(lo - first, hi - lo).to_pylist()
                        found[w] += [_head(v, size) for v in values]
                first += batch.num_rows
        return found


def _head(value: Any, size: int) -> str:
    """The first ``size`` characters of a staged prompt: text, structured (as JSON) or bytes (as hex)."""
    if isinstance(value, bytes):
        return value[: size // 2].hex()
    return (value if isinstance(value, str) else json.dumps(value))[:size]


def write_results(
    input_path: Path, out_path: Path, answers: Iterator[pa.Table], endpoint: Endpoint, options: JobOptions
) -> int:
    """Copies the input's columns and adds the result columns (:func:`result_fields`), keeping only
    rows with an answer.

    ``answers`` are checkpoint tables (:mod:`~anex_pipeline.formats.arrow_checkpoint`) whose rows
    come in ascending input order across all of them; rows without one (a job that stopped
    early) are left out. Returns the number of rows written.
    """
    pf = open_input(input_path)
    added = result_fields(pf.schema_arrow, endpoint, options)
    # none of the input's columns has the name of a result column: checked at submit
    schema = pa.schema(list(pf.schema_arrow) + added)
    written = 0
    with pq.ParquetWriter(out_path, schema) as writer:
        for table in made_ahead(_result_tables(pf, answers, schema, len(added), endpoint)):
            writer.write_table(table)
            written += table.num_rows
    return written


def _result_tables(
    pf: pq.ParquetFile, answers: Iterator[pa.Table], schema: pa.Schema, added: int, endpoint: Endpoint
) -> Iterator[pa.Table]:
    """The result, a table per batch of input rows: the input's columns of the rows that have an
    answer, then the ``added`` result columns, taken from the checkpoint's columns of the same name
    (``row_index`` is the row's ``i``, the answer its ``value``); a failed row has no token counts."""
    copied = schema.names[:-added]
    sources = {"row_index": "i", arrow_checkpoint.value_field(endpoint).name: "value"}
    pending = _Answers(answers, arrow_checkpoint.schema(endpoint))
    offset = 0
    for batch in pf.iter_batches(batch_size=MERGE_ROWS):
        stop = offset + batch.num_rows
        found = pending.before(stop)
        indices = found.column("i")
        taken = pa.Table.from_batches([batch])
        if found.num_rows < batch.num_rows:
            taken = taken.take(pc.subtract(indices, offset))
        failed = pc.is_valid(found.column("error"))
        cols = [taken.column(name) for name in copied]
        for name in schema.names[-added:]:
            column = found.column(sources.get(name, name))  # a failed row's value is null
            if name in TOKEN_COLUMNS:
                column = pc.if_else(failed, pa.scalar(None, column.type), column)
            cols.append(column)
        yield pa.Table.from_arrays(cols, schema=schema)
        offset = stop


class _Answers:
    """Checkpoint tables in ascending row order, handed out by ranges of row indices."""

    def __init__(self, tables: Iterator[pa.Table], schema: pa.Schema):
        self.tables = tables
        self.schema = schema
        self.held: pa.Table | None = None

    def before(self, stop: int) -> pa.Table:
        """The answers of rows below ``stop`` not handed out yet, in one table."""
        parts = []
        while True:
            if self.held is None:
                self.held = next(self.tables, None)
                if self.held is None:
                    break
            indices = self.held.column("i")
            if self.held.num_rows == 0 or indices[-1].as_py() < stop:
                parts.append(self.held)
                self.held = None
                continue
            count = int(np.searchsorted(indices.to_numpy(), stop))
            parts.append(self.held.slice(0, count))
            self.held = self.held.slice(count)
            break
        return pa.concat_tables(parts).combine_chunks() if parts else self.schema.empty_table()
