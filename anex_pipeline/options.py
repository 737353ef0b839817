"""Job options from every source, through one parser and one set of messages.

The options file and the input's sidecar (``<input>.job.json``) of the command line, the inbox
sensors' defaults and sidecars, and the Batch API's ``metadata.anex_options`` are all JSON objects
read by :func:`options_from_json`; whatever layers a source has (flags over a file, a sidecar over
defaults, the request body over metadata) become :class:`~anex_pipeline.spec.JobOptions` through
:func:`job_options`, which refuses a bad option with a :class:`~anex_pipeline.spec.JobRejected`."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from anex_pipeline.errors import RejectedError
from anex_pipeline.spec import INVALID_JSON, INVALID_TYPE, INVALID_VALUE, JobOptions, JobRejected, Problem
from anex_pipeline.storage import FileTooLarge, read_regular_file
from anex_pipeline.validate import check_fields
from anex_pipeline.validate.answers import check_labels, check_logprobs, check_response_format
from anex_pipeline.validate.numbers import (
    MAX_CHOICES,
    NUMBER_FIELDS,
    check_numbers,
    deeper_than,
    non_finite_problems,
)
from anex_pipeline.validate.problems import KIND_WORDS, FieldProblem, kind_of, pydantic_code

SIDECAR_SUFFIX = ".job.json"  # <input>.job.json: the options that go with an input file
# Job options are read whole and then travel in Dagster run configs: an options file, a sidecar or
# an @file argument holds at most this many bytes (checked before it is read), and a value nests at
# most this deep (Dagster's serialiser of run configs gives up at a few hundred levels of lists).
MAX_OPTIONS_BYTES = 4 * 1024 * 1024
MAX_OPTIONS_DEPTH = 100
NESTED_TOO_DEEP = f"is JSON nested more than {MAX_OPTIONS_DEPTH} levels deep; flatten it"
# Request fields a job cannot set for all its rows, and what to do instead. A Parquet result has one
# answer per row, so several choices per prompt are a JSONL job's.
ROW_ONLY = {
    "n": (
        "is not a job option: a Parquet result holds one answer per row, so a Parquet job cannot ask for "
        f"several choices; write the prompts as JSONL requests, each body with its n (1 to {MAX_CHOICES})"
    ),
}
# pydantic's error types for a value of the wrong JSON kind, and the kind each one wants.
_WANTED_KIND = {
    "int_type": KIND_WORDS[int],
    "float_type": KIND_WORDS[float],
    "bool_type": KIND_WORDS[bool],
    "string_type": KIND_WORDS[str],
    "list_type": KIND_WORDS[list],
    "dict_type": KIND_WORDS[dict],
    "model_type": KIND_WORDS[dict],
}


class OptionsError(RejectedError):
    """Job options that cannot be read (not JSON, not an object, not a readable file); ``code`` is
    OpenAI's error code for the kind of problem, for the Batch API's answer."""

    def __init__(self, message: str, code: str = INVALID_VALUE):
        super().__init__(message)
        self.code = code


def sidecar_of(input_path: str | Path) -> Path:
    """The options file that goes with an input: ``<input>.job.json``."""
    return Path(f"{input_path}{SIDECAR_SUFFIX}")


def options_from_json(text: str | bytes, where: str) -> dict[str, Any]:
    """The JSON object of job options in ``text``, read from ``where`` (named in the messages)."""
    check_options_size(len(text), where, "bytes" if isinstance(text, bytes) else "characters")
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OptionsError(
            f"{where} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno}); "
            "write job options as one JSON object",
            INVALID_JSON,
        ) from None
    except UnicodeDecodeError as exc:
        raise OptionsError(f"{where} is not UTF-8 text (byte {exc.start + 1}); save it as UTF-8") from None
    except RecursionError:  # the standard library's reader gives up at about 1,000 levels
        raise OptionsError(f"{where} {NESTED_TOO_DEEP}", INVALID_JSON) from None
    if not isinstance(loaded, dict):
        raise OptionsError(f"{where} holds {kind_of(loaded)}; job options must be one JSON object", INVALID_TYPE)
    if deep := too_deep_options(loaded):
        raise OptionsError(f"{where}: option '{deep[0]}' {NESTED_TOO_DEEP}", INVALID_VALUE)
    return loaded


def too_deep_options(raw: dict[str, Any]) -> list[str]:
    """The options whose values nest lists and objects deeper than MAX_OPTIONS_DEPTH allows (the
    object of options being the first level)."""
    return [name for name, value in raw.items() if deeper_than(value, MAX_OPTIONS_DEPTH - 1)]


def check_options_size(size: int, where: str, unit: str = "bytes") -> None:
    """Raises OptionsError for job options of more than MAX_OPTIONS_BYTES (bytes, or characters of
    text already decoded), so that a reader can refuse them before it reads them."""
    if size > MAX_OPTIONS_BYTES:
        raise OptionsError(
            f"{where} holds {size:,} {unit}; job options take at most {MAX_OPTIONS_BYTES // (1024 * 1024)} MiB, "
            "so shorten it (a long system_prompt or schema included)"
        )


def read_text_file(path: str | Path, what: str) -> str:
    """The UTF-8 text of a regular file; a FIFO, device or folder is refused without waiting."""
    try:
        return read_regular_file(path, MAX_OPTIONS_BYTES).decode("utf-8")
    except FileTooLarge as exc:
        raise OptionsError(
            f"{what} {exc}; job options take at most {MAX_OPTIONS_BYTES // (1024 * 1024)} MiB, so shorten it "
            "(a long system_prompt or schema included)"
        ) from None
    except OSError as exc:
        raise OptionsError(f"cannot read {what} {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise OptionsError(f"{what} {path} is not UTF-8 text (byte {exc.start + 1}); save it as UTF-8") from None
    except ValueError as exc:
        raise OptionsError(f"{what} {exc}; name a JSON file") from None


def read_options_file(path: str | Path, what: str = "options file") -> dict[str, Any]:
    """The job options in a file (an options file or a sidecar)."""
    return options_from_json(read_text_file(path, what), f"{what} {path}")


def job_options(raw: dict[str, Any]) -> JobOptions:
    """The job options of a dict of option names and values (every source's layers merged), or
    raises JobRejected naming each bad option."""
    if deep := too_deep_options(raw):
        raise JobRejected([Problem(f"{NESTED_TOO_DEEP} (options)", field=name) for name in deep])
    if row_only := [name for name in raw if name in ROW_ONLY]:  # before their numbers' ranges
        raise JobRejected([Problem(f"{ROW_ONLY[name]} (options)", field=name) for name in row_only])
    _reject_numbers(raw)  # NaN would otherwise meet a bound's check first, with a puzzling message
    try:
        options = JobOptions.model_validate(raw)
    except ValidationError as exc:
        raise JobRejected([_option_problem(err) for err in exc.errors()]) from None
    if options.shards is not None and options.shard_rows is not None:
        raise JobRejected([Problem("set shards or shard_rows, not both (options)", field="shards")])
    found = check_fields(options.sampling_defaults(), "chat")  # the rows' defaults: a row's own ranges
    found += check_logprobs({"logprobs": options.logprobs, "top_logprobs": options.top_logprobs}, "chat")
    if found:
        raise JobRejected(_as_options(found))
    if options.labels is not None and (found := check_labels(options.labels)):
        raise JobRejected(_as_options(found))
    if options.response_format is not None:
        found = check_response_format(options.response_format, "response_format")
        if found:
            raise JobRejected(_as_options(found))
    if options.reasoning_parser is not None or options.tool_parser is not None:
        from anex_pipeline.engine.parsing import ParserChoiceError, check_parser_names  # imports vLLM

        try:
            check_parser_names(options.reasoning_parser, options.tool_parser)
        except ParserChoiceError as exc:
            raise JobRejected([Problem(f"{exc} (options)", field="reasoning_parser/tool_parser")]) from None
    return options


def _option_problem(err: Any) -> Problem:
    """A pydantic error of the options as a problem named by the option, worded as the rows' own
    checks word it (``must be an integer, got a boolean``)."""
    loc = ".".join(str(p) for p in err["loc"]) or "options"
    if err["type"] == "extra_forbidden":
        message = _unknown_option(err["loc"])
    elif err["type"] in _WANTED_KIND:
        message = f"must be {_WANTED_KIND[err['type']]}, got {kind_of(err['input'])}"
    else:
        message = err["msg"]
    return Problem(f"{message} (options)", field=loc, code=pydantic_code(err["type"]))


def _as_options(found: list[FieldProblem]) -> list[Problem]:
    """Problems of job options, each named as the option (the rows' own checks say ``body.``)."""
    return [Problem(f"{p.message} (options)", field=p.field.removeprefix("body."), code=p.code) for p in found]


def _reject_numbers(raw: dict[str, Any]) -> None:
    """Raises JobRejected for the options' number fields the engine cannot take, and for an
    infinity or NaN in any other option (a time limit, a price, a media timeout)."""
    found = check_numbers(raw) + list(non_finite_problems({k: v for k, v in raw.items() if k not in NUMBER_FIELDS}, ""))
    if found:
        raise JobRejected(_as_options(found))


def _unknown_option(loc: tuple[Any, ...]) -> str:
    """The message for an unknown key, with the closest known name when there is one."""
    model: Any = JobOptions
    for part in loc[:-1]:  # a nested option such as media.max_byte
        model = getattr(model.model_fields.get(str(part)), "annotation", None)
        if not isinstance(model, type) or not issubclass(model, BaseModel):
            return "is not a known option"
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return f"is not a known option; did you mean '{close[0]}'?" if close else "is not a known option"
