"""A job with the ``labels`` option: each chat row is held to one of the labels (vLLM's structured
outputs ``choice``), and its answer carries the label with its probability.

The probability is the model's own for the label's tokens in turn: the product of each token's
probability given the prompt and the tokens before it, read from the logprobs vLLM gives the
sampled tokens (by default taken from the model's distribution before any constraint, so the
constraint itself does not make a label certain). In logs: ``log(label_prob)`` is the sum of the
label's tokens' logprobs. Tokens after the label (the end-of-text token) and before it (a
thinking trace) are not part of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from anex_pipeline.spec import RowOutcome


def label_tokens(entries: Sequence[dict[str, Any]], label: str) -> list[dict[str, Any]]:
    """The logprobs entries whose tokens spell ``label``: the last run of entries that does, with
    whatever follows it (an end-of-text token) left out; empty when no run spells it."""
    texts = [e["token"] for e in entries]
    for end in range(len(texts), 0, -1):
        if not texts[end - 1]:  # a token of no text (the end of text) ends no label
            continue
        spelt = ""
        for start in range(end - 1, -1, -1):
            spelt = texts[start] + spelt
            if spelt == label:
                return list(entries[start:end])
            if len(spelt) >= len(label) or not label.endswith(spelt):
                break
    return []


def labelled(outcome: RowOutcome, labels: Sequence[str], drop_logprobs: bool) -> RowOutcome:
    """The row's answer with ``anex: {"label", "label_prob"}`` (None where the answer is not one of
    the labels, as when it was cut at max_tokens); its logprobs taken out again when the row did
    not ask for them."""
    body = outcome.body
    if outcome.error is not None or body is None or not body.get("choices"):
        return outcome
    choice = body["choices"][0]
    label = (choice.get("message") or {}).get("content")
    content = (choice.get("logprobs") or {}).get("content") or []
    found = label_tokens(content, label) if label in labels else []
    logprobs = [e.get("logprob") for e in found]
    prob = math.exp(sum(logprobs)) if found and all(lp is not None for lp in logprobs) else None
    body["anex"] = {"label": label if label in labels else None, "label_prob": prob}
    if drop_logprobs:
        for each in body["choices"]:
            each["logprobs"] = None
    return outcome
