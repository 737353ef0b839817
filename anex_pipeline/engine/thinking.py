"""A thinking model's tags as its tokenizer encodes them, shared by both runtimes: the in-process
stepping loop and the shared server's continuation both cut a trace at its budget and go on from
the same head (trace, notice, closing tags)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from anex_pipeline.engine.config import EngineSettings
from anex_pipeline.engine.parsing import NOTICE_TEXT, ThinkingTags, budget_cut, implicit_end, thinking_tags


@dataclass(frozen=True)
class ThinkingIds:
    """A model's thinking tags as token ids, and the notice a cut trace ends with."""

    start: list[int]
    end: list[int]
    closing: list[int]  # the end tag and what leads into the answer
    notice: list[int]
    implicit_ends: frozenset[int] = frozenset()  # tokens that end a trace by opening the answer

    @classmethod
    def of(cls, tags: ThinkingTags, tokenizer: Any) -> ThinkingIds:
        """The tags and the notice as the model's tokenizer encodes them."""
        ids = [tokenizer.encode(t, add_special_tokens=False) for t in (tags.start, tags.end, tags.closing)]
        implicit = frozenset(tokenizer.convert_tokens_to_ids(list(tags.implicit_ends)))
        return cls(*ids, notice=tokenizer.encode(NOTICE_TEXT, add_special_tokens=False), implicit_ends=implicit)

    def head(self, output_ids: Sequence[int], cut: int, cap: int | None) -> list[int]:
        """What the answer of a trace cut at ``cut`` goes on from: the trace up to the cut, the
        notice and the closing tags, within ``cap`` output tokens (None: no cap)."""
        return (list(output_ids[:cut]) + self.notice + self.closing)[:cap]

    def continuation(
        self,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        budget: int,
        cap: int | None,
        *,
        failed: bool = False,
    ) -> tuple[int, list[int]] | None:
        """Where an answer whose trace the budget closed goes on from: how many of its tokens the
        model sampled and the head (within ``cap`` output tokens); None when the budget closed no trace.

        A trace the model ended itself by opening its answer (a ``<tool_call>``) goes on from the
        trace and the closing tags, without the notice, when the budget then forced the end tag
        over that answer, or when generation ``failed`` after it (the forced end tag broke the
        answer's grammar, a forced call's, and vLLM ended the row): the answer is generated again
        after the closing tags, in one piece.
        """
        at = budget_cut(prompt_ids, output_ids, self.start, self.end, budget)
        early = implicit_end(prompt_ids, output_ids, self.start, self.end, self.implicit_ends)
        if early is not None and (at is not None or failed):
            return early, (list(output_ids[:early]) + self.closing)[:cap]
        if at is None:
            return None
        return at, self.head(output_ids, at, cap)


def model_thinking(settings: EngineSettings, kwargs: dict[str, Any]) -> tuple[Any, ThinkingTags | None]:
    """The tokenizer the engine loads for ``kwargs`` (its engine arguments) and the thinking tags
    of the settings' reasoning parser; raises ValueError when the parser does not fit the model."""
    from vllm.tokenizers import get_tokenizer

    try:
        tokenizer = get_tokenizer(
            kwargs.get("tokenizer") or settings.model,
            trust_remote_code=kwargs.get("trust_remote_code", False),
            revision=kwargs.get("tokenizer_revision") or kwargs.get("revision"),
        )
        return tokenizer, thinking_tags(str(settings.reasoning_parser), tokenizer)
    except Exception as exc:  # e.g. the tokenizer lacks the parser's tags
        raise ValueError(
            f"reasoning parser '{settings.reasoning_parser}' does not fit model '{settings.model_name}': {exc}; "
            "choose another with the reasoning_parser option"
        ) from exc
