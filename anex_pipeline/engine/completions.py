"""OpenAI response objects built from what an engine generated.

The shapes follow what an OpenAI-compatible server returns, so that the ``openai`` SDK's own
types (``ChatCompletion``, ``Completion``, ``CreateEmbeddingResponse``) accept them.
"""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from anex_pipeline.request_fields import POOLING


@dataclass
class Generated:
    """The engine-independent facts of one finished generation."""

    text: str | None  # None: a chat answer with no text besides its tool calls
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning: str | None = None
    reasoning_tokens: int = 0
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    # The choice's logprobs in its endpoint's shape (chat's ``content`` list, completions' four lists).
    logprobs: dict[str, Any] | None = None
    forced: str | None = None  # "required" or "named": the chat row forced a tool call


def usage(*choices: Generated) -> dict[str, Any]:
    """A row's usage: its prompt once, the tokens of every choice summed (as OpenAI counts ``n``)."""
    first = choices[0]
    completion = sum(g.completion_tokens for g in choices)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": sum(g.reasoning_tokens for g in choices)},
    }


def _chat_choice(index: int, g: Generated) -> dict[str, Any]:
    # A forced call's message always has a text, "" beside the calls, as vLLM's server writes it.
    message: dict[str, Any] = {"role": "assistant", "content": g.text or "" if g.forced else g.text}
    if g.reasoning is not None:  # under both names: OpenAI-compatible servers' and vLLM 0.32's own
        message["reasoning_content"] = message["reasoning"] = g.reasoning
    finish = g.finish_reason
    if g.tool_calls:
        message["tool_calls"] = g.tool_calls
    # As OpenAI (and vLLM's server) end a call: "tool_calls" for a called or required one, "stop"
    # for a named one.
    if finish == "stop" and (g.forced == "required" or (g.tool_calls and g.forced is None)):
        finish = "tool_calls"
    return {"index": index, "message": message, "logprobs": g.logprobs, "finish_reason": finish}


def chat_completion(request_id: str, model: str, *choices: Generated) -> dict[str, Any]:
    """A chat completion with one choice per generation, indexed in order."""
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_chat_choice(i, g) for i, g in enumerate(choices)],
        "usage": usage(*choices),
        "system_fingerprint": None,
    }


def text_completion(request_id: str, model: str, *choices: Generated) -> dict[str, Any]:
    """A text completion with one choice per generation, indexed in order."""
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": i, "text": g.text, "logprobs": g.logprobs, "finish_reason": g.finish_reason}
            for i, g in enumerate(choices)
        ],
        "usage": usage(*choices),
        "system_fingerprint": None,
    }


def unit_vector(vector: Iterable[float]) -> list[float]:
    """The vector scaled to length 1, as every embedding is delivered; a zero vector stays zero."""
    values = [float(x) for x in vector]
    norm = sum(x * x for x in values) ** 0.5 or 1.0
    return [x / norm for x in values]


def embedding_response(
    model: str, vectors: list[list[float]], prompt_tokens: int, encoding_format: str | None = None
) -> dict[str, Any]:
    """An embeddings response: one ``data`` item per input, in input order, each vector as floats
    or, with ``encoding_format`` "base64", as OpenAI sends it: its little-endian float32 bytes in
    base64; ``prompt_tokens`` counts every input's tokens."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": n, "embedding": encoded_vector(v, encoding_format)}
            for n, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def encoded_vector(vector: list[float], encoding_format: str | None) -> list[float] | str:
    """A unit vector as a row asked for it: floats, or base64 of little-endian float32."""
    if encoding_format != "base64":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def one_prompt(prompt: str | list[Any]) -> str | list[int]:
    """A completions row's one prompt, as text or token ids, from any of OpenAI's shapes (a list
    holding one prompt is that prompt)."""
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        return prompt[0]
    return prompt


def body_for(endpoint: str, request_id: str, model: str, *choices: Generated) -> dict[str, Any]:
    if endpoint == "completions":
        return text_completion(request_id, model, *choices)
    return chat_completion(request_id, model, *choices)


def row_usage(usage: dict[str, Any] | None, endpoint: str) -> dict[str, int]:
    """The token counts the report adds up, from the server's ``usage`` object."""
    usage = usage or {}
    counts = {"prompt_tokens": int(usage.get("prompt_tokens") or 0)}
    if endpoint in POOLING:
        return counts
    counts["completion_tokens"] = int(usage.get("completion_tokens") or 0)
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    if reasoning is not None:
        counts["reasoning_tokens"] = int(reasoning)
    counts["cached_prompt_tokens"] = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return counts
