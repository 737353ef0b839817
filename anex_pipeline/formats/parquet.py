"""Parquet jobs: a prompt column in, the input's columns plus output columns out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from anex_pipeline.formats import InputRow, result_text
from anex_pipeline.spec import Endpoint, JobOptions, Problem, RowOutcome
from anex_pipeline.validate import check_body

BATCH_ROWS = 16_384
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
        return pq.ParquetFile(path)
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
    for name in PROMPT_COLUMNS[endpoint]:
        if name in names:
            return name
    wanted = " or ".join(f"'{n}'" for n in PROMPT_COLUMNS[endpoint])
    raise ParquetInputError(
        [
            Problem(
                f"a {endpoint} job needs a {wanted} column, or prompt_column naming one; "
                f"the file has: {', '.join(names)}"
            )
        ]
    )


def read_requests(
    path: Path, endpoint: Endpoint, model_names: frozenset[str], options: JobOptions
) -> Iterator[InputRow | Problem]:
    """Checks every row and yields a normalised request or the row's problems, in file order."""
    try:
        pf = open_input(path)
        column = prompt_column(pf.schema_arrow, endpoint, options)
    except ParquetInputError as exc:
        yield from exc.problems
        return
    has_id = "id" in pf.schema_arrow.names
    columns = [column] + (["id"] if has_id and column != "id" else [])
    seen: dict[str, int] = {}
    index = 0
    try:
        batches = pf.iter_batches(batch_size=BATCH_ROWS, columns=columns)
        for batch in batches:
            prompts = batch.column(column).to_pylist()
            ids = batch.column("id").to_pylist() if has_id else [None] * len(prompts)
            for prompt, row_id in zip(prompts, ids, strict=True):
                number = index + 1
                problems = []
                if has_id:
                    key = None if row_id is None else str(row_id)
                    if key is None:
                        problems.append(Problem("is null; every row needs an id", number, "id"))
                    elif key in seen:
                        problems.append(Problem(f"'{key}' is already used by row {seen[key]}", number, "id"))
                    else:
                        seen[key] = number
                else:
                    key = str(index)
                body, found = _body(prompt, column, endpoint, options, model_names)
                problems += [Problem(msg.replace("body.", ""), number, column) for _, msg in found]
                if problems:
                    yield from problems
                else:
                    yield InputRow(index=index, key=key or "", body=body)
                index += 1
    except (pa.ArrowException, OSError) as exc:
        yield Problem(f"the Parquet data could not be read at row {index + 1}: {exc}")


def _body(
    value: Any, column: str, endpoint: Endpoint, options: JobOptions, model_names: frozenset[str]
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    body: dict[str, Any]
    if endpoint == "embeddings":
        body = {"input": value}
    elif endpoint == "completions":
        body = {"prompt": value}
    else:
        if isinstance(value, str):
            messages: Any = [{"role": "user", "content": value}]
        elif isinstance(value, list):
            messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in value]
        else:
            messages = value
        if options.system_prompt and isinstance(messages, list):
            messages = [{"role": "system", "content": options.system_prompt}, *messages]
        body = {"messages": messages}
    if value is None:
        return body, [(column, "is null; the row has nothing to send")]
    if isinstance(value, str) and not value.strip() and endpoint != "embeddings":
        return body, [(column, "is empty; there is no prompt to send")]
    return body, check_body(body, endpoint, model_names)


def write_results(
    input_path: Path,
    out_path: Path,
    outcomes: Iterator[RowOutcome],
    endpoint: Endpoint,
) -> int:
    """Copies the input's columns and adds the result columns, keeping only rows with an outcome.

    ``outcomes`` must come in input order; rows without one (a job that stopped early) are left out.
    """
    pf = pq.ParquetFile(input_path)
    add_index = "id" not in pf.schema_arrow.names
    value_type = pa.list_(pa.float32()) if endpoint == "embeddings" else pa.string()
    value_name = "embedding" if endpoint == "embeddings" else "output"
    fields = [f for f in pf.schema_arrow if f.name not in ("row_index", value_name, "error_type")]
    schema = pa.schema(
        fields
        + ([pa.field("row_index", pa.int64())] if add_index else [])
        + [pa.field(value_name, value_type), pa.field("error_type", pa.string())]
    )
    pending = next(outcomes, None)
    written = 0
    offset = 0
    with pq.ParquetWriter(out_path, schema) as writer:
        for batch in pf.iter_batches(batch_size=BATCH_ROWS):
            keep, values, kinds = [], [], []
            for i in range(offset, offset + batch.num_rows):
                while pending is not None and pending.index < i:
                    pending = next(outcomes, None)
                if pending is None or pending.index != i:
                    continue
                keep.append(i - offset)
                values.append(_value(pending, endpoint))
                kinds.append(pending.error_type)
            taken = batch.take(pa.array(keep, pa.int64())) if len(keep) != batch.num_rows else batch
            cols = [taken.column(f.name) for f in fields]
            if add_index:
                cols.append(pa.array([offset + k for k in keep], pa.int64()))
            cols += [pa.array(values, value_type), pa.array(kinds, pa.string())]
            writer.write_batch(pa.RecordBatch.from_arrays(cols, schema=schema))
            written += len(keep)
            offset += batch.num_rows
    return written


def _value(outcome: RowOutcome, endpoint: Endpoint) -> Any:
    if outcome.body is None or outcome.error is not None:
        return None
    if endpoint == "embeddings":
        return outcome.body["data"][0]["embedding"]
    return result_text(endpoint, outcome.body)
