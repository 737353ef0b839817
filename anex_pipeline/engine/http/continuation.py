"""A thinking trace the budget cut, continued after the notice on a vLLM server.

vLLM's server ends a trace that reaches the row's ``thinking_token_budget`` by forcing the end tag,
and the answer follows it at once. The in-process engine puts the notice before the end tag and
lets the model answer after it (:mod:`anex_pipeline.engine.vllm.stepping`). So that a job's answers
do not depend on where its model runs, the HTTP engine does the same on the machine's shared
server, whose model and tokenizer are on this machine:

* a row with a budget and one choice asks for its token ids (``return_token_ids``);
* when :meth:`~anex_pipeline.engine.thinking.ThinkingIds.continuation` finds its trace cut, the
  trace up to the cut, the notice and the closing tags are sent back as the prompt's continuation
  (token ids, to ``/v1/completions``), for what is left of the row's ``max_tokens``, with the
  row's own sampling and constraint (a forced tool call's too, in the model's call format);
* the row's answer is made from both: split by the model's parsers here, as the in-process engine
  splits it, with the usage and the logprobs of both (the forced tokens have none).

The tokenizer and parsers are loaded at the first cut trace (a vLLM import, seconds): jobs whose
traces all end within their budget never pay it.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.engine.completions import Generated, body_for
from anex_pipeline.engine.parsing import (
    HARMONY_REASONING_PARSER,
    OutputParser,
    ParserNames,
    count_thinking_tokens,
)

if TYPE_CHECKING:
    from anex_pipeline.engine.config import EngineSettings
    from anex_pipeline.engine.thinking import ThinkingIds

FORCED_LOGPROB = -9999.0  # what vLLM's server writes for a token that was not sampled


@dataclass
class _Model:
    """What the continuation needs of the model, loaded once."""

    tokenizer: Any
    thinking: ThinkingIds
    parser: OutputParser


@dataclass
class Cut:
    """A first answer whose trace the budget cut: its prompt, and the head the rest follows."""

    prompt_ids: list[int]
    head: list[int]  # the trace up to the cut, the notice and the closing tags (within max_tokens)
    cut: int  # how many of the head's tokens the model sampled
    left: int | None  # output tokens left for the rest; None: up to the model's context


class TraceContinuation:
    """Continues the rows of one model whose trace the budget cut (see the module docstring)."""

    def __init__(self, settings: EngineSettings, engine_kwargs: dict[str, Any]):
        self.settings = settings
        self.engine_kwargs = engine_kwargs  # the server's engine arguments (its tokenizer's among them)
        self._model: _Model | None = None
        self._lock = threading.Lock()

    @staticmethod
    def applies(req: EngineRequest) -> bool:
        return bool(req.reasoning_budget) and req.endpoint in ("chat", "completions") and req.choices == 1

    def model(self) -> _Model:
        with self._lock:
            if self._model is None:
                from anex_pipeline.engine.thinking import ThinkingIds, model_thinking

                tokenizer, tags = model_thinking(self.settings, self.engine_kwargs)
                if tags is None:
                    raise ValueError(f"reasoning parser '{self.settings.reasoning_parser}' has no thinking tags")
                names = ParserNames(self.settings.reasoning_parser, self.settings.tool_parser)
                harmony = self.settings.reasoning_parser == HARMONY_REASONING_PARSER
                parser = OutputParser(tokenizer, names, harmony=harmony)
                self._model = _Model(tokenizer, ThinkingIds.of(tags, tokenizer), parser)
            return self._model

    def cut(self, req: EngineRequest, payload: dict[str, Any]) -> Cut | None:
        """Where the first answer's trace was cut, or None when it was not (its token ids, which
        only this class asked for, leave the payload either way)."""
        choice = payload["choices"][0]
        prompt_ids = payload.pop("prompt_token_ids", None) or choice.pop("prompt_token_ids", None)
        output_ids = choice.pop("token_ids", None)
        if not prompt_ids or output_ids is None or req.reasoning_budget is None:
            return None
        t = self.model().thinking
        failed = choice.get("finish_reason") == "error"
        found = t.continuation(prompt_ids, output_ids, req.reasoning_budget, req.max_tokens, failed=failed)
        if found is None:
            return None
        at, head = found
        left = None if req.max_tokens is None else req.max_tokens - len(head)
        return Cut(list(prompt_ids), head, min(at, len(head)), left)

    def follow_body(self, req: EngineRequest, body: dict[str, Any], cut: Cut) -> dict[str, Any]:
        """The ``/v1/completions`` request for the rest of the answer: the row's sampling and
        constraint, after the prompt and the head."""
        follow = {k: v for k, v in req.sampling.items() if k != "prompt_logprobs"}
        follow.update(
            model=body["model"],
            prompt=cut.prompt_ids + cut.head,
            max_tokens=cut.left,
            min_tokens=max(0, int(follow.get("min_tokens") or 0) - len(cut.head)),
            skip_special_tokens=self._skips_special_tokens(req),
            return_token_ids=True,
        )
        for name in ("response_format", "structured_outputs"):
            if name in body:
                follow[name] = body[name]
        forced = (
            self.model().parser.forced_constraint(req.body, req.chat_template_kwargs)
            if req.endpoint == "chat"
            else None
        )
        if forced is not None:  # the call the server would have held the chat row to, as completions hold it
            follow.pop("response_format", None)
            kind = "structural_tag" if forced.structural_tag is not None else "json"
            follow["structured_outputs"] = {kind: getattr(forced, kind)}
        if req.logprobs is not None:
            follow["logprobs"] = req.logprobs
        return follow

    @staticmethod
    def _skips_special_tokens(req: EngineRequest) -> bool:
        # The parsers need the model's tags, as in the in-process engine.
        return bool(req.sampling.get("skip_special_tokens", False))

    def joined(
        self, req: EngineRequest, first: dict[str, Any], cut: Cut, rest: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The row's response from the first answer cut at the budget and the rest after the notice
        (None: no tokens were left for a rest, so the answer ends with the head)."""
        m = self.model()
        skip = self._skips_special_tokens(req)
        rest_choice = rest["choices"][0] if rest is not None else {}
        rest_ids = rest_choice.get("token_ids") or []
        output_ids = cut.head + list(rest_ids)
        text = m.tokenizer.decode(cut.head, skip_special_tokens=skip) + (rest_choice.get("text") or "")
        parsed = m.parser.row_answer(req, text, output_ids, cut.prompt_ids)
        usage = first.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        generated = Generated(
            text=parsed.content,
            finish_reason=rest_choice.get("finish_reason") or "length",
            prompt_tokens=len(cut.prompt_ids),
            completion_tokens=len(output_ids),
            cached_tokens=cached,
            reasoning=parsed.reasoning,
            reasoning_tokens=count_thinking_tokens(cut.prompt_ids, output_ids, m.thinking.start, m.thinking.end),
            tool_calls=parsed.tool_calls,
            logprobs=self._logprobs(req, first["choices"][0].get("logprobs"), cut, rest_choice.get("logprobs")),
            forced=parsed.forced,
        )
        joined = body_for(req.endpoint, req.request_id, first["model"], generated)
        joined.update(id=first["id"], created=first["created"])
        if "prompt_logprobs" in first:
            joined["prompt_logprobs"] = first["prompt_logprobs"]
        elif "prompt_logprobs" in first["choices"][0]:
            joined["choices"][0]["prompt_logprobs"] = first["choices"][0]["prompt_logprobs"]
        return joined

    def _logprobs(
        self, req: EngineRequest, first: dict[str, Any] | None, cut: Cut, rest: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """The answer's logprobs in its endpoint's shape: the sampled trace's from the first
        answer, none for the forced tokens, then the rest's (which come in completions' shape)."""
        if req.logprobs is None or first is None:
            return None
        decode = self.model().tokenizer.decode
        forced = [decode([token]) for token in cut.head[cut.cut :]]
        rest = rest or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if req.endpoint == "chat":
            entries = list(first["content"] or [])[: cut.cut]
            entries += [{"token": t, "logprob": FORCED_LOGPROB, "bytes": _bytes(t), "top_logprobs": []} for t in forced]
            for token, logprob, top in zip(rest["tokens"], rest["token_logprobs"], rest["top_logprobs"], strict=True):
                # Completions give the row's count of alternatives and one more; chat the count.
                ranked = list((top or {}).items())[: req.logprobs]
                alternatives = [{"token": t, "logprob": lp, "bytes": _bytes(t)} for t, lp in ranked]
                entries.append(
                    {"token": token, "logprob": logprob, "bytes": _bytes(token), "top_logprobs": alternatives}
                )
            return {"content": entries, "refusal": None}
        tokens = first["tokens"][: cut.cut] + forced + rest["tokens"]
        return {
            "tokens": tokens,
            "token_logprobs": first["token_logprobs"][: cut.cut] + [None] * len(forced) + rest["token_logprobs"],
            "top_logprobs": first["top_logprobs"][: cut.cut] + [None] * len(forced) + rest["top_logprobs"],
            # As vLLM's server counts them: each token starts where the tokens before it end.
            "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))[: len(tokens)],
        }


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))
