"""JSONL in the OpenAI batch format: request lines in, batch output envelopes out."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import msgspec

from anex_pipeline.formats import InputRow
from anex_pipeline.spec import ENDPOINT_BY_URL, URL_BY_ENDPOINT, Endpoint, JobOptions, Problem, RowOutcome
from anex_pipeline.validate import _kind, check_body

CHAT_URL = URL_BY_ENDPOINT["chat"]
MAX_LINE_BYTES = 32 * 1024 * 1024
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
_UTF8_BOM = b"\xef\xbb\xbf"
_GZIP_MAGIC = b"\x1f\x8b"
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


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


def read_requests(
    path: Path, endpoint: Endpoint, model_names: frozenset[str], options: JobOptions
) -> Iterator[InputRow | Problem]:
    """Checks every line and yields a normalised row or the line's problems, in file order."""
    seen: dict[str, int] = {}
    index = 0
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
            if raw is None:
                yield Problem(f"is longer than {_size(MAX_LINE_BYTES)}; split or shorten it", line=number)
                continue
            if not raw.strip():
                continue
            value, reason = _decode(raw)
            if reason is not None:
                yield Problem(reason, line=number)
                continue
            problems = _check_line(value, endpoint, model_names, seen, number)
            if problems:
                yield from problems
                continue
            seen[value["custom_id"]] = number
            body = _apply_job_prompt(value["body"], endpoint, options)
            yield InputRow(index=index, key=value["custom_id"], body=body)
            index += 1


def _check_line(
    value: Any, endpoint: Endpoint, model_names: frozenset[str], seen: dict[str, int], number: int
) -> list[Problem]:
    if not isinstance(value, dict):
        return [Problem("must be a JSON object with custom_id and body", line=number)]
    problems = []
    cid = value.get("custom_id")
    if "custom_id" not in value:
        problems.append(Problem("is required: a non-empty string that names the row", number, "custom_id"))
    elif not isinstance(cid, str) or not cid:
        problems.append(Problem(f"must be a non-empty string, got {_kind(cid)}", number, "custom_id"))
    elif cid in seen:
        problems.append(
            Problem(f"'{cid}' is already used on line {seen[cid]}; ids must be unique", number, "custom_id")
        )
    method = value.get("method", "POST")
    if method != "POST":
        problems.append(Problem(f"must be POST, got {json.dumps(method)}", number, "method"))
    url = value.get("url")
    if url is not None and not isinstance(url, str):
        problems.append(Problem(f"must be a string such as {CHAT_URL}, got {_kind(url)}", number, "url"))
    elif url is not None and url not in ENDPOINT_BY_URL:
        problems.append(
            Problem(f"{json.dumps(url)} is not supported; use one of {', '.join(ENDPOINT_BY_URL)}", number, "url")
        )
    elif url is not None and ENDPOINT_BY_URL[url] != endpoint:
        problems.append(
            Problem(f"is {url} but this job's rows go to the {endpoint} endpoint; one endpoint per file", number, "url")
        )
    if "body" not in value:
        problems.append(Problem("is required: the request as the OpenAI API takes it", number, "body"))
    else:
        own = ENDPOINT_BY_URL.get(url, endpoint) if isinstance(url, str) else endpoint  # not the job's, if mixed
        problems += [Problem(msg, number, fld) for fld, msg in check_body(value["body"], own, model_names)]
    return problems


def _apply_job_prompt(body: dict[str, Any], endpoint: Endpoint, options: JobOptions) -> dict[str, Any]:
    """Prepends the job's system_prompt to a chat row that has no system message of its own."""
    if endpoint != "chat" or not options.system_prompt:
        return body
    if any(m.get("role") in ("system", "developer") for m in body["messages"]):
        return body
    return {**body, "messages": [{"role": "system", "content": options.system_prompt}, *body["messages"]]}


def envelope(outcome: RowOutcome) -> dict[str, Any]:
    """The OpenAI batch output line for one row."""
    return {
        "id": f"batch_req_{outcome.key}",
        "custom_id": outcome.key,
        "response": {
            "status_code": outcome.status_code,
            "request_id": f"req_{outcome.key}",
            "body": outcome.body if outcome.error is None else None,
        },
        "error": outcome.error.as_dict() if outcome.error is not None else None,
    }


def write_results(path: Path, outcomes: Iterable[RowOutcome]) -> int:
    """Writes one envelope line per outcome; returns the number of lines."""
    count = 0
    with path.open("w", encoding="utf-8") as f:
        for outcome in outcomes:
            f.write(msgspec.json.encode(envelope(outcome)).decode("utf-8"))
            f.write("\n")
            count += 1
    return count
