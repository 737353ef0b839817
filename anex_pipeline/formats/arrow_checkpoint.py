"""The checkpoint of a Parquet job's shard: an Arrow IPC stream of finished rows, in columns.

A Parquet result holds one answer text (or embedding) per row, so its checkpoint keeps exactly
that, its tokens' logprobs when the row asked for them, and what the report counts, as columns:
the merge then builds the result and the report with Arrow compute, never a Python object per
row. The file is one schema message followed by one record-batch message per appended chunk (no
end-of-stream marker, so appending is writing at the end). A writer killed mid-append leaves a
torn last message: readers stop before it, and the next append cuts it off first. Of the rows
written more than once (a failure, then a rerun), the last one written counts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from anex_pipeline.formats import (
    JSON_NULL,
    StoredOutcome,
    StoredUsage,
    finish_reason_of,
    text_of,
    token_logprobs_of,
    write_error,
)
from anex_pipeline.spec import Endpoint, RowOutcome

USAGE_COLUMNS = ("prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_prompt_tokens")
_READ_ERRORS = (pa.ArrowInvalid, OSError)  # what a torn message raises
WINDOW_ROWS = 65_536  # rows of a checkpoint copied at a time when reading it
_known_ends: dict[str, tuple[int, int]] = {}  # path -> (inode, size) after this process's last append
_ALTERNATIVE = pa.struct([pa.field("token", pa.string()), pa.field("logprob", pa.float64())])
# The logprobs of a row's answer: one entry per generated token, with its best alternatives.
LOGPROBS_FIELD = pa.field(
    "logprobs",
    pa.list_(
        pa.struct(
            [
                pa.field("token", pa.string()),
                pa.field("logprob", pa.float64()),  # completions: null for a token forced, never sampled
                pa.field("top_logprobs", pa.list_(_ALTERNATIVE)),
            ]
        )
    ),
)


def value_field(endpoint: Endpoint) -> pa.Field:
    """The result column a Parquet job adds: the answer text (a sound's as ``text``), the embedding,
    or a classify row's label."""
    if endpoint == "embeddings":
        return pa.field("embedding", pa.list_(pa.float32()))
    if endpoint == "classify":
        return pa.field("label", pa.string())
    if endpoint in ("transcriptions", "translations"):
        return pa.field("text", pa.string())
    return pa.field("output", pa.string())


# Result columns beside the value, kept in the checkpoint under their result names (null where
# the job has none): a classify row's probabilities, and the label and its probability of a job
# with the labels option.
PROBS_FIELD = pa.field("probs", pa.list_(pa.float64()))
LABEL_FIELD = pa.field("label", pa.string())
LABEL_PROB_FIELD = pa.field("label_prob", pa.float64())


def schema(endpoint: Endpoint) -> pa.Schema:
    return pa.schema(
        [
            pa.field("i", pa.int64()),
            pa.field("key", pa.string()),
            pa.field("status_code", pa.int32()),
            pa.field("error", pa.string()),  # the row's error as JSON; null for a completion
            pa.field("error_type", pa.string()),  # what the result's error_type column shows
            pa.field("flag", pa.string()),
            pa.field("format_error", pa.bool_()),
            *(pa.field(name, pa.int64()) for name in USAGE_COLUMNS),
            pa.field("reused", pa.bool_()),
            pa.field("finish_reason", pa.string()),
            pa.field("value", value_field(endpoint).type),
            LOGPROBS_FIELD,  # null unless the row asked for logprobs
            PROBS_FIELD,
            LABEL_FIELD,
            LABEL_PROB_FIELD,
        ]
    )


def append(path: Path, outcomes: Iterable[RowOutcome], endpoint: Endpoint) -> None:
    """Appends finished rows as one record batch and makes them durable before returning; a
    failed write (a full disk) is cut back off, so the file stays readable."""
    rows = list(outcomes)
    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    message = memoryview(_batch(rows, endpoint).serialize())
    if str(path) not in _known_ends:  # the first append of this process: the file may be older
        _upgrade(path, endpoint)
    with path.open("ab", buffering=0) as f:
        found = os.fstat(f.fileno())
        start = _good_end(path, found)
        try:
            if start < found.st_size:
                f.truncate(start)
            if start == 0:
                message = memoryview(schema(endpoint).serialize().to_pybytes() + message)
            while message:
                message = message[f.write(message) :]
            os.fsync(f.fileno())
        except OSError as exc:
            f.truncate(start)
            _known_ends.pop(str(path), None)
            raise write_error(exc, path) from None
        stat = os.fstat(f.fileno())
        _known_ends[str(path)] = (stat.st_ino, stat.st_size)


def _upgrade(path: Path, endpoint: Endpoint) -> None:
    """Rewrites a checkpoint written before a column was added (``finish_reason``, ``logprobs``), its rows
    given nulls there, so that the rows appended next share its schema. Written aside and
    renamed into place: a crash leaves the old file whole."""
    if not path.exists() or path.stat().st_size == 0:
        return
    wanted = schema(endpoint)
    try:
        with pa.memory_map(str(path)) as source:
            if pa.ipc.open_stream(source).schema.equals(wanted):
                return
    except _READ_ERRORS:  # not even the schema is whole: the append starts the file afresh
        return
    aside = path.with_name(f".{path.name}.upgrade")
    try:
        with aside.open("wb") as f:
            f.write(wanted.serialize().to_pybytes())
            for batch in whole_batches(path):
                f.write(_conformed(batch, wanted).serialize().to_pybytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(aside, path)
    except OSError as exc:
        aside.unlink(missing_ok=True)
        raise write_error(exc, path) from None


def _conformed(batch: pa.RecordBatch, wanted: pa.Schema) -> pa.RecordBatch:
    """A batch of an older checkpoint in the current schema: columns it lacks are null."""
    if batch.schema.equals(wanted):
        return batch
    names = batch.schema.names
    columns = [batch.column(f.name) if f.name in names else pa.nulls(batch.num_rows, f.type) for f in wanted]
    return pa.RecordBatch.from_arrays(columns, schema=wanted)


def _good_end(path: Path, stat: os.stat_result) -> int:
    """Where the last whole message of the file ends (0: not even the schema is whole)."""
    if _known_ends.get(str(path)) == (stat.st_ino, stat.st_size):  # as this process left it
        return stat.st_size
    if stat.st_size == 0:
        return 0
    end = 0
    with pa.memory_map(str(path)) as source:
        while True:
            try:
                pa.ipc.read_message(source)
            except (EOFError, *_READ_ERRORS):  # the end, or a torn message
                return end
            end = source.tell()


def _batch(rows: list[RowOutcome], endpoint: Endpoint) -> pa.RecordBatch:
    columns: dict[str, list[Any]] = {
        "i": [o.index for o in rows],
        "key": [o.key for o in rows],
        "status_code": [o.status_code for o in rows],
        "error": [json.dumps(o.error.as_dict()) if o.error else None for o in rows],
        "error_type": [o.error_type for o in rows],
        "flag": [o.completion_flag for o in rows],
        "format_error": [o.format_error for o in rows],
        **{name: [o.usage.get(name, 0) for o in rows] for name in USAGE_COLUMNS},
        "reused": [o.reused for o in rows],
        "finish_reason": [finish_reason_of(endpoint, o.body) if o.error is None else None for o in rows],
        "value": [_value(o, endpoint) for o in rows],
        "logprobs": [token_logprobs_of(endpoint, o.body) if o.error is None else None for o in rows],
        **{name: [_extra(o, endpoint, name) for o in rows] for name in ("probs", "label", "label_prob")},
    }
    return pa.RecordBatch.from_pydict(columns, schema=schema(endpoint))


def _value(o: RowOutcome, endpoint: Endpoint) -> Any:
    if o.error is not None or o.body is None:
        return None
    if endpoint == "embeddings":
        return o.body["data"][0]["embedding"]
    if endpoint == "classify":
        return o.body["data"][0]["label"]
    return text_of(endpoint, o.body)


def _extra(o: RowOutcome, endpoint: Endpoint, name: str) -> Any:
    """A result column beside the value (see PROBS_FIELD), from the row's body."""
    if o.error is not None or o.body is None:
        return None
    if endpoint == "classify":
        return o.body["data"][0]["probs"] if name == "probs" else None
    return (o.body.get("anex") or {}).get(name) if name != "probs" else None


def latest(path: Path, endpoint: Endpoint, window: int | None = None) -> Iterator[pa.Table]:
    """The last row written for each row index, by ascending index, in tables of at most
    ``window`` rows (default ``WINDOW_ROWS``). The file is memory-mapped, not read: what is
    copied is the row indices (8 bytes a row), the order to take them in when the file is not in
    order (8 more), and one window at a time."""
    window = window or WINDOW_ROWS
    wanted = schema(endpoint)
    table = pa.Table.from_batches([_conformed(b, wanted) for b in whole_batches(path)], schema=wanted)
    indices = table.column("i").to_numpy()
    if (np.diff(indices) > 0).all():  # simply appended in order, once each
        for start in range(0, table.num_rows, window):
            yield table.slice(start, window)
        return
    order = np.argsort(indices, kind="stable")  # equal indices keep their order of writing
    ordered = indices[order]
    order = order[np.append(ordered[1:] != ordered[:-1], True)]
    for start in range(0, len(order), window):
        yield _gather(table, order[start : start + window])


def _gather(table: pa.Table, positions: np.ndarray) -> pa.Table:
    """The table's rows at ``positions``, in that order, copying only those rows: each run of
    consecutive positions is a slice, and the slices are joined once. (Arrow's take over a table
    of many batches would first copy every batch into one array.)"""
    firsts = np.append(0, np.flatnonzero(np.diff(positions) != 1) + 1)
    lengths = np.diff(np.append(firsts, len(positions)))
    runs = [table.slice(positions[first], length) for first, length in zip(firsts, lengths, strict=True)]
    return pa.concat_tables(runs).combine_chunks()


def whole_batches(path: Path) -> Iterator[pa.RecordBatch]:
    """Every chunk appended to the file, in the order of writing, up to a torn one."""
    if not path.exists() or path.stat().st_size == 0:
        return
    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(path)))
        while True:
            yield reader.read_next_batch()
    except (StopIteration, *_READ_ERRORS):  # the end, or a torn last message: what came before it stands
        return


def stored_outcomes(tables: Iterable[pa.Table]) -> Iterator[StoredOutcome]:
    """The rows of :func:`latest` as the outcome records every format's readers share (the
    answer itself stays in the tables: ``body`` is null)."""
    names = ["i", "key", "status_code", "error", "flag", "format_error", *USAGE_COLUMNS, "reused"]
    for table in tables:
        yield from _stored(table.column(name).to_pylist() for name in names)


def _stored(columns: Iterator[list[Any]]) -> Iterator[StoredOutcome]:
    for i, key, status, error, flag, format_error, p, c, r, cached, reused in zip(*columns, strict=True):
        yield StoredOutcome(
            i=i,
            key=key,
            status_code=status,
            body=JSON_NULL,
            error=json.loads(error) if error is not None else None,
            flag=flag,
            format_error=format_error,
            usage=StoredUsage(p, c, r, cached),
            reused=reused,
        )
