"""A thinking model's tags as its tokenizer encodes them, shared by both runtimes: the in-process
stepping loop and the shared server's continuation both cut a trace at its budget and go on from
the same head (trace, notice, closing tags)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from anex_pipeline.engine.config import EngineSettings
from anex_pipeline.engine.parsing import NOTICE_TEXT, ThinkingTags, thinking_tags


@dataclass(frozen=True)
class ThinkingIds:
    """A model's thinking tags as token ids, and the notice a cut trace ends with."""

    start: list[int]
    end: list[int]
    closing: list[int]  # the end tag and what leads into the answer
    notice: list[int]

    @classmethod
    def of(cls, tags: ThinkingTags, tokenizer: Any) -> ThinkingIds:
        """The tags and the notice as the model's tokenizer encodes them."""
        ids = [tokenizer.encode(t, add_special_tokens=False) for t in (tags.start, tags.end, tags.closing)]
        return cls(*ids, notice=tokenizer.encode(NOTICE_TEXT, add_special_tokens=False))

    def head(self, output_ids: Sequence[int], cut: int, cap: int | None) -> list[int]:
        """What the answer of a trace cut at ``cut`` goes on from: the trace up to the cut, the
        notice and the closing tags, within ``cap`` output tokens (None: no cap)."""
        return (list(output_ids[:cut]) + self.notice + self.closing)[:cap]


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
