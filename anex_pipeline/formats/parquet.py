"""Parquet jobs: a prompt column in, the input's columns plus output columns out; shards are Arrow
IPC files of the prompt values."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from anex_pipeline.formats import InputRow, StoredOutcome, arrow_checkpoint
from anex_pipeline.spec import Endpoint, JobOptions, Problem, RowOutcome
from anex_pipeline.validate import check_body

T = TypeVar("T")
BATCH_ROWS = 16_384
MERGE_ROWS = 65_536  # input rows per batch, and per row group, of a result file
SHARD_FILE = "requests.arrow"
# The merge hands write_results the checkpoints' answer columns, next to the input's own columns.
MERGES_COLUMNS = True
SHARD_COLUMNS = ("i", "key", "value")
# A prompt made only of what str.strip() removes (every such character is at most U+3000).
_BLANK = "^[{}]*$".format("".join(f"\\x{{{c:x}}}" for c in range(0x3001) if chr(c).isspace()))
PROMPT_COLUMNS: dict[Endpoint, tuple[str, ...]] = {
    "chat": ("messages", "prompt"),
    "completions": ("prompt",),
    "embeddings": ("input", "text"),
}


class ParquetInputError(Exception):
    """The file cannot be read as Parquet, or lacks what a job needs; carries the problems."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(map(str, problems)))


def open_input(path: Path) -> pq.ParquetFile:
    try:
        # Pre-buffering reads ahead a whole file's column data: memory would grow with the file.
        return pq.ParquetFile(path, pre_buffer=False)
    except (pa.ArrowException, OSError) as exc:
        raise ParquetInputError([Problem(f"the file is not a readable Parquet file ({exc})")]) from None


def job_endpoint(path: Path, options: JobOptions) -> Endpoint:
    """The option if set; otherwise embeddings for a file with only an input/text column, else chat."""
    if options.endpoint:
        return options.endpoint
    names = set(open_input(path).schema_arrow.names)
    if not names & {"messages", "prompt"} and names & {"input", "text"} and not options.prompt_column:
        return "embeddings"
    return "chat"


def prompt_column(schema: pa.Schema, endpoint: Endpoint, options: JobOptions) -> str:
    names = schema.names
    if options.prompt_column:
        if options.prompt_column not in names:
            raise ParquetInputError(
                [
                    Problem(
                        f"column '{options.prompt_column}' is not in the file (columns: {', '.join(names)})",
                        field="prompt_column",
                    )
                ]
            )
        return options.prompt_column
    found = [name for name in PROMPT_COLUMNS[endpoint] if name in names]
    if len(found) > 1:
        raise ParquetInputError(
            [
                Problem(
                    f"the file has both a '{found[0]}' and a '{found[1]}' column; set prompt_column to the one "
                    "that holds the prompts (or rename the other)",
                    field=found[1],
                )
            ]
        )
    if found:
        return found[0]
    wanted = " or ".join(f"'{n}'" for n in PROMPT_COLUMNS[endpoint])
    raise ParquetInputError(
        [
            Problem(
                f"a {endpoint} job needs a {wanted} column, or prompt_column naming one; "
                f"the file has: {', '.join(names)}"
            )
        ]
    )


def result_columns(schema: pa.Schema, endpoint: Endpoint) -> list[str]:
    """The columns a job's result adds to the input's: ``row_index`` (when there is no ``id``), the
    answer (or embedding) and ``error_type``."""
    added = [] if "id" in schema.names else ["row_index"]
    return [*added, arrow_checkpoint.value_field(endpoint).name, "error_type"]


def _taken_names(schema: pa.Schema, endpoint: Endpoint, prompt: str) -> list[Problem]:
    """A problem for each input column that a result column would replace."""
    roles = {"row_index": "the row numbers", "error_type": "each row's error"}
    return [
        Problem(
            f"is a column the result writes ({roles.get(name, 'the answers')}), so its values would be lost; "
            "rename it in the file" + (" and set prompt_column to the new name" if name == prompt else ""),
            field=name,
        )
        for name in result_columns(schema, endpoint)
        if name in schema.names
    ]


def read_chunks(
    path: Path, endpoint: Endpoint, model_names: frozenset[str], options: JobOptions
) -> Iterator[pa.RecordBatch | Problem]:
    """Checks every row, in file order; yields the problems of bad rows and, for runs of good
    ones, record batches of what the shards store (``i``, ``key`` and the prompt as ``value``).

    A batch of plain-text prompts is checked column-wise (nulls, blank text, ids); a batch that
    shows a possible problem, or holds structured prompts, is checked row by row.
    """
    try:
        pf = open_input(path)
        column = prompt_column(pf.schema_arrow, endpoint, options)
    except ParquetInputError as exc:
        yield from exc.problems
        return
    taken = _taken_names(pf.schema_arrow, endpoint, column)
    if taken:
        yield from taken
        return
    has_id = "id" in pf.schema_arrow.names
    columns = [column] + (["id"] if has_id and column != "id" else [])
    index = 0
    try:
        seen: dict[str, int] | None = None if not has_id or _ids_unique(pf) else {}
        for batch in _made_ahead(pf.iter_batches(batch_size=BATCH_ROWS, columns=columns)):
            values = batch.column(column)
            indices = pa.array(np.arange(index, index + batch.num_rows, dtype=np.int64))
            if seen is None and _plain_and_sound(values, endpoint):
                keys = (batch.column("id") if has_id else indices).cast(pa.string())
                yield pa.RecordBatch.from_arrays([indices, keys, values], names=SHARD_COLUMNS)
            else:
                yield from _checked_rows(batch, column, has_id, index, seen, endpoint, options, model_names)
            index += batch.num_rows
    except (pa.ArrowException, OSError) as exc:
        yield Problem(f"the Parquet data could not be read at row {index + 1}: {exc}")


def _ids_unique(pf: pq.ParquetFile) -> bool:
    """True when the id column is text or integers with no null and no value twice."""
    ids = pf.read(columns=["id"]).column("id")
    if not (pa.types.is_integer(ids.type) or pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type)):
        return False
    return ids.null_count == 0 and pc.count_distinct(ids).as_py() == len(ids)


def _plain_and_sound(values: pa.Array, endpoint: Endpoint) -> bool:
    """True when every prompt is non-null text that passes its checks as it is."""
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)) or values.null_count:
        return False
    if endpoint == "embeddings":
        return not pc.any(pc.equal(pc.utf8_length(values), 0)).as_py()
    return not pc.any(pc.match_substring_regex(values, _BLANK)).as_py()


def _checked_rows(
    batch: pa.RecordBatch,
    column: str,
    has_id: bool,
    offset: int,
    seen: dict[str, int] | None,
    endpoint: Endpoint,
    options: JobOptions,
    model_names: frozenset[str],
) -> Iterator[pa.RecordBatch | Problem]:
    """The row-by-row check of one batch: its problems, then a batch of its good rows."""
    prompts = batch.column(column).to_pylist()
    ids = batch.column("id").to_pylist() if has_id else [None] * len(prompts)
    keep: list[int] = []
    keys: list[str] = []
    for n, (prompt, row_id) in enumerate(zip(prompts, ids, strict=True)):
        number = offset + n + 1
        problems = []
        key = str(offset + n)
        if has_id:
            key = "" if row_id is None else str(row_id)
            if row_id is None:
                problems.append(Problem("is null; every row needs an id", number, "id"))
            elif seen is not None and key in seen:
                problems.append(Problem(f"'{key}' is already used by row {seen[key]}", number, "id"))
            elif seen is not None:
                seen[key] = number
        found = _problems(prompt, request_body(prompt, endpoint, options), column, endpoint, model_names)
        problems += [Problem(msg.replace("body.", ""), number, column) for _, msg in found]
        if problems:
            yield from problems
        else:
            keep.append(n)
            keys.append(key)
    if keep:
        taken = batch.take(pa.array(keep, pa.int64()))
        indices = pa.array([offset + n for n in keep], pa.int64())
        yield pa.RecordBatch.from_arrays(
            [indices, pa.array(keys, pa.string()), taken.column(column)], names=SHARD_COLUMNS
        )


def request_body(value: Any, endpoint: Endpoint, options: JobOptions) -> dict[str, Any]:
    """The OpenAI request body of one row's prompt value, with the job's system prompt."""
    if endpoint == "embeddings":
        return {"input": value}
    if endpoint == "completions":
        return {"prompt": value}
    if isinstance(value, str):
        messages: Any = [{"role": "user", "content": value}]
    elif isinstance(value, list):
        messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in value]
    else:
        messages = value
    if options.system_prompt and isinstance(messages, list):
        messages = [{"role": "system", "content": options.system_prompt}, *messages]
    return {"messages": messages}


def _problems(
    value: Any, body: dict[str, Any], column: str, endpoint: Endpoint, model_names: frozenset[str]
) -> list[tuple[str, str]]:
    if value is None:
        return [(column, "is null; the row has nothing to send")]
    if isinstance(value, str) and not value.strip() and endpoint != "embeddings":
        return [(column, "is empty; there is no prompt to send")]
    return check_body(body, endpoint, model_names)


def chunk_rows(chunk: pa.RecordBatch, endpoint: Endpoint, options: JobOptions) -> Iterator[InputRow]:
    """The rows of a batch of shard rows, with their request bodies."""
    columns = zip(*(chunk.column(name).to_pylist() for name in SHARD_COLUMNS), strict=True)
    for index, key, value in columns:
        yield InputRow(index=index, key=key, body=request_body(value, endpoint, options))


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


def split_staging(staging: Path, shards: list[tuple[Path, int]]) -> None:
    """Cuts the staged rows into shard files (Arrow IPC) holding the given numbers of rows, in order."""
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


def read_shard(path: Path, endpoint: Endpoint, options: JobOptions) -> Iterator[InputRow]:
    """A shard's rows, with the request bodies built from their prompts under the job's options."""
    with pa.OSFile(str(path)) as source, pa.ipc.open_file(source) as reader:
        for n in range(reader.num_record_batches):
            yield from chunk_rows(reader.get_batch(n), endpoint, options)


def write_results(input_path: Path, out_path: Path, answers: Iterator[pa.Table], endpoint: Endpoint) -> int:
    """Copies the input's columns and adds the result columns, keeping only rows with an answer.

    ``answers`` are checkpoint tables (:mod:`~anex_pipeline.formats.arrow_checkpoint`) whose rows
    come in ascending input order across all of them; rows without one (a job that stopped
    early) are left out. Returns the number of rows written.
    """
    pf = open_input(input_path)
    add_index = "id" not in pf.schema_arrow.names
    value = arrow_checkpoint.value_field(endpoint)
    fields = list(pf.schema_arrow)  # none of them has the name of a result column: checked at submit
    schema = pa.schema(
        fields
        + ([pa.field("row_index", pa.int64())] if add_index else [])
        + [value, pa.field("error_type", pa.string())]
    )
    written = 0
    with pq.ParquetWriter(out_path, schema) as writer:
        for table in _made_ahead(_result_tables(pf, answers, schema, add_index, endpoint)):
            writer.write_table(table)
            written += table.num_rows
    return written


def _result_tables(
    pf: pq.ParquetFile, answers: Iterator[pa.Table], schema: pa.Schema, add_index: bool, endpoint: Endpoint
) -> Iterator[pa.Table]:
    """The result, a table per batch of input rows: the input's columns of the rows that have an
    answer, then ``row_index`` (with ``add_index``), the answer and ``error_type``."""
    copied = schema.names[: -3 if add_index else -2]
    pending = _Answers(answers, arrow_checkpoint.schema(endpoint))
    offset = 0
    for batch in pf.iter_batches(batch_size=MERGE_ROWS):
        stop = offset + batch.num_rows
        found = pending.before(stop)
        indices = found.column("i")
        taken = pa.Table.from_batches([batch])
        if found.num_rows < batch.num_rows:
            taken = taken.take(pc.subtract(indices, offset))
        cols = [taken.column(name) for name in copied] + ([indices] if add_index else [])
        cols += [found.column("value"), found.column("error_type")]  # a failed row's value is null
        yield pa.Table.from_arrays(cols, schema=schema)
        offset = stop


def _made_ahead(items: Iterator[T]) -> Iterator[T]:
    """The same items, each made on a second thread while the caller works on the one before it
    (pyarrow lets go of the GIL while it decodes, gathers and encodes)."""
    with ThreadPoolExecutor(1) as pool:
        coming = pool.submit(next, items, None)
        while (item := coming.result()) is not None:
            coming = pool.submit(next, items, None)
            yield item


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


def append_checkpoint(path: Path, outcomes: Iterable[RowOutcome], endpoint: Endpoint) -> None:
    """Appends finished rows to a shard's checkpoint (an Arrow stream), durably."""
    arrow_checkpoint.append(path, outcomes, endpoint)


def checkpoint_outcomes(path: Path, start: int, stop: int, endpoint: Endpoint) -> Iterator[StoredOutcome]:
    """The latest outcome of each row of a shard's checkpoint, by row order (the merge reads the
    answers as columns instead: see :func:`arrow_checkpoint.latest`)."""
    return arrow_checkpoint.stored_outcomes(arrow_checkpoint.latest(path, endpoint))


def result_keys(path: Path) -> Iterator[str]:
    """The row identities of a result file, in file order."""
    pf = pq.ParquetFile(path, pre_buffer=False)
    column = "id" if "id" in pf.schema_arrow.names else "row_index"
    for batch in pf.iter_batches(columns=[column]):
        yield from (str(v) for v in batch.column(0).to_pylist())
