"""Completions rows with several prompts: one engine request per prompt, one answer per row.

OpenAI's completions request takes a list of prompts (texts or token-id lists) and answers with
one choice per prompt, in prompt order, its usage summed over them. The engines take one prompt
per request, so such a row is split into parts before it reaches an engine and its parts'
outcomes are joined back into the row's when the last one is in. Every engine (in-process, HTTP,
the test fakes) therefore sees single-prompt requests only, and everything after generation
(checks, checkpoints, the report) sees the row.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from anex_pipeline.spec import RowOutcome

if TYPE_CHECKING:  # the engine interface imports this module
    from anex_pipeline.engine.base import EngineRequest


def prompts_of(req: EngineRequest) -> list[Any] | None:
    """The prompts of a completions row that has more than one, else None."""
    prompt = req.body.get("prompt") if req.endpoint == "completions" else None
    if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
        return prompt
    return None


class PromptParts:
    """Splits the rows of several prompts into parts and joins the parts' outcomes back. A part
    has an index of its own below zero, so it never meets a row's index."""

    def __init__(self) -> None:
        self._numbers = itertools.count(1)
        self._part_of: dict[int, tuple[EngineRequest, int]] = {}  # part index -> (row, prompt number)
        self._done: dict[int, dict[int, RowOutcome]] = {}  # row index -> prompt number -> outcome

    def split(self, requests: Iterable[EngineRequest]) -> Iterator[EngineRequest]:
        for req in requests:
            prompts = prompts_of(req)
            if prompts is None:
                yield req
                continue
            self._done[req.index] = {}
            for k, prompt in enumerate(prompts):
                index = -next(self._numbers)
                self._part_of[index] = (req, k)
                yield dataclasses.replace(
                    req, index=index, request_id=f"{req.request_id}-{k}", body={**req.body, "prompt": prompt}
                )

    def join(self, outcomes: Iterable[RowOutcome]) -> list[RowOutcome]:
        """The rows' outcomes: a row's own as it is, a split row's once all its parts are in."""
        rows = []
        for outcome in outcomes:
            if outcome.index >= 0:
                rows.append(outcome)
                continue
            req, k = self._part_of.pop(outcome.index)
            parts = self._done[req.index]
            parts[k] = outcome
            if len(parts) == len(req.body["prompt"]):
                del self._done[req.index]
                rows.append(_joined(req, [parts[n] for n in range(len(parts))]))
        return rows


def _joined(req: EngineRequest, parts: list[RowOutcome]) -> RowOutcome:
    """One row's outcome from its parts': the first failed part fails the row (as a request with
    one bad prompt is refused whole), with the prompt it names; else every part's choices in
    prompt order, indexed from 0, and the usage summed."""
    for k, part in enumerate(parts):
        if part.error is not None:
            param = part.error.param
            if param in (None, "prompt"):
                param = f"prompt[{k}]"
            return dataclasses.replace(
                part, index=req.index, key=req.key, error=dataclasses.replace(part.error, param=param)
            )
    first = parts[0]
    assert first.body is not None
    choices = [c for part in parts for c in (part.body or {}).get("choices", [])]
    body = {
        **first.body,
        "id": f"cmpl-{req.request_id}",
        "choices": [{**c, "index": n} for n, c in enumerate(choices)],
        "usage": _summed([(p.body or {}).get("usage") or {} for p in parts]),
    }
    usage = {key: sum(p.usage.get(key, 0) for p in parts) for key in first.usage}
    return dataclasses.replace(first, index=req.index, key=req.key, body=body, usage=usage)


def _summed(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """Usage objects added up, their nested details too."""
    total: dict[str, Any] = {}
    for usage in usages:
        for key, value in usage.items():
            if isinstance(value, dict):
                total[key] = _summed([total.get(key) or {}, value])
            elif isinstance(value, int) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
            else:
                total.setdefault(key, value)
    return total
