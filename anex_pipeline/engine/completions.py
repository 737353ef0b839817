"""OpenAI response objects built from what an engine generated.

The shapes follow what an OpenAI-compatible server returns, so that the ``openai`` SDK's own
types (``ChatCompletion``, ``Completion``, ``CreateEmbeddingResponse``) accept them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


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
    message: dict[str, Any] = {"role": "assistant", "content": g.text}
    if g.reasoning is not None:
        message["reasoning_content"] = g.reasoning
    finish = g.finish_reason
    if g.tool_calls:
        message["tool_calls"] = g.tool_calls
        if finish == "stop":
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


def embedding_response(model: str, vector: list[float], prompt_tokens: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": vector}],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def body_for(endpoint: str, request_id: str, model: str, *choices: Generated) -> dict[str, Any]:
    if endpoint == "completions":
        return text_completion(request_id, model, *choices)
    return chat_completion(request_id, model, *choices)
