"""Reading a JSONL request file in the OpenAI batch format: every line checked, in file order,
into the problems of bad lines and the shard lines (``{"i", "key", "body"}``) of good ones."""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from anex_pipeline.request_fields import AUDIO, POOLING
from anex_pipeline.spec import (
    DUPLICATE_ID,
    ENDPOINT_BY_URL,
    INVALID_JSON,
    INVALID_TYPE,
    INVALID_VALUE,
    URL_BY_ENDPOINT,
    Endpoint,
    JobOptions,
    Problem,
)
from anex_pipeline.spec import MISSING_PARAMETER as MISSING
from anex_pipeline.validate import EngineTraits, check_body
from anex_pipeline.validate.answers import Constraints, TokenBudget, labels_problems
from anex_pipeline.validate.problems import kind_of

CHAT_URL = URL_BY_ENDPOINT["chat"]
MAX_LINE_BYTES = 32 * 1024 * 1024
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
_UTF8_BOM = b"\xef\xbb\xbf"
_GZIP_MAGIC = b"\x1f\x8b"
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_NO_BODY = msgspec.Raw(b"")
CHUNK_ROWS = 4096


class _Lines:
    """Numbered lines of a file as bytes, bounded in length so a huge line never fills memory."""

    def __init__(self, f: IO[bytes]):
        self.f = f

    def __iter__(self) -> Iterator[tuple[int, bytes | None]]:
        number = 0
        while True:
            chunk = self.f.readline(MAX_LINE_BYTES + 1)
            if not chunk:
                return
            number += 1
            if len(chunk) > MAX_LINE_BYTES and not chunk.endswith(b"\n"):
                while chunk and not chunk.endswith(b"\n"):  # skip the rest of the long line
                    chunk = self.f.readline(MAX_LINE_BYTES)
                yield number, None
                continue
            yield number, chunk


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1024 * 1024), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value; write a number or null")


def _decode(raw: bytes) -> tuple[Any, str | None]:
    """Parses one line; returns (value, None) or (None, reason)."""
    if b"\0" in raw:
        return (
            None,
            f"holds a NUL byte (0x00 at column {raw.index(0) + 1}); the file looks binary or UTF-16/32 "
            "encoded: save it as UTF-8 JSONL",
        )
    try:
        # The fast parser accepts only strict JSON (no NaN, no lone surrogates, bounded depth);
        # whatever it refuses goes through the standard library to name the problem.
        return msgspec.json.decode(raw), None
    except (msgspec.DecodeError, RecursionError):
        pass
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return (
            None,
            f"is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); save the file as UTF-8",
        )
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        return None, "is JSON nested too deeply to read"
    except json.JSONDecodeError as exc:
        return None, f"is not valid JSON: {exc.msg.removesuffix(' at')} at column {exc.colno}"
    except ValueError as exc:
        return None, f"is not valid JSON: {exc}"
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            return (
                None,
                f"holds a lone surrogate escape (\\u{ord(exc.object[exc.start]):04x}), which is not valid "
                "Unicode text; fix or remove it",
            )
    return value, None


def _first_endpoint(path: Path) -> Endpoint | None:
    """The endpoint named by the first line that carries a recognised url, if any."""
    with path.open("rb") as f:
        for _, raw in _Lines(f):
            if raw is None or not raw.strip():
                continue
            value, _ = _decode(raw.removeprefix(_UTF8_BOM))
            if isinstance(value, dict) and isinstance(value.get("url"), str) and value["url"] in ENDPOINT_BY_URL:
                return ENDPOINT_BY_URL[value["url"]]
    return None


def job_endpoint(path: Path, options: JobOptions) -> Endpoint:
    """The job's endpoint: the option if set, else the rows' url, else chat."""
    return options.endpoint or _first_endpoint(path) or "chat"


class _Request(msgspec.Struct):
    """The fields of a request line the fast path looks at; the body stays JSON text."""

    custom_id: str
    method: str = "POST"
    url: str | None = None
    body: msgspec.Raw = _NO_BODY


_decode_request = msgspec.json.Decoder(_Request).decode


def option_problem(options: JobOptions) -> Problem | None:
    """The job option a JSONL job cannot take: ``logprobs``, which its rows ask for themselves."""
    if not options.logprobs:
        return None
    return Problem(
        "is a Parquet job's option (its result's logprobs column); a JSONL row asks for logprobs in its "
        "own body (chat: logprobs and top_logprobs, completions: logprobs: k), so remove the option",
        field="logprobs",
    )


def read_chunks(
    path: Path,
    endpoint: Endpoint,
    model_names: frozenset[str],
    options: JobOptions,
    priority: bool | None = None,
    constraints: Constraints | None = None,
) -> Iterator[list[bytes] | Problem]:
    """Checks every line, in file order; yields the problems of bad lines and, for runs of good
    ones, their shard lines (``{"i", "key", "body"}``, the body passed through as written).
    ``priority``: whether the job's engine schedules by priority (see :class:`EngineTraits`).
    ``constraints`` gets the regexes and grammars of the accepted lines.

    A line that looks right is checked on a fast path (one typed decode); any other line takes
    the full path that names its problems. Ids used twice are named after the last line.
    """
    if (problem := option_problem(options)) is not None:
        yield problem
        return
    if labels := labels_problems(endpoint, options):
        yield from labels
        return
    ids = _Ids()
    index = 0
    chunk: list[bytes] = []
    traits = EngineTraits(
        _shortening(options.model) if endpoint == "embeddings" else None, priority, bool(options.labels)
    )
    budget = TokenBudget(options) if endpoint not in POOLING | AUDIO else None
    own_urls = {url for url, kind in ENDPOINT_BY_URL.items() if kind == endpoint}
    with path.open("rb") as f:
        head = f.read(4)
        if head.startswith(_UTF16_BOMS) or (len(head) == 4 and head[0] != 0 and head[1::2] == b"\0\0"):
            yield Problem("the file is UTF-16 or UTF-32 encoded; save it as UTF-8 JSONL", line=1)
            return
        if head.startswith(_GZIP_MAGIC):
            yield Problem("the file is gzip-compressed; decompress it and submit the JSONL inside", line=1)
            return
        f.seek(0)
        for number, raw in _Lines(f):
            if number == 1 and raw is not None:
                raw = raw.removeprefix(_UTF8_BOM)
            line = _fast_line(raw, own_urls, endpoint, model_names, traits)
            if line is not None:
                cid, body_json, body = line
                ids.add(cid, number)
                if budget is not None and (too_much := budget.add(body)) is not None:
                    if chunk:
                        yield chunk
                        chunk = []
                    yield Problem(too_much.message, number, too_much.field, too_much.code)
                    continue
                if constraints is not None:
                    constraints.add(body, number)
                chunk.append(_shard_line(index, cid, body_json))
                index += 1
                if len(chunk) == CHUNK_ROWS:
                    yield chunk
                    chunk = []
                continue
            if raw is None:
                problems = [Problem(f"is longer than {_size(MAX_LINE_BYTES)}; split or shorten it", line=number)]
            elif not raw.strip():
                continue
            else:
                value, reason = _decode(raw)
                if reason is not None:
                    problems = [Problem(reason, line=number, code=INVALID_JSON)]
                else:
                    problems = _check_line(value, endpoint, model_names, number, traits)
            if problems:
                if chunk:
                    yield chunk
                    chunk = []
                yield from problems
                continue
            ids.add(value["custom_id"], number)
            if budget is not None and (too_much := budget.add(value["body"])) is not None:
                if chunk:
                    yield chunk
                    chunk = []
                yield Problem(too_much.message, number, too_much.field, too_much.code)
                continue
            if constraints is not None:
                constraints.add(value["body"], number)
            chunk.append(_shard_line(index, value["custom_id"], msgspec.json.encode(value["body"])))
            index += 1
    if chunk:
        yield chunk
    yield from ids.repeated(path)
    if budget is not None and (over := budget.problem()) is not None:
        yield over


def _shard_line(index: int, key: str, body: bytes) -> bytes:
    return b'{"i":%d,"key":%b,"body":%b}\n' % (index, msgspec.json.encode(key), body)


class _Ids:
    """The custom_ids of the accepted lines, as 64-bit hashes beside their line numbers (16 bytes
    a row, whatever the ids' length); the ids used twice are found once the file is read."""

    def __init__(self) -> None:
        self.hashes = array("q")
        self.lines = array("q")

    def add(self, cid: str, number: int) -> None:
        self.hashes.append(hash(cid))
        self.lines.append(number)

    def repeated(self, path: Path) -> list[Problem]:
        """A problem for each line whose id an earlier line has (read again from the file: equal
        hashes may come from different ids)."""
        if len(self.hashes) < 2:
            return []
        # Sorted, equal hashes sit side by side (sorting takes far less memory than hashing them).
        ordered = pa.Array.from_buffers(pa.int64(), len(self.hashes), [None, pa.py_buffer(self.hashes)]).sort()
        same = pc.equal(ordered.slice(1), ordered.slice(0, len(ordered) - 1))
        if not pc.any(same).as_py():
            return []
        twice = set(ordered.slice(1).filter(same).to_pylist())
        wanted = {self.lines[n] for n, h in enumerate(self.hashes) if h in twice}
        first: dict[str, int] = {}
        problems = []
        with path.open("rb") as f:
            for number, raw in _Lines(f):
                if number not in wanted or raw is None:
                    continue
                cid = _decode(raw.removeprefix(_UTF8_BOM) if number == 1 else raw)[0]["custom_id"]
                if cid in first:
                    message = f"'{cid}' is already used on line {first[cid]}; ids must be unique"
                    problems.append(Problem(message, number, "custom_id", DUPLICATE_ID))
                else:
                    first[cid] = number
        return problems


def _fast_line(
    raw: bytes | None,
    own_urls: set[str],
    endpoint: Endpoint,
    model_names: frozenset[str],
    traits: EngineTraits,
) -> tuple[str, bytes, dict[str, Any]] | None:
    """(custom_id, body as JSON, body) for a line that passes every check; None when the line
    must go the full way (it may still be good)."""
    if raw is None:
        return None
    try:
        request = _decode_request(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    cid = request.custom_id
    if not cid or request.method != "POST" or request.body == _NO_BODY:
        return None
    if request.url is not None and request.url not in own_urls:
        return None
    try:
        body = msgspec.json.decode(request.body)
    except (msgspec.DecodeError, RecursionError):
        return None
    if type(body) is not dict or check_body(body, endpoint, model_names, traits):
        return None
    return cid, bytes(request.body), body


def _check_line(
    value: Any,
    endpoint: Endpoint,
    model_names: frozenset[str],
    number: int,
    traits: EngineTraits,
) -> list[Problem]:
    if not isinstance(value, dict):
        return [Problem("must be a JSON object with custom_id and body", line=number, code=INVALID_TYPE)]
    problems = []
    cid = value.get("custom_id")
    if "custom_id" not in value:
        problems.append(Problem("is required: a non-empty string that names the row", number, "custom_id", MISSING))
    elif not isinstance(cid, str) or not cid:
        kind = INVALID_TYPE if not isinstance(cid, str) else INVALID_VALUE
        problems.append(Problem(f"must be a non-empty string, got {kind_of(cid)}", number, "custom_id", kind))
    method = value.get("method", "POST")
    if method != "POST":
        problems.append(Problem(f"must be POST, got {json.dumps(method)}", number, "method"))
    url = value.get("url")
    if url is not None and not isinstance(url, str):
        problems.append(
            Problem(f"must be a string such as {CHAT_URL}, got {kind_of(url)}", number, "url", INVALID_TYPE)
        )
    elif url is not None and url not in ENDPOINT_BY_URL:
        problems.append(
            Problem(f"{json.dumps(url)} is not supported; use one of {', '.join(ENDPOINT_BY_URL)}", number, "url")
        )
    elif url is not None and ENDPOINT_BY_URL[url] != endpoint:
        problems.append(
            Problem(f"is {url} but this job's rows go to the {endpoint} endpoint; one endpoint per file", number, "url")
        )
    if "body" not in value:
        problems.append(Problem("is required: the request as the OpenAI API takes it", number, "body", MISSING))
    else:
        own = ENDPOINT_BY_URL.get(url, endpoint) if isinstance(url, str) else endpoint  # not the job's, if mixed
        problems += [
            Problem(p.message, number, p.field, p.code) for p in check_body(value["body"], own, model_names, traits)
        ]
    return problems


def _shortening(model: str) -> tuple[bool, list[int] | None] | None:
    """Whether an embedding model can shorten its vectors, and to which lengths (see
    :func:`~anex_pipeline.engine.models.matryoshka_dimensions`). The engine package sits
    above the file formats, so it is imported here, when an embeddings file is read."""
    from anex_pipeline.engine.models import matryoshka_dimensions, resolve_model

    return matryoshka_dimensions(resolve_model(model, "embeddings")[0])
