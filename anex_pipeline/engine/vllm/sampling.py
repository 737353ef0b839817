"""A row's sampling parameters for the in-process engine: its own values over the model's
defaults, checked against the model's context, with its constrained decoding and its thinking
budget; and the reasoning arguments the engine is built with.

For a model with a reasoning parser the engine is built with vLLM's thinking-token budget
(``ReasoningConfig``), which forces the end tag into a trace that reaches its row's budget. The
notice that says so is not part of the forced text: vLLM 0.32's CPU sampler recognises the end of
a trace only by the whole forced text, so with a notice in it a trace that ends on its own (or a
prompt that switched thinking off) would be taken as still thinking and get the notice forced
into its answer. Instead, the stepping loop (:mod:`.stepping`) continues a row whose trace was cut
from its trace, the notice and the end tag, so the model reads the notice and answers after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.engine.parsing import OutputParser, ThinkingTags
from anex_pipeline.engine.thinking import ThinkingIds, model_thinking
from anex_pipeline.engine.vllm.prompts import RequestProblem
from anex_pipeline.request_fields import NON_SAMPLING_FIELDS, PROMPT_FIELDS, SAMPLING_FIELDS
from anex_pipeline.spec import CONTEXT_LENGTH_EXCEEDED

if TYPE_CHECKING:
    from anex_pipeline.engine.config import EngineSettings

NUMBER_KEYS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
INTEGER_KEYS = ("seed", "top_k", "min_tokens")


@dataclass
class Sampler:
    """Makes the rows' sampling parameters for one loaded model."""

    max_model_len: int  # the context, as the engine resolved it
    defaults: dict[str, Any]  # the model's generation config, under each row's own values
    keep_special_tokens: bool  # the parsers (and raw output) need the model's tags
    thinking: ThinkingIds | None  # the thinking tags, when the engine has a thinking budget
    parser: OutputParser  # what holds a forced tool call: the model's call format, as its parser has it

    def params(self, req: EngineRequest, prompt_len: int) -> Any:
        """The row's ``SamplingParams`` for a prompt of ``prompt_len`` tokens; raises
        :class:`RequestProblem` for a row the model cannot run as it is."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import StructuredOutputsParams

        unknown = sorted(set(req.sampling) - SAMPLING_FIELDS - NON_SAMPLING_FIELDS)
        if unknown:
            raise RequestProblem(f"unknown request parameter '{unknown[0]}'", unknown[0])
        room = self.max_model_len - prompt_len
        if room < 1:
            raise RequestProblem(
                f"the prompt has {prompt_len} tokens but the model's context holds {self.max_model_len}; "
                "shorten the prompt or run on a longer-context model",
                PROMPT_FIELDS[req.endpoint],
                CONTEXT_LENGTH_EXCEEDED,
            )
        cap = req.max_tokens
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise RequestProblem(f"max_tokens must be a positive integer, got {cap!r}", "max_tokens")
        if cap is not None and req.cap_field is not None and cap > room:  # a job-wide figure is cut to fit instead
            raise RequestProblem(
                f"{req.cap_field} is {cap} but the prompt's {prompt_len} tokens leave {room} of the model's "
                f"context of {self.max_model_len}; set {req.cap_field} to at most {room} or shorten the prompt",
                req.cap_field,
                CONTEXT_LENGTH_EXCEEDED,
            )
        for key in NUMBER_KEYS + INTEGER_KEYS:
            value = req.sampling.get(key)
            wanted = int if key in INTEGER_KEYS else (int, float)
            if value is not None and (isinstance(value, bool) or not isinstance(value, wanted)):
                kind = "an integer" if key in INTEGER_KEYS else "a number"
                raise RequestProblem(f"{key} must be {kind}, got {value!r}", key)
        kwargs = {**self.defaults, **req.sampling}
        kwargs["max_tokens"] = min(cap or room, room)
        if isinstance(kwargs.get("logit_bias"), dict):  # JSON keys are strings; vLLM wants token ids
            try:
                kwargs["logit_bias"] = {int(k): float(v) for k, v in kwargs["logit_bias"].items()}
            except (TypeError, ValueError):
                raise RequestProblem("logit_bias must map token ids to numbers", "logit_bias") from None
        if self.keep_special_tokens:  # the parsers (and raw output) need the model's tags
            kwargs.setdefault("skip_special_tokens", False)
        if self.thinking is not None and req.reasoning_budget:
            kwargs["thinking_token_budget"] = req.reasoning_budget
        if req.logprobs is not None:
            kwargs["logprobs"] = req.logprobs
        if req.choices > 1:
            kwargs["n"] = req.choices
        rf = req.response_format
        try:
            forced = (
                self.parser.forced_constraint(req.body, req.chat_template_kwargs) if req.endpoint == "chat" else None
            )
            if forced is not None:  # a forced call wins over response_format, as in vLLM's server
                kwargs["structured_outputs"] = forced
            elif isinstance(req.body.get("structured_outputs"), dict):  # vLLM's own: checked at submit
                kwargs["structured_outputs"] = StructuredOutputsParams(**req.body["structured_outputs"])
            elif rf is not None and rf["type"] == "json_object":
                kwargs["structured_outputs"] = StructuredOutputsParams(json_object=True)
            elif rf is not None:
                kwargs["structured_outputs"] = StructuredOutputsParams(json=rf["json_schema"]["schema"])
            return SamplingParams(**kwargs)
        except (VLLMValidationError, ValueError, TypeError) as exc:
            param = getattr(exc, "parameter", None)
            raise RequestProblem(f"invalid request parameter: {exc}", param) from None


def reasoning_kwargs(settings: EngineSettings, kwargs: dict[str, Any]) -> ThinkingTags | None:
    """Adds the reasoning parser and the thinking budget's tags to the LLM arguments; returns the
    tags (None when the model does not think in tags the budget can use)."""
    if not settings.reasoning_parser:
        return None
    from vllm.config import ReasoningConfig

    _, tags = model_thinking(settings, kwargs)
    # The parser also tells structured outputs where the answer starts, after the thinking.
    kwargs["reasoning_parser"] = settings.reasoning_parser
    if tags is not None:  # the budget forces only the closing tags (see the module docstring)
        kwargs["reasoning_config"] = ReasoningConfig(reasoning_start_str=tags.start, reasoning_end_str=tags.closing)
    return tags
