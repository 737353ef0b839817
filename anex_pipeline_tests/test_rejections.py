"""A corpus of malformed jobs: each one is rejected at submit time, with its line and field.

Every case goes through the command line twice, as ``validate`` and as ``run``. Both must exit
with code 2, print a message to stderr that names the offending line (and the field, where one
applies) and no traceback, and ``run`` must write neither a result file nor a report and never
reach the engine.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anex_pipeline.cli import main
from anex_pipeline.formats import jsonl_input
from anex_pipeline.spec import Problem
from anex_pipeline.stages.submit import MAX_REPORTED_PROBLEMS, Problems

CHAT_URL = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Say hello in French."}]


def chat(cid: Any = "row-1", **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": CHAT_URL, "body": {"messages": MESSAGES, **body}}


def completion(cid: str = "row-1", **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "url": "/v1/completions", "body": body}


def embedding(cid: str = "row-1", **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "url": "/v1/embeddings", "body": body}


def jsonl_bytes(*rows: Any) -> bytes:
    """One line per row: dicts are dumped as JSON, str and bytes are written as they are."""
    out = b""
    for row in rows:
        if isinstance(row, bytes):
            out += row
        elif isinstance(row, str):
            out += row.encode("utf-8")
        else:
            out += json.dumps(row).encode("utf-8")
        out += b"\n"
    return out


def parquet_writer(columns: dict[str, list[Any]]) -> Callable[[Path], None]:
    return lambda path: pq.write_table(pa.table(columns), path)


def schema_format(json_schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": json_schema}


@dataclass(frozen=True)
class Case:
    """A bad job: its input file, optional options file and flags, and what the message must say."""

    content: bytes | Callable[[Path], None] | None  # None: the input path is never created
    line: int | None = None  # the line (or Parquet row) the message must name
    field: str | None = None  # the field the message must name
    says: tuple[str, ...] = ()  # further words the message must contain
    name: str = "in.jsonl"
    options: dict[str, Any] | bytes | None = None  # written to job.json and passed with --options
    flags: tuple[str, ...] = ()
    max_line_bytes: int | None = None  # shrinks the JSONL reader's line limit for the case


def case(case_id: str, content: Any, **kw: Any) -> Any:
    return pytest.param(Case(content, **kw), id=case_id)


GOOD = chat("ok-1")
DEEP = b"[" * 100_000
DEEP_5000 = b"[" * 5000 + b"]" * 5000
BOOL = ("got a boolean",)
NESTED = ("nested more than 100 levels",)


def nested_schema(levels: int) -> dict[str, Any]:
    """A JSON schema of objects inside objects, ``levels`` deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def image_row(cid: str, url: str) -> dict[str, Any]:
    parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"custom_id": cid, "body": {"messages": [{"role": "user", "content": parts}]}}


def input_image_row(cid: str, url: str) -> dict[str, Any]:
    parts = [{"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": url}]
    return {"custom_id": cid, "url": "/v1/responses", "body": {"input": [{"role": "user", "content": parts}]}}


IMAGE_FIELD = "body.messages[0].content[1].image_url"
SEVERAL = ["one text", "another text"]

CASES = [
    # --- the file as a whole -------------------------------------------------------------------
    case("nonexistent-path", None, says=("does not exist",)),
    case("input-is-a-directory", lambda p: p.mkdir(), says=("is not a file",)),
    case("empty-file", b"", says=("empty", "no rows")),
    case("only-blank-lines", b"\n\n   \n\t\n\r\n", says=("no rows",)),
    case("binary-garbage", random.Random(7).randbytes(3000), line=1),
    case("gzip-compressed-jsonl", gzip.compress(jsonl_bytes(GOOD)), says=("gzip",)),
    case("utf16-with-bom", jsonl_bytes(GOOD).decode().encode("utf-16"), line=1, says=("UTF-16", "UTF-8")),
    case("utf16-without-bom", jsonl_bytes(GOOD).decode().encode("utf-16-le"), line=1, says=("UTF-8",)),
    case("all-nul-bytes", b"\0" * 64, line=1, says=("NUL",)),
    # --- lines that are not JSON objects -------------------------------------------------------
    case("broken-json", jsonl_bytes(GOOD, '{"custom_id": "row-2", "body": {'), line=2, says=("not valid JSON",)),
    case("trailing-comma", jsonl_bytes(GOOD, GOOD | {"custom_id": "r2"}, '{"custom_id": "r3",}'), line=3),
    case(
        "nan-is-not-json",
        jsonl_bytes(
            GOOD, '{"custom_id": "r2", "body": {"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}}'
        ),
        line=2,
        says=("NaN",),
    ),
    case("line-is-array", jsonl_bytes(GOOD, [GOOD]), line=2, says=("JSON object",)),
    case("line-is-number", jsonl_bytes(GOOD, "42"), line=2, says=("JSON object",)),
    case("line-is-string", jsonl_bytes(GOOD, '"row"'), line=2, says=("JSON object",)),
    case("line-is-null", jsonl_bytes(GOOD, "null"), line=2, says=("JSON object",)),
    case("invalid-utf8", jsonl_bytes(GOOD, b'{"custom_id": "r\xff\xfe2", "body": {}}'), line=2, says=("UTF-8",)),
    case("nul-byte-in-line", jsonl_bytes(GOOD, b'{"custom_id": "r\x002", "body": {}}'), line=2, says=("NUL",)),
    case(
        "lone-surrogate-escape",
        jsonl_bytes(GOOD, r'{"custom_id": "r2", "body": {"messages": [{"role": "user", "content": "\ud800"}]}}'),
        line=2,
        says=("surrogate",),
    ),
    case("deeply-nested", jsonl_bytes(GOOD, DEEP), line=2, says=("nested",)),
    case(
        "deeply-nested-body",
        jsonl_bytes(GOOD, b'{"custom_id": "r2", "body": ' + DEEP + b"]" * 100_000 + b"}"),
        line=2,
        says=("nested",),
    ),
    case(
        "huge-line",
        jsonl_bytes(GOOD, chat("big", max_tokens=5) | {"pad": "x" * 5000}, "not json"),
        line=2,
        says=("longer than 1 KiB", "line 3"),
        max_line_bytes=1024,
    ),
    # --- custom_id ------------------------------------------------------------------------------
    case("missing-custom-id", jsonl_bytes(GOOD, {"body": {"messages": MESSAGES}}), line=2, field="custom_id"),
    case("empty-custom-id", jsonl_bytes(GOOD, chat("")), line=2, field="custom_id"),
    case("numeric-custom-id", jsonl_bytes(GOOD, chat(2)), line=2, field="custom_id", says=("string, got a number",)),
    case("null-custom-id", jsonl_bytes(GOOD, chat(None)), line=2, field="custom_id"),
    case("list-custom-id", jsonl_bytes(GOOD, chat(["a"])), line=2, field="custom_id"),
    case(
        "duplicate-custom-id",
        jsonl_bytes(chat("a"), chat("b"), chat("c"), chat("b")),
        line=4,
        field="custom_id",
        says=("line 2",),
    ),
    # --- method and url -------------------------------------------------------------------------
    case("method-get", jsonl_bytes(GOOD, chat("r2") | {"method": "GET"}), line=2, field="method"),
    case("unsupported-url", jsonl_bytes(GOOD, chat("r2") | {"url": "/v1/responses"}), line=2, field="url"),
    case("url-not-a-string", jsonl_bytes(GOOD, chat("r2") | {"url": ["/v1/completions"]}), line=2, field="url"),
    case("url-on-first-line-a-list", jsonl_bytes(chat("r1") | {"url": {"a": 1}}, GOOD), line=1, field="url"),
    case(
        "mixed-endpoints",
        jsonl_bytes(GOOD, completion("r2", prompt="Once upon a time")),
        line=2,
        field="url",
        says=("one endpoint per file", "1 problem(s)"),  # its body is a fine completions body
    ),
    # --- body -----------------------------------------------------------------------------------
    case("missing-body", jsonl_bytes(GOOD, {"custom_id": "r2", "url": CHAT_URL}), line=2, field="body"),
    case("body-is-string", jsonl_bytes(GOOD, {"custom_id": "r2", "body": "hello"}), line=2, field="body"),
    case("body-is-list", jsonl_bytes(GOOD, {"custom_id": "r2", "body": [MESSAGES]}), line=2, field="body"),
    case("chat-without-messages", jsonl_bytes(GOOD, {"custom_id": "r2", "body": {}}), line=2, field="body.messages"),
    case("chat-empty-messages", jsonl_bytes(GOOD, chat("r2", messages=[])), line=2, field="body.messages"),
    case("chat-messages-not-list", jsonl_bytes(GOOD, chat("r2", messages="hi")), line=2, field="body.messages"),
    case(
        "chat-message-without-role",
        jsonl_bytes(GOOD, chat("r2", messages=[{"content": "hi"}])),
        line=2,
        field="body.messages[0].role",
    ),
    case(
        "chat-message-bad-role",
        jsonl_bytes(GOOD, chat("r2", messages=[{"role": "robot", "content": "hi"}])),
        line=2,
        field="body.messages[0].role",
    ),
    case(
        "chat-message-not-object",
        jsonl_bytes(GOOD, chat("r2", messages=["hi"])),
        line=2,
        field="body.messages[0]",
    ),
    case(
        "completions-without-prompt",
        jsonl_bytes(completion("r1", prompt="a"), completion("r2", max_tokens=3)),
        line=2,
        field="body.prompt",
    ),
    case(
        "embeddings-without-input",
        jsonl_bytes(embedding("r1", input="a"), embedding("r2")),
        line=2,
        field="body.input",
    ),
    case(
        "embeddings-over-openai-input-limit",
        jsonl_bytes(embedding("r1", input=SEVERAL), embedding("r2", input=["x"] * 2049)),
        line=2,
        field="body.input",
        says=("2049 prompts", "at most 2048"),
    ),
    case(
        "embeddings-token-ids-over-openai-limit",
        jsonl_bytes(embedding("r1", input=[1, 2]), embedding("r2", input=[[1, 2], [7] * 8193])),
        line=2,
        field="body.input[1]",
        says=("8193 token ids", "at most 8192"),
    ),
    case(
        "embeddings-negative-token-id",
        jsonl_bytes(embedding("r1", input=[[1, 2]]), embedding("r2", input=[[1, 2], [3, -4]])),
        line=2,
        field="body.input[1][1]",
        says=("-4", "not a token id"),
    ),
    case(
        "embeddings-mixed-shapes",
        jsonl_bytes(embedding("r1", input="a"), embedding("r2", input=["a", [1, 2]])),
        line=2,
        field="body.input[1]",
        says=("use one shape",),
    ),
    case(
        "embeddings-empty-list",
        jsonl_bytes(embedding("r1", input="a"), embedding("r2", input=[])),
        line=2,
        field="body.input",
        says=("an empty list",),
    ),
    case(
        "embeddings-empty-text-in-list",
        jsonl_bytes(embedding("r1", input="a"), embedding("r2", input=["a", ""])),
        line=2,
        field="body.input[1]",
        says=("empty string",),
    ),
    case(
        "embeddings-unknown-encoding",
        jsonl_bytes(embedding("r1", input="a"), embedding("r2", input="b", encoding_format="int8")),
        line=2,
        field="body.encoding_format",
        says=("float, base64",),
    ),
    case(
        "embeddings-dimensions-on-a-model-that-cannot-shorten",
        jsonl_bytes(embedding("r1", input="a"), embedding("r2", input="b", dimensions=128)),
        line=2,
        field="body.dimensions",
        says=("all-MiniLM-L6-v2", "not a Matryoshka model"),
    ),
    case(
        "completions-over-the-prompt-limit",
        jsonl_bytes(completion("r1", prompt=SEVERAL), completion("r2", prompt=["go on"] * 2049)),
        line=2,
        field="body.prompt",
        says=("2049 prompts", "at most 2048"),
    ),
    case(
        "other-model",
        jsonl_bytes(GOOD, chat("r2", model="gpt-4o")),
        line=2,
        field="body.model",
        says=("gpt-4o",),
    ),
    case("model-not-a-string", jsonl_bytes(GOOD, chat("r2", model=["gpt-4o"])), line=2, field="body.model"),
    case("stream-true", jsonl_bytes(GOOD, chat("r2", stream=True)), line=2, field="body.stream"),
    case("n-129", jsonl_bytes(GOOD, chat("r2", n=129)), line=2, field="body.n", says=("1 to 128",)),
    case("n-0", jsonl_bytes(GOOD, chat("r2", n=0)), line=2, field="body.n"),
    # --- vLLM's structured outputs: one kind, bounded in size ------------------------------------
    case(
        "structured-two-kinds",
        jsonl_bytes(GOOD, chat("r2", structured_outputs={"choice": ["a"], "regex": "a"})),
        line=2,
        field="body.structured_outputs",
        says=("exactly one",),
    ),
    case(
        "structured-unknown-kind",
        jsonl_bytes(GOOD, chat("r2", structured_outputs={"ebnf": "x"})),
        line=2,
        field="body.structured_outputs",
        says=("ebnf",),
    ),
    case(
        "structured-and-response-format",
        jsonl_bytes(GOOD, chat("r2", structured_outputs={"regex": "a"}, response_format={"type": "json_object"})),
        line=2,
        field="body.structured_outputs",
    ),
    case(
        "structured-choice-empty",
        jsonl_bytes(GOOD, chat("r2", structured_outputs={"choice": []})),
        line=2,
        field="body.structured_outputs.choice",
    ),
    case(
        "structured-regex-huge",
        jsonl_bytes(GOOD, chat("r2", structured_outputs={"regex": "(a|b)*" * 3000})),
        line=2,
        field="body.structured_outputs.regex",
        says=("16,384",),
    ),
    case(
        "structured-grammar-not-text",
        jsonl_bytes(GOOD, chat("r2", structured_outputs={"grammar": 5})),
        line=2,
        field="body.structured_outputs.grammar",
    ),
    case(
        "structured-choice-many",
        jsonl_bytes(GOOD, chat("r2", structured_outputs={"choice": ["x"] * 1025})),
        line=2,
        field="body.structured_outputs.choice",
    ),
    case("bad-words-not-strings", jsonl_bytes(GOOD, chat("r2", bad_words=[1])), line=2, field="body.bad_words"),
    case(
        "allowed-token-ids-negative",
        jsonl_bytes(GOOD, chat("r2", allowed_token_ids=[-1])),
        line=2,
        field="body.allowed_token_ids",
    ),
    # --- forced tool calls: a function the row offers -------------------------------------------
    case(
        "tool-choice-unknown-function",
        jsonl_bytes(
            GOOD,
            chat(
                "r2",
                tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
                tool_choice={"type": "function", "function": {"name": "get_time"}},
            ),
        ),
        line=2,
        field="body.tool_choice.function.name",
        says=("get_weather",),
    ),
    case(
        "tool-choice-required-without-tools",
        jsonl_bytes(GOOD, chat("r2", tool_choice="required")),
        line=2,
        field="body.tool_choice",
        says=("no function",),
    ),
    case(
        "tool-choice-word",
        jsonl_bytes(
            GOOD,
            chat(
                "r2",
                tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
                tool_choice="always",
            ),
        ),
        line=2,
        field="body.tool_choice",
        says=("required",),
    ),
    case(
        "tool-choice-shape",
        jsonl_bytes(
            GOOD,
            chat(
                "r2",
                tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
                tool_choice={"name": "get_weather"},
            ),
        ),
        line=2,
        field="body.tool_choice",
    ),
    case("n-greedy", jsonl_bytes(GOOD, chat("r2", n=2, temperature=0)), line=2, field="body.n", says=("temperature",)),
    case("n-a-string", jsonl_bytes(GOOD, chat("r2", n="3")), line=2, field="body.n"),
    case(
        "n-times-max-tokens",
        jsonl_bytes(GOOD, chat("r2", n=128, max_tokens=8193)),
        line=2,
        field="body.n",
        says=("1,048,576", "n x max_tokens"),
    ),
    case(
        "logprobs-over-a-rows-bound",
        jsonl_bytes(GOOD, chat("r2", n=4, max_tokens=30_000, temperature=1, logprobs=True, top_logprobs=20)),
        line=2,
        field="body.top_logprobs",
        says=("2,520,000", "2,097,152"),
    ),
    case(
        "completions-logprobs-over-a-rows-bound",
        jsonl_bytes(
            {
                "custom_id": "c1",
                "url": "/v1/completions",
                "body": {"prompt": "x", "max_tokens": 200_000, "logprobs": 20},
            }
        ),
        line=1,
        field="body.logprobs",
        says=("4,200,000",),
    ),
    case(
        "job-over-the-default-token-budget",
        jsonl_bytes(*(chat(f"r{i}", n=128, max_tokens=8192, temperature=1) for i in range(2**14 + 1))),
        field="max_job_tokens",
        says=("17,180,917,760", "17,179,869,184"),
    ),
    case(
        "job-over-its-own-token-budget",
        jsonl_bytes(chat("r1", n=4, max_tokens=10, temperature=1), chat("r2")),
        options={"max_job_tokens": 1000},
        field="max_job_tokens",
        says=("1,064",),  # 4 x 10, and 1,024 for the row with no cap
    ),
    case(
        "completions-prompts-over-the-token-budget",
        jsonl_bytes(completion("r1", prompt=["a", "b", "c"], max_tokens=40, n=2)),
        options={"max_job_tokens": 200},
        field="max_job_tokens",
        says=("240",),  # 3 prompts x 2 choices x 40
    ),
    case(
        "parquet-over-the-token-budget",
        parquet_writer({"prompt": ["a", "b", "c"]}),
        name="in.parquet",
        options={"max_job_tokens": 100, "max_tokens": 40},
        field="max_job_tokens",
        says=("120",),
    ),
    case(
        "responses-n",
        jsonl_bytes({"custom_id": "r1", "url": "/v1/responses", "body": {"input": "hi", "n": 2}}),
        line=1,
        field="body.n",
    ),
    case(
        "row-response-format-xml",
        jsonl_bytes(GOOD, chat("r2", response_format={"type": "xml"})),
        line=2,
        field="body.response_format.type",
    ),
    case(
        "row-response-format-flat-schema",
        jsonl_bytes(GOOD, chat("r2", response_format=schema_format({"name": "x", "type": "object"}))),
        line=2,
        field="body.response_format.json_schema.schema",
    ),
    case(
        "row-response-format-string",
        jsonl_bytes(GOOD, chat("r2", response_format="json_object")),
        line=2,
        field="body.response_format",
    ),
    # --- numbers the engine cannot take ---------------------------------------------------------
    case("seed-beyond-64-bits", jsonl_bytes(GOOD, chat("r2", seed=18446744073709551621)), line=2, field="body.seed"),
    case("seed-below-64-bits", jsonl_bytes(GOOD, chat("r2", seed=-(2**63) - 1)), line=2, field="body.seed"),
    case("max-tokens-zero", jsonl_bytes(GOOD, chat("r2", max_tokens=0)), line=2, field="body.max_tokens"),
    case("max-tokens-huge", jsonl_bytes(GOOD, chat("r2", max_tokens=10**20)), line=2, field="body.max_tokens"),
    case(
        "max-completion-tokens-huge",
        jsonl_bytes(GOOD, chat("r2", max_completion_tokens=2**31)),
        line=2,
        field="body.max_completion_tokens",
    ),
    case("top-k-below-minus-one", jsonl_bytes(GOOD, chat("r2", top_k=-2)), line=2, field="body.top_k"),
    case("min-tokens-negative", jsonl_bytes(GOOD, chat("r2", min_tokens=-1)), line=2, field="body.min_tokens"),
    case(
        "completions-seed-beyond-64-bits",
        jsonl_bytes(completion("r1", prompt="a"), completion("r2", prompt="b", seed=2**64)),
        line=2,
        field="body.seed",
    ),
    case(
        "logit-bias-key-not-a-token",
        jsonl_bytes(GOOD, chat("r2", logit_bias={"hello": 5})),
        line=2,
        field="body.logit_bias.hello",
    ),
    case(
        "logit-bias-beyond-100",
        jsonl_bytes(GOOD, chat("r2", logit_bias={"42": 1000})),
        line=2,
        field="body.logit_bias.42",
    ),
    case("logit-bias-a-list", jsonl_bytes(GOOD, chat("r2", logit_bias=[1, 2])), line=2, field="body.logit_bias"),
    case(
        "temperature-1e999",
        jsonl_bytes(GOOD, json.dumps(chat("r2", temperature=0.5)).replace("0.5", "1e999")),
        line=2,
        field="body.temperature",
        says=("finite",),
    ),
    case(
        "presence-penalty-minus-1e999",
        jsonl_bytes(GOOD, json.dumps(chat("r2", presence_penalty=0.5)).replace("0.5", "-1e999")),
        line=2,
        field="body.presence_penalty",
    ),
    case(
        "logit-bias-value-1e999",
        jsonl_bytes(GOOD, json.dumps(chat("r2", logit_bias={"42": 0.5})).replace("0.5", "1e999")),
        line=2,
        field="body.logit_bias.42",
    ),
    # --- logprobs: the counts' bounds and the shape each endpoint asks in ------------------------
    case(
        "top-logprobs-21",
        jsonl_bytes(GOOD, chat("r2", logprobs=True, top_logprobs=21)),
        line=2,
        field="body.top_logprobs",
        says=("0 to 20",),
    ),
    case(
        "top-logprobs-negative",
        jsonl_bytes(GOOD, chat("r2", logprobs=True, top_logprobs=-1)),
        line=2,
        field="body.top_logprobs",
    ),
    case(
        "top-logprobs-without-logprobs",
        jsonl_bytes(GOOD, chat("r2", top_logprobs=3)),
        line=2,
        field="body.top_logprobs",
        says=("needs logprobs: true",),
    ),
    case(
        "chat-logprobs-count",
        jsonl_bytes(GOOD, chat("r2", logprobs=3)),
        line=2,
        field="body.logprobs",
        says=("true or false",),
    ),
    case(
        "completions-logprobs-21",
        jsonl_bytes(completion("r1", prompt="a"), completion("r2", prompt="b", logprobs=21)),
        line=2,
        field="body.logprobs",
        says=("0 to 20",),
    ),
    case(
        "completions-logprobs-true",
        jsonl_bytes(completion("r1", prompt="a"), completion("r2", prompt="b", logprobs=True)),
        line=2,
        field="body.logprobs",
        says=("number of alternatives",),
    ),
    case(
        "completions-top-logprobs",
        jsonl_bytes(completion("r1", prompt="a"), completion("r2", prompt="b", logprobs=2, top_logprobs=2)),
        line=2,
        field="body.top_logprobs",
    ),
    # --- media URLs that can never be fetched ----------------------------------------------------
    case(
        "image-file-url",
        jsonl_bytes(GOOD, image_row("r2", "file:///etc/passwd")),
        line=2,
        field=IMAGE_FIELD,
        says=("not file: URLs",),
    ),
    case(
        "image-javascript-url",
        jsonl_bytes(GOOD, image_row("r2", "javascript:alert(1)")),
        line=2,
        field=IMAGE_FIELD,
        says=("not javascript: URLs",),
    ),
    case(
        "image-ftp-url",
        jsonl_bytes(GOOD, image_row("r2", "ftp://files.example.com/a.png")),
        line=2,
        field=IMAGE_FIELD,
        says=("not ftp: URLs",),
    ),
    case(
        "image-url-without-scheme",
        jsonl_bytes(GOOD, image_row("r2", "images.example.com/a.png")),
        line=2,
        field=IMAGE_FIELD,
        says=("without a scheme",),
    ),
    case(
        "image-url-without-host",
        jsonl_bytes(GOOD, image_row("r2", "https:///a.png")),
        line=2,
        field=IMAGE_FIELD,
        says=("names no host",),
    ),
    case(
        "audio-url-file",
        jsonl_bytes(
            GOOD,
            {
                "custom_id": "r2",
                "body": {
                    "messages": [
                        {"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "file:///a.wav"}}]}
                    ]
                },
            },
        ),
        line=2,
        field="body.messages[0].content[0].audio_url",
        says=("not file: URLs",),
    ),
    case(
        "responses-input-image-file-url",
        jsonl_bytes(input_image_row("r1", "https://images.example.com/a.png"), input_image_row("r2", "file:///x")),
        line=2,
        field="body.input[0].content[1].image_url",
        says=("not file: URLs",),
    ),
    # --- job options ----------------------------------------------------------------------------
    case("option-seed-beyond-64-bits", jsonl_bytes(GOOD), options={"seed": 2**64 + 5}, field="seed"),
    case("flag-seed-beyond-64-bits", jsonl_bytes(GOOD), flags=("--seed", "18446744073709551621"), field="seed"),
    case("option-top-k-below-minus-one", jsonl_bytes(GOOD), options={"top_k": -7}, field="top_k"),
    case("option-max-tokens-huge", jsonl_bytes(GOOD), flags=("--max-tokens", str(2**40)), field="max_tokens"),
    case("option-temperature-1e999", jsonl_bytes(GOOD), options=b'{"temperature": 1e999}', field="temperature"),
    case("option-penalty-nan", jsonl_bytes(GOOD), options=b'{"presence_penalty": NaN}', field="presence_penalty"),
    case("flag-temperature-inf", jsonl_bytes(GOOD), flags=("--temperature", "inf"), field="temperature"),
    case("flag-top-p-nan", jsonl_bytes(GOOD), flags=("--top-p", "nan"), field="top_p", says=("finite",)),
    case("set-temperature-infinity", jsonl_bytes(GOOD), flags=("--set", "temperature=Infinity"), field="temperature"),
    case(
        "option-media-timeout-inf",
        jsonl_bytes(GOOD),
        options=b'{"media": {"timeout_s": Infinity}}',
        field="media.timeout_s",
    ),
    case("set-max-tokens-true", jsonl_bytes(GOOD), flags=("--set", "max_tokens=true"), field="max_tokens", says=BOOL),
    case("option-temperature-true", jsonl_bytes(GOOD), options={"temperature": True}, field="temperature", says=BOOL),
    case("option-seed-false", jsonl_bytes(GOOD), options={"seed": False}, field="seed", says=BOOL),
    case("option-shards-a-string", jsonl_bytes(GOOD), options={"shards": "2"}, field="shards", says=("a string",)),
    case(
        "option-media-bytes-true",
        jsonl_bytes(GOOD),
        options={"media": {"max_bytes": True}},
        field="media.max_bytes",
        says=BOOL,
    ),
    case("option-reuse-answers-one", jsonl_bytes(GOOD), options={"reuse_answers": 1}, field="reuse_answers"),
    case("options-nested-5000-deep", jsonl_bytes(GOOD), options=b'{"stop": ' + DEEP_5000 + b"}", says=NESTED),
    case(
        "option-schema-nested-too-deep",
        jsonl_bytes(GOOD),
        options={"response_format": schema_format({"name": "n", "schema": nested_schema(150)})},
        field="response_format",
        says=NESTED,
    ),
    case("set-option-nested-5000-deep", jsonl_bytes(GOOD), flags=("--set", "stop=" + DEEP_5000.decode()), says=NESTED),
    case(
        "response-format-flag-nested-5000-deep",
        jsonl_bytes(GOOD),
        flags=("--response-format", DEEP_5000.decode()),
        says=("--response-format", *NESTED),
    ),
    case(
        "set-option-nested-too-deep",
        jsonl_bytes(GOOD),
        flags=("--set", "stop=" + "[" * 300 + "]" * 300),
        field="stop",
        says=NESTED,
    ),
    case("unknown-option", jsonl_bytes(GOOD), options={"max_tokenz": 5}, field="max_tokenz", says=("max_tokens",)),
    case("options-not-json", jsonl_bytes(GOOD), options=b"max_tokens: 5\n", says=("not valid JSON",)),
    case("options-a-list", jsonl_bytes(GOOD), options=b'[{"max_tokens": 5}]', says=("JSON object",)),
    case("option-wrong-type", jsonl_bytes(GOOD), options={"max_tokens": "many"}, field="max_tokens"),
    case("option-out-of-range", jsonl_bytes(GOOD), options={"shards": 0}, field="shards"),
    case(
        "option-media-not-object-with-flag",
        jsonl_bytes(GOOD),
        options={"media": "none"},
        flags=("--media-allowed-host", "images.example.com"),
        field="media",
    ),
    case(
        "response-format-xml",
        jsonl_bytes(GOOD),
        options={"response_format": {"type": "xml"}},
        field="response_format.type",
    ),
    case(
        "response-format-flag-xml",
        jsonl_bytes(GOOD),
        flags=("--response-format", '{"type": "xml"}'),
        field="response_format.type",
    ),
    case(
        "json-schema-without-nested-schema",
        jsonl_bytes(GOOD),
        options={"response_format": schema_format({"name": "x", "type": "object", "properties": {}})},
        field="response_format.json_schema.schema",
    ),
    case(
        "json-schema-missing",
        jsonl_bytes(GOOD),
        options={"response_format": {"type": "json_schema"}},
        field="response_format.json_schema",
    ),
    case(
        "json-schema-schema-is-string",
        jsonl_bytes(GOOD),
        options={"response_format": schema_format({"name": "x", "schema": '{"type": "object"}'})},
        field="response_format.json_schema.schema",
    ),
    case(
        "json-schema-with-type-json-object",
        jsonl_bytes(GOOD),
        options={"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
        field="response_format.json_schema",
    ),
    case("string-temperature", jsonl_bytes(GOOD, chat("r2", temperature="hot")), line=2, field="body.temperature"),
    case("temperature-option-above-two", jsonl_bytes(GOOD), flags=("--temperature", "5"), field="temperature"),
    case("top-p-above-one", jsonl_bytes(GOOD, chat("r2", top_p=7)), line=2, field="body.top_p"),
    case(
        "misspelt-field",
        jsonl_bytes(GOOD, chat("r2", max_tokenz=5)),
        line=2,
        field="body.max_tokenz",
        says=("did you mean 'max_tokens'",),
    ),
    case(
        "chat-field-on-embeddings",
        jsonl_bytes(embedding("e1", input="x"), embedding("e2", input="y", tools=[])),
        line=2,
        field="body.tools",
        says=("not a field of embeddings requests",),
    ),
    case("model-option-differs-from-rows", jsonl_bytes(chat("r1", model="a/b")), flags=("--model", "c/d"), line=1),
    # --- Parquet --------------------------------------------------------------------------------
    case("parquet-named-but-jsonl", jsonl_bytes(GOOD), name="in.parquet", says=("not a Parquet file",)),
    case("parquet-truncated", b"PAR1" + b"\0" * 100, name="in.parquet", says=("Parquet",)),
    case(
        "parquet-without-prompt-column",
        parquet_writer({"question": ["a", "b"]}),
        name="in.parquet",
        says=("'messages' or 'prompt'", "question"),
    ),
    case(
        "parquet-prompt-column-option-missing",
        parquet_writer({"prompt": ["a", "b"]}),
        name="in.parquet",
        options={"prompt_column": "question"},
        field="prompt_column",
    ),
    case(
        "parquet-duplicate-id",
        parquet_writer({"id": [1, 2, 1], "prompt": ["a", "b", "c"]}),
        name="in.parquet",
        line=3,
        field="id",
    ),
    case(
        "parquet-null-id",
        parquet_writer({"id": ["x", None, "z"], "prompt": ["a", "b", "c"]}),
        name="in.parquet",
        line=2,
        field="id",
    ),
    case(
        "parquet-empty-prompt",
        parquet_writer({"prompt": ["a", "", "  "]}),
        name="in.parquet",
        line=2,
        field="prompt",
        says=("line 3", "is empty"),
    ),
    case(
        "parquet-null-prompt",
        parquet_writer({"prompt": ["a", None]}),
        name="in.parquet",
        line=2,
        field="prompt",
        says=("is null",),
    ),
    case(
        "parquet-null-messages",
        parquet_writer({"messages": [[{"role": "user", "content": "hi"}], None]}),
        name="in.parquet",
        line=2,
        field="messages",
        says=("is null",),
    ),
    case(
        "parquet-message-bad-role",
        parquet_writer({"messages": [[{"role": "user", "content": "hi"}], [{"role": "robot", "content": "hi"}]]}),
        name="in.parquet",
        line=2,
        field="messages",
        says=("robot",),
    ),
    case(
        "parquet-embeddings-empty-text",
        parquet_writer({"text": ["a", ""]}),
        name="in.parquet",
        line=2,
        field="text",
        says=("nothing to embed",),
    ),
    case(
        "parquet-output-column",
        parquet_writer({"prompt": ["a", "b"], "output": ["x", "y"]}),
        name="in.parquet",
        field="output",
        says=("rename",),
    ),
    case(
        "parquet-error-type-column",
        parquet_writer({"id": [1, 2], "prompt": ["a", "b"], "error_type": ["x", "y"]}),
        name="in.parquet",
        field="error_type",
        says=("rename",),
    ),
    case(
        "parquet-row-index-without-id",
        parquet_writer({"prompt": ["a", "b"], "row_index": [7, 8]}),
        name="in.parquet",
        field="row_index",
        says=("rename",),
    ),
    case(
        "parquet-embedding-column-of-embeddings-job",
        parquet_writer({"text": ["a", "b"], "embedding": [[0.5], [0.25]]}),
        name="in.parquet",
        field="embedding",
        says=("rename",),
    ),
    case(
        "parquet-prompt-column-named-output",
        parquet_writer({"output": ["a", "b"]}),
        name="in.parquet",
        options={"prompt_column": "output"},
        field="output",
        says=("prompt_column",),
    ),
    case(
        "parquet-prompt-and-messages",
        parquet_writer({"prompt": ["a"], "messages": [[{"role": "user", "content": "hi"}]]}),
        name="in.parquet",
        says=("'messages'", "'prompt'", "prompt_column"),
    ),
    case(
        "parquet-image-column-missing",
        parquet_writer({"prompt": ["a", "b"]}),
        name="in.parquet",
        options={"image_column": "picture"},
        field="image_column",
        says=("'picture' is not in the file",),
    ),
    case(
        "parquet-image-column-of-numbers",
        parquet_writer({"prompt": ["a", "b"], "picture": [1, 2]}),
        name="in.parquet",
        options={"image_column": "picture"},
        field="image_column",
        says=("holds int64", "URL strings or the images' bytes"),
    ),
    case(
        "parquet-image-column-bytes-not-an-image",
        parquet_writer({"prompt": ["a", "b"], "picture": [b"\x89PNG\r\n\x1a\n....", b"not an image"]}),
        name="in.parquet",
        options={"image_column": "picture"},
        line=2,
        field="picture",
        says=("not a PNG, JPEG",),
    ),
    case(
        "parquet-image-column-of-embeddings-job",
        parquet_writer({"text": ["a", "b"], "picture": ["http://x/a.png", None]}),
        name="in.parquet",
        options={"image_column": "picture"},
        field="image_column",
        says=("embeddings job",),
    ),
    case(
        "parquet-image-column-file-url",
        parquet_writer({"prompt": ["a", "b"], "picture": ["https://images.example.com/a.png", "file:///etc/passwd"]}),
        name="in.parquet",
        options={"image_column": "picture"},
        line=2,
        field="picture",
        says=("not file: URLs", "data: URL"),
    ),
    case(
        "parquet-input-and-text",
        parquet_writer({"input": ["a"], "text": ["b"]}),
        name="in.parquet",
        says=("'input'", "'text'", "prompt_column"),
    ),
    case(
        "parquet-no-rows",
        parquet_writer({"prompt": pa.array([], pa.string())}),
        name="in.parquet",
        says=("no rows",),
    ),
]


@pytest.fixture(autouse=True)
def _refused_before_any_step(refusing_cli: None) -> None:
    """Every test here: the work folder and the instance in tmp_path, and no Dagster step run."""


def write_case(c: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[str]]:
    """Writes the case's files; returns the input path and the extra command-line arguments."""
    src = tmp_path / c.name
    if isinstance(c.content, bytes):
        src.write_bytes(c.content)
    elif c.content is not None:
        c.content(src)
    args = list(c.flags)
    if c.options is not None:
        opts = tmp_path / "job.json"
        opts.write_bytes(c.options if isinstance(c.options, bytes) else json.dumps(c.options).encode())
        args += ["--options", str(opts)]
    if c.max_line_bytes is not None:
        monkeypatch.setattr(jsonl_input, "MAX_LINE_BYTES", c.max_line_bytes)
    return src, args


def names_line(text: str, line: int) -> bool:
    return re.search(rf"\bline {line}\b", text) is not None


def assert_rejected(c: Case, code: int, err: str) -> None:
    assert code == 2, err
    assert err.strip(), "a rejection must say why on stderr"
    assert "Traceback" not in err, err
    if c.line is not None:
        assert names_line(err, c.line), f"message does not name line {c.line}:\n{err}"
    if c.field is not None:
        assert c.field in err, f"message does not name field {c.field}:\n{err}"
    for words in c.says:
        assert words.lower() in err.lower(), f"message does not say {words!r}:\n{err}"


@pytest.mark.parametrize("c", CASES)
def test_validate_rejects(
    c: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    src, args = write_case(c, tmp_path, monkeypatch)
    code = main(["validate", str(src), *args])
    out, err = capsys.readouterr()
    assert_rejected(c, code, err)
    assert "ok:" not in out


@pytest.mark.parametrize("c", CASES)
def test_run_rejects_before_anything_runs(
    c: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    src, args = write_case(c, tmp_path, monkeypatch)
    out_path = tmp_path / ("out.parquet" if c.name.endswith(".parquet") else "out.jsonl")
    code = main(["run", str(src), "-o", str(out_path), *args])
    out, err = capsys.readouterr()
    assert_rejected(c, code, err)
    assert not out_path.exists()
    assert not out_path.with_name(out_path.stem + ".report.json").exists()
    assert not list(tmp_path.glob("out*")), "a rejected job left output files behind"
    assert '"job_id"' not in out, "a rejected job printed a report"


def test_every_case_id_is_unique() -> None:
    ids = [p.id for p in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 30


# --- what is accepted, and reporting many problems --------------------------------------------


def exactly(limit: int) -> bytes:
    """A good chat line of exactly ``limit`` bytes (without its newline)."""
    base = json.dumps(chat("big") | {"pad": ""}).encode()
    return json.dumps(chat("big") | {"pad": "x" * (limit - len(base))}).encode()


GOOD_CASES = [
    case("chat", jsonl_bytes(GOOD, chat("r2", max_tokens=5, n=1, stream=False))),
    case("n-at-its-limits", jsonl_bytes(chat("a", n=128, max_tokens=8192), chat("b", n=3))),
    case("chat-without-method-and-url", jsonl_bytes({"custom_id": "a", "body": {"messages": MESSAGES}})),
    case("crlf-and-blank-lines", b"\r\n" + jsonl_bytes(GOOD).replace(b"\n", b"\r\n\r\n") + b"  \n"),
    case(
        "surrogate-pair-escape",
        jsonl_bytes(r'{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "\ud83d\ude00 \\ud800"}]}}'),
    ),
    case("nan-inside-a-string", jsonl_bytes(chat("a", messages=[{"role": "user", "content": "NaN"}]))),
    case("line-exactly-at-the-limit", jsonl_bytes(GOOD, exactly(1024)), max_line_bytes=1024),
    case("completions", jsonl_bytes(completion("a", prompt="Once"), completion("b", prompt="upon"))),
    case(
        "logprobs-at-their-limits",
        jsonl_bytes(chat("a", logprobs=True, top_logprobs=20), chat("b", logprobs=True), chat("c", logprobs=False)),
    ),
    case(
        "completions-logprobs",
        jsonl_bytes(completion("a", prompt="x", logprobs=0), completion("b", prompt="y", logprobs=20)),
    ),
    case("embeddings", jsonl_bytes(embedding("a", input="x"), embedding("b", input=["y"]))),
    case("parquet-prompt-and-id", parquet_writer({"id": [3, 1], "prompt": ["a", "b"]}), name="in.parquet"),
    case("parquet-messages", parquet_writer({"messages": [[{"role": "user", "content": "hi"}]]}), name="in.parquet"),
    case("parquet-text-for-embeddings", parquet_writer({"text": ["a", "b"]}), name="in.parquet"),
    case(
        "parquet-row-index-beside-id", parquet_writer({"id": [1], "prompt": ["a"], "row_index": [0]}), name="in.parquet"
    ),
    case(
        "parquet-prompt-and-messages-with-prompt-column",
        parquet_writer({"prompt": ["a"], "messages": [[{"role": "user", "content": "hi"}]]}),
        name="in.parquet",
        options={"prompt_column": "prompt"},
    ),
    case(
        "numbers-at-their-limits",
        jsonl_bytes(
            chat("a", seed=2**63 - 1, top_k=-1, min_tokens=0, max_tokens=2**31 - 1, logit_bias={"42": -100}),
            chat("b", seed=-(2**63), temperature=0, logprobs=False, top_logprobs=None),
        ),
    ),
    case("job-seed-at-its-limit", jsonl_bytes(GOOD), flags=("--seed", str(2**63 - 1), "--top-k", "-1")),
]


@pytest.mark.parametrize("c", GOOD_CASES)
def test_the_corpus_good_rows_are_accepted(
    c: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows the bad cases are built from pass on their own, so each rejection is for its one flaw."""
    src, args = write_case(c, tmp_path, monkeypatch)
    code = main(["validate", str(src), *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith("ok:")


def test_utf8_bom_at_start_is_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + jsonl_bytes(chat("a"), chat("b")))
    assert main(["validate", str(src)]) == 0
    out, err = capsys.readouterr()
    assert "ok: 2 rows" in out and "Traceback" not in err


def test_utf8_bom_after_the_first_line_is_rejected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl_bytes(chat("a"), b"\xef\xbb\xbf" + json.dumps(chat("b")).encode()))
    assert main(["validate", str(src)]) == 2
    assert names_line(capsys.readouterr().err, 2)


def bad_row(n: int) -> Any:
    """A different way for line ``n`` to be wrong, in turn."""
    kinds: list[Any] = [
        "{not json",
        "[1, 2, 3]",
        chat(""),
        chat(f"r{n}", messages=[]),
        chat(f"r{n}") | {"method": "GET"},
        chat(f"r{n}", stream=True),
    ]
    return kinds[n % len(kinds)]


def many_bad_lines(path: Path, lines: int) -> list[int]:
    """Writes a file whose even lines are good and odd lines bad; returns the bad line numbers."""
    rows = [bad_row(n) if n % 2 else chat(f"r{n}") for n in range(1, lines + 1)]
    path.write_bytes(jsonl_bytes(*rows))
    return list(range(1, lines + 1, 2))


@pytest.mark.parametrize("command", ["validate", "run"])
def test_more_than_twenty_bad_lines_are_all_named(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.jsonl"
    bad = many_bad_lines(src, 60)
    argv = [command, str(src)] + (["-o", str(tmp_path / "out.jsonl"), "--quiet"] if command == "run" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "job rejected: 30 problem(s)" in err and "Traceback" not in err
    assert not [n for n in bad if not names_line(err, n)], err
    assert not [n for n in range(2, 61, 2) if names_line(err, n)], "a good line was named"
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("command", ["validate", "run"])
def test_thousands_of_bad_lines_are_counted_and_the_first_ones_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    src = tmp_path / "in.jsonl"
    bad = many_bad_lines(src, 5000)
    argv = [command, str(src)] + (["-o", str(tmp_path / "out.jsonl"), "--quiet"] if command == "run" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"job rejected: {len(bad)} problem(s)" in err
    assert all(names_line(err, n) for n in bad[:20]), err
    assert re.search(r"\.\.\. and \d+ more", err), err


def test_a_check_counts_every_problem_and_keeps_the_first_thousand() -> None:
    assert not Problems()
    problems = Problems([Problem("the model is not here", field="model")])
    for line in range(2, 3001):
        problems.add(Problem("not JSON", line=line))
    rejected = problems.rejection()
    assert rejected.total == 3000 and len(rejected.problems) == MAX_REPORTED_PROBLEMS
    assert rejected.problems[0].field == "model" and rejected.problems[-1].line == MAX_REPORTED_PROBLEMS
    assert "job rejected: 3000 problem(s)" in rejected.render()


def test_unknown_parser_name_is_rejected_at_submit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}\n')
    assert main(["validate", str(src), "--reasoning-parser", "no_such_parser"]) == 2
    err = capsys.readouterr().err
    assert "no_such_parser" in err and "deepseek_r1" in err and "Traceback" not in err
