"""Reading a Parquet input: choosing and checking the prompt, image and id columns, and the request
body of each row's prompt; the result columns a job adds are named here too, since the input's
own columns must not take their names."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from anex_pipeline.errors import RejectedError
from anex_pipeline.formats import arrow_checkpoint
from anex_pipeline.formats.images import image_part
from anex_pipeline.formats.sounds import sound_url
from anex_pipeline.request_fields import AUDIO, POOLING, SCORING
from anex_pipeline.spec import (
    DUPLICATE_ID,
    INVALID_VALUE,
    MISSING_PARAMETER,
    URL_BY_ENDPOINT,
    Endpoint,
    InputRow,
    JobOptions,
    Problem,
)
from anex_pipeline.validate import check_body
from anex_pipeline.validate.answers import TokenBudget, labels_problems
from anex_pipeline.validate.problems import FieldProblem

T = TypeVar("T")
BATCH_ROWS = 16_384
SHARD_COLUMNS = ("i", "key", "value")
SHARD_IMAGE = "image"  # a fourth shard column when the job has an image_column
# A prompt made only of what str.strip() removes (every such character is at most U+3000).
_BLANK = "^[{}]*$".format("".join(f"\\x{{{c:x}}}" for c in range(0x3001) if chr(c).isspace()))
# The columns of each row's metadata in a result (option row_metadata).
ROW_METADATA = (
    pa.field("prompt_tokens", pa.int64()),
    pa.field("completion_tokens", pa.int64()),
    pa.field("finish_reason", pa.string()),
)
# The endpoints whose Parquet rows may ask for logprobs (option logprobs).
LOGPROBS_ENDPOINTS = frozenset({"chat", "completions"})
PROMPT_COLUMNS: dict[Endpoint, tuple[str, ...]] = {
    "chat": ("messages", "prompt"),
    "completions": ("prompt",),
    "embeddings": ("input", "text"),
    "responses": ("input", "prompt"),
    "classify": ("input", "text"),
    "transcriptions": ("file_url", "audio"),  # a sound's URL or bytes
    "translations": ("file_url", "audio"),
}


class ParquetInputError(RejectedError):
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
    """The option if set; otherwise embeddings for a file with only an input/text column, else chat.
    Score and rerank rows pair several texts, which a prompt column does not hold: refused."""
    if options.endpoint in SCORING:
        message = (
            f"a Parquet job cannot run {options.endpoint}: its rows pair several texts, which a prompt "
            f"column does not hold; write them as JSONL requests to {URL_BY_ENDPOINT[options.endpoint]}"
        )
        raise ParquetInputError([Problem(message, field="endpoint")])
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


def image_column_problem(schema: pa.Schema, endpoint: Endpoint, options: JobOptions) -> Problem | None:
    """Why the job's image_column cannot be used with this file, or None (also when it has none)."""
    name = options.image_column
    if name is None:
        return None
    if endpoint != "chat":
        return Problem(f"an image goes with a chat prompt, but this is a {endpoint} job", field="image_column")
    if name not in schema.names:
        return Problem(f"column '{name}' is not in the file (columns: {', '.join(schema.names)})", field="image_column")
    kind = schema.field(name).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or _is_bytes(kind)):
        return Problem(
            f"column '{name}' holds {kind}; an image column holds URL strings or the images' bytes (binary)",
            field="image_column",
        )
    return None


def _is_bytes(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind)


def result_fields(schema: pa.Schema, endpoint: Endpoint, options: JobOptions) -> list[pa.Field]:
    """The columns a job's result adds to the input's: ``row_index`` (when there is no ``id``), the
    answer (or embedding), ``error_type``, unless the ``row_metadata`` option is off the row's
    token counts and finish reason (an embedding has only its prompt's tokens) and, with the
    ``logprobs`` option, each generated token's logprobs."""
    added = [] if "id" in schema.names else [pa.field("row_index", pa.int64())]
    added.append(arrow_checkpoint.value_field(endpoint))
    if endpoint == "classify":
        added.append(arrow_checkpoint.PROBS_FIELD)
    if options.labels:
        added += [arrow_checkpoint.LABEL_FIELD, arrow_checkpoint.LABEL_PROB_FIELD]
    added.append(pa.field("error_type", pa.string()))
    if options.row_metadata:
        added += [f for f in ROW_METADATA if endpoint not in POOLING or f.name == "prompt_tokens"]
    if options.logprobs:
        added.append(arrow_checkpoint.LOGPROBS_FIELD)
    return added


def logprobs_problem(endpoint: Endpoint, options: JobOptions) -> Problem | None:
    """Why the job's ``logprobs`` option cannot apply to its endpoint, or None: an embedding
    generates no tokens, and a Responses object here carries no logprobs."""
    if not options.logprobs or endpoint in LOGPROBS_ENDPOINTS:
        return None
    if endpoint in POOLING:
        reason = f"an {endpoint} job generates no tokens, so there are no logprobs to give"
    else:
        reason = f"a {endpoint} job's answers carry no logprobs here; run the prompts with endpoint chat"
    return Problem(f"{reason}; remove logprobs and top_logprobs", field="logprobs")


def _logprobs_fields(endpoint: Endpoint, options: JobOptions) -> dict[str, Any]:
    """The request fields by which a row asks for the job's logprobs, in its endpoint's words:
    chat's ``logprobs: true`` and ``top_logprobs``, completions' ``logprobs: k``."""
    if not options.logprobs:
        return {}
    if endpoint == "completions":
        return {"logprobs": options.top_logprobs or 0}
    top = {} if options.top_logprobs is None else {"top_logprobs": options.top_logprobs}
    return {"logprobs": True, **top}


def _taken_names(schema: pa.Schema, endpoint: Endpoint, prompt: str, options: JobOptions) -> list[Problem]:
    """A problem for each input column that a result column would replace."""
    roles = {"row_index": "the row numbers", "error_type": "each row's error", "logprobs": "each token's logprobs"}
    roles.update(dict.fromkeys((f.name for f in ROW_METADATA), "each row's metadata"))
    options_off = dict.fromkeys((f.name for f in ROW_METADATA), "row_metadata")
    options_off[arrow_checkpoint.LOGPROBS_FIELD.name] = "logprobs"
    return [
        Problem(
            f"is a column the result writes ({roles.get(name, 'the answers')}), so its values would be lost; "
            "rename it in the file"
            + (" and set prompt_column to the new name" if name == prompt else "")
            + (f", or set the option {options_off[name]} to false" if name in options_off else ""),
            field=name,
        )
        for name in (f.name for f in result_fields(schema, endpoint, options))
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
    found = [image_column_problem(pf.schema_arrow, endpoint, options), logprobs_problem(endpoint, options)]
    option_problems = [p for p in found if p is not None] + labels_problems(endpoint, options)
    taken = _taken_names(pf.schema_arrow, endpoint, column, options)
    if taken or option_problems:
        yield from taken + option_problems
        return
    has_id = "id" in pf.schema_arrow.names
    columns = list(dict.fromkeys([column] + (["id"] if has_id else []) + [options.image_column or column]))
    index = 0
    budget = TokenBudget(options) if endpoint not in POOLING | AUDIO else None
    try:
        seen: dict[str, int] | None = None if not has_id or _ids_unique(pf) else {}
        for batch in made_ahead(pf.iter_batches(batch_size=BATCH_ROWS, columns=columns)):
            values = batch.column(column)
            indices = pa.array(np.arange(index, index + batch.num_rows, dtype=np.int64))
            if seen is None and not options.image_column and _plain_and_sound(values, endpoint):
                keys = (batch.column("id") if has_id else indices).cast(pa.string())
                found: Iterable[pa.RecordBatch | Problem] = [
                    pa.RecordBatch.from_arrays([indices, keys, values], names=SHARD_COLUMNS)
                ]
            else:
                found = _checked_rows(batch, column, has_id, index, seen, endpoint, options, model_names)
            for item in found:
                if budget is not None and isinstance(item, pa.RecordBatch):
                    budget.add_plain(item.num_rows)  # a row's body is the job's prompt and options
                yield item
            index += batch.num_rows
    except (pa.ArrowException, OSError) as exc:
        yield Problem(f"the Parquet data could not be read at row {index + 1}: {exc}")
        return
    if budget is not None and (over := budget.problem()) is not None:
        yield over


def _ids_unique(pf: pq.ParquetFile) -> bool:
    """True when the id column is text or integers with no null and no value twice."""
    ids = pf.read(columns=["id"]).column("id")
    if not (pa.types.is_integer(ids.type) or pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type)):
        return False
    return ids.null_count == 0 and pc.count_distinct(ids).as_py() == len(ids)


def _plain_and_sound(values: pa.Array, endpoint: Endpoint) -> bool:
    """True when every prompt is non-null text that passes its checks as it is."""
    if endpoint in AUDIO:  # each URL is checked on its own
        return False
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
    images = batch.column(options.image_column).to_pylist() if options.image_column else [None] * len(prompts)
    keep: list[int] = []
    keys: list[str] = []
    for n, (prompt, row_id, picture) in enumerate(zip(prompts, ids, images, strict=True)):
        number = offset + n + 1
        problems = []
        key = str(offset + n)
        if has_id:
            key = "" if row_id is None else str(row_id)
            if row_id is None:
                problems.append(Problem("is null; every row needs an id", number, "id", MISSING_PARAMETER))
            elif seen is not None and key in seen:
                problems.append(Problem(f"'{key}' is already used by row {seen[key]}", number, "id", DUPLICATE_ID))
            elif seen is not None:
                seen[key] = number
        try:
            body = request_body(prompt, endpoint, options, picture)
        except ValueError as exc:  # image or sound bytes of no known type, or a URL that can never be used
            problems.append(
                Problem(str(exc), number, column if endpoint in AUDIO else options.image_column, INVALID_VALUE)
            )
        else:
            found = _problems(prompt, body, column, endpoint, model_names)
            problems += [Problem(p.message.replace("body.", ""), number, column, p.code) for p in found]
        if problems:
            yield from problems
        else:
            keep.append(n)
            keys.append(key)
    if keep:
        taken = batch.take(pa.array(keep, pa.int64()))
        indices = pa.array([offset + n for n in keep], pa.int64())
        arrays = [indices, pa.array(keys, pa.string()), taken.column(column)]
        names = list(SHARD_COLUMNS)
        if options.image_column:
            arrays.append(taken.column(options.image_column))
            names.append(SHARD_IMAGE)
        yield pa.RecordBatch.from_arrays(arrays, names=names)


def request_body(
    value: Any, endpoint: Endpoint, options: JobOptions, image: str | bytes | None = None
) -> dict[str, Any]:
    """The OpenAI request body of one row's prompt value, with the job's system prompt and the
    row's image (from the image_column) added to its last message, and the job's logprobs asked
    for as a JSONL row asks for them. Raises ValueError for image bytes of no known image type."""
    if endpoint in ("embeddings", "classify"):
        return {"input": value}
    if endpoint in AUDIO:
        return {"file_url": sound_url(value) if isinstance(value, (str, bytes)) else value}
    if endpoint == "completions":
        return {"prompt": value, **_logprobs_fields(endpoint, options)}
    if endpoint == "responses":
        body = {"input": _without_nulls(value)}
        return {**body, "instructions": options.system_prompt} if options.system_prompt else body
    messages = [{"role": "user", "content": value}] if isinstance(value, str) else _without_nulls(value)
    if image is not None and isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        messages = [*messages[:-1], _with_image(messages[-1], image_part(image))]
    if options.system_prompt and isinstance(messages, list):
        messages = [{"role": "system", "content": options.system_prompt}, *messages]
    return {"messages": messages, **_logprobs_fields(endpoint, options)}


def _with_image(message: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """The message with an image part after its content (text becomes a text part)."""
    content = message.get("content")
    parts = content if isinstance(content, list) else [{"type": "text", "text": content}] if content else []
    return {**message, "content": [*parts, part]}


def _without_nulls(value: Any) -> Any:
    """A list of messages or items read from Arrow structs, without the fields a row left null
    (a struct column has every field any row has); any other value as it is."""
    if not isinstance(value, list):
        return value
    return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in value]


def _problems(
    value: Any, body: dict[str, Any], column: str, endpoint: Endpoint, model_names: frozenset[str]
) -> list[FieldProblem]:
    if value is None:
        return [FieldProblem(column, "is null; the row has nothing to send", MISSING_PARAMETER)]
    if isinstance(value, str) and not value.strip() and endpoint != "embeddings":
        return [FieldProblem(column, "is empty; there is no prompt to send")]
    return check_body(body, endpoint, model_names)


def chunk_rows(chunk: pa.RecordBatch, endpoint: Endpoint, options: JobOptions) -> Iterator[InputRow]:
    """The rows of a batch of shard rows, with their request bodies."""
    names = chunk.schema.names  # SHARD_COLUMNS, then SHARD_IMAGE when the job has an image column
    columns = zip(*(chunk.column(name).to_pylist() for name in names), strict=True)
    for index, key, value, *image in columns:
        yield InputRow(index=index, key=key, body=request_body(value, endpoint, options, *image))


def made_ahead(items: Iterator[T]) -> Iterator[T]:
    """The same items, each made on a second thread while the caller works on the one before it
    (pyarrow lets go of the GIL while it decodes, gathers and encodes)."""
    with ThreadPoolExecutor(1) as pool:
        coming = pool.submit(next, items, None)
        while (item := coming.result()) is not None:
            coming = pool.submit(next, items, None)
            yield item
