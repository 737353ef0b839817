"""Rows sent to ``/v1/responses``: run as chat rows, answered as Responses objects.

A Responses request (``input`` as text or input items, ``instructions``, ``max_output_tokens``,
``text.format``, ``reasoning.effort``) says what a chat request says in other words, so each row
is read into the chat body it means (:func:`chat_row`) and goes through the same stages and
engines as chat rows: media, answer reuse, structured output, thinking budgets, the HTTP engine.
Its finished outcome is then rewritten into the object ``openai.types.responses.Response``
describes (:func:`as_response`), and its errors name the Responses fields.

The submit-time checks of these bodies are in :mod:`anex_pipeline.validate`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from anex_pipeline.request_fields import RESPONSES_NAMES
from anex_pipeline.spec import InputRow, RowError, RowOutcome

# Thinking by reasoning effort: off, or on with at most this many thinking tokens (None: as much
# as the job's reasoning_budget allows).
THINKING_OFF = ("none", "minimal")
EFFORT_BUDGETS: dict[str, int | None] = {"low": 1024, "medium": 4096, "high": 16384, "xhigh": None, "max": None}
EFFORTS = (*THINKING_OFF, *EFFORT_BUDGETS)
# Content parts of input items and the chat parts they become.
TEXT_PARTS = ("input_text", "output_text")
IMAGE_PART = "input_image"
ITEM_ROLES = ("user", "system", "developer", "assistant")
# The fields of a Responses request that a chat request says otherwise.
RESPONSES_ONLY = frozenset({"input", "instructions", "max_output_tokens", "text", "reasoning"})


def chat_row(row: InputRow) -> InputRow:
    """The row with the chat body its Responses request means; the request itself is kept for
    the answer (``InputRow.respond``)."""
    return dataclasses.replace(row, body=chat_body(row.body), respond=row.body)


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a (checked) Responses request stands for."""
    chat = {k: v for k, v in body.items() if k not in RESPONSES_ONLY}
    messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    given = body["input"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    else:
        messages += [_message(item) for item in given]
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    fmt = (body.get("text") or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _response_format(fmt)
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        chat["chat_template_kwargs"] = {
            **chat.get("chat_template_kwargs", {}),
            "enable_thinking": effort not in THINKING_OFF,
        }
        if EFFORT_BUDGETS.get(effort) is not None and "thinking_token_budget" not in body:
            chat["thinking_token_budget"] = EFFORT_BUDGETS[effort]
        chat["reasoning_effort"] = effort
    return chat


def _message(item: dict[str, Any]) -> dict[str, Any]:
    content = item["content"]
    if isinstance(content, list):
        content = [_part(p) for p in content]
    return {"role": item["role"], "content": content}


def _part(part: dict[str, Any]) -> dict[str, Any]:
    if part["type"] in TEXT_PARTS:
        return {"type": "text", "text": part["text"]}
    image = {"url": part["image_url"], **({"detail": part["detail"]} if part.get("detail") else {})}
    return {"type": "image_url", "image_url": image}


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """Chat's response_format for a Responses ``text.format`` (the schema sits one level up there)."""
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def as_response(outcome: RowOutcome, request: dict[str, Any]) -> RowOutcome:
    """The outcome of a Responses row: its chat completion rewritten as a Responses object, or its
    error naming the Responses fields."""
    if outcome.error is not None:
        return dataclasses.replace(outcome, error=_renamed(outcome.error))
    if outcome.body is None:
        return outcome
    return dataclasses.replace(outcome, body=response_object(outcome.body, request))


def _renamed(error: RowError) -> RowError:
    param = error.param
    if param is not None:
        head, sep, rest = param.partition(".")
        head, bracket, index = head.partition("[")
        param = RESPONSES_NAMES.get(head, head) + bracket + index + sep + rest
    return dataclasses.replace(error, param=param)


def response_object(completion: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """The Responses object of a chat completion, echoing the request's settings as OpenAI does."""
    rid = completion["id"].split("-", 1)[-1]
    choice = completion["choices"][0]
    message = choice["message"]
    cut = choice["finish_reason"] == "length"
    status = "incomplete" if cut else "completed"
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(
            {
                "id": f"rs_{rid}",
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}],
                "status": status,
            }
        )
    output.append(
        {
            "id": f"msg_{rid}",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [
                {"type": "output_text", "text": message.get("content") or "", "annotations": [], "logprobs": []}
            ],
        }
    )
    usage = completion["usage"]
    created = completion.get("created", int(time.time()))
    return {
        "id": f"resp_{rid}",
        "object": "response",
        "created_at": created,
        "completed_at": None if cut else created,
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": completion["model"],
        "output": output,
        **echo(request),
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "store": False,
        "background": False,
        "previous_response_id": None,
        "truncation": "disabled",
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            # vLLM does not report the tokens it writes to its prefix cache; the SDK's type requires the count
            "input_tokens_details": {
                "cached_tokens": _detail(usage, "prompt_tokens_details", "cached_tokens"),
                "cache_write_tokens": 0,
            },
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {
                "reasoning_tokens": _detail(usage, "completion_tokens_details", "reasoning_tokens")
            },
            "total_tokens": usage["total_tokens"],
        },
    }


def echo(request: dict[str, Any]) -> dict[str, Any]:
    """The fields of a Responses object that repeat its request's settings, as OpenAI's do."""
    effort = (request.get("reasoning") or {}).get("effort")
    return {
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "temperature": request.get("temperature"),
        "top_p": request.get("top_p"),
        "text": {"format": (request.get("text") or {}).get("format") or {"type": "text"}},
        "reasoning": {"effort": effort, "summary": None} if effort is not None else None,
        "metadata": request.get("metadata"),
        "user": request.get("user"),
    }


def uncached(usage: dict[str, Any]) -> dict[str, Any]:
    """A response's usage (chat, completions or Responses) with no prompt tokens served from a cache."""
    usage = dict(usage)
    for group, name in (("prompt_tokens_details", "cached_tokens"), ("input_tokens_details", "cached_tokens")):
        if isinstance(usage.get(group), dict) and name in usage[group]:
            usage[group] = {**usage[group], name: 0}
    return usage


def _detail(usage: dict[str, Any], group: str, name: str) -> int:
    """A count from a chat usage's details (a server may send them as null)."""
    return int((usage.get(group) or {}).get(name) or 0)


def output_text(body: dict[str, Any]) -> str | None:
    """The answer text of a Responses object (its message's output_text parts)."""
    texts = [
        part["text"]
        for item in body.get("output") or []
        if item.get("type") == "message"
        for part in item.get("content") or []
        if part.get("type") == "output_text"
    ]
    return "".join(texts) if texts else None


def finish_reason(body: dict[str, Any]) -> str:
    """A Responses object's status in chat's words: ``length`` when max_output_tokens cut it."""
    return "length" if (body.get("incomplete_details") or {}).get("reason") == "max_output_tokens" else "stop"
