"""Classify rows: the response a sequence classifier's probabilities make, shaped as vLLM's server
shapes its ``/classify`` answer (``ClassificationResponse``), so that every engine here answers a
row the same way."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any


def classification_response(
    request_id: str,
    model: str,
    id2label: Mapping[int, str],
    probs: Sequence[Sequence[float]],
    prompt_tokens: int,
) -> dict[str, Any]:
    """One ``data`` item per input, in input order: its ``probs``, their count and the label of
    the most probable class (its ``id2label`` name; None when the model names none for it);
    ``prompt_tokens`` counts every input's tokens."""
    data = []
    for n, values in enumerate(probs):
        floats = [float(v) for v in values]
        best = max(range(len(floats)), key=floats.__getitem__)
        data.append({"index": n, "label": id2label.get(best), "probs": floats, "num_classes": len(floats)})
    return {
        "id": f"classify-{request_id}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0},
    }
