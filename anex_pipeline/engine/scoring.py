"""Score and rerank rows: the text pairs a row asks a cross-encoder to score, and the responses
its scores make, shaped as vLLM's server shapes them (``ScoreResponse`` and ``RerankResponse``).

A score row pairs ``text_1`` with ``text_2`` (or vLLM's other spellings of the two sides:
``queries``/``documents``, ``queries``/``items``, ``data_1``/``data_2``) one to one, one to each of
N, or N to N in order; a
rerank row pairs its ``query`` with each of its ``documents``. Every engine here scores the
pairs this module lists and builds its response with the functions below, so the shapes are one.
"""

from __future__ import annotations

import time
from typing import Any

from anex_pipeline.request_fields import score_sides


def _texts(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def score_pairs(endpoint: str, body: dict[str, Any]) -> list[tuple[str, str]]:
    """The ``(first, second)`` text pairs of a score or rerank row, in the order of its answer's
    items (``text_2``'s or the documents' order)."""
    if endpoint == "rerank":
        return [(body["query"], doc) for doc in _texts(body["documents"])]
    first_side, second_side = score_sides(body)
    first, second = _texts(body[first_side]), _texts(body[second_side])
    if len(first) == 1:
        first = first * len(second)
    return list(zip(first, second, strict=True))


def scoring_response(
    endpoint: str, request_id: str, model: str, body: dict[str, Any], scores: list[float], prompt_tokens: int
) -> dict[str, Any]:
    """The row's response: one score per pair of :func:`score_pairs`, in that order;
    ``prompt_tokens`` counts the tokens of every pair the model read."""
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    if endpoint == "rerank":
        documents = _texts(body["documents"])
        results = [
            {"index": n, "document": {"text": doc}, "relevance_score": float(score)}
            for n, (doc, score) in enumerate(zip(documents, scores, strict=True))
        ]
        results.sort(key=lambda r: r["relevance_score"], reverse=True)  # stable: ties keep document order
        top_n = body.get("top_n") or len(results)
        return {"id": f"rerank-{request_id}", "model": model, "usage": usage, "results": results[:top_n]}
    return {
        "id": f"score-{request_id}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": n, "object": "score", "score": float(score)} for n, score in enumerate(scores)],
        "usage": usage,
    }
