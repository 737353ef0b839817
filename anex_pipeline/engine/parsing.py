"""Thinking and tool calls in generated chat text, through vLLM's own parsers.

Three things live here:

* which of vLLM's reasoning and tool parsers fit a model, chosen from its config (``model_type``,
  ``architectures``) and its name, unless the job names them (``reasoning_parser`` /
  ``tool_parser``); names are checked against vLLM's registries (``ReasoningParserManager``,
  ``ToolParserManager``);
* the tags that open and close a model's thinking, which the engine needs for its thinking-token
  budget; where a trace was cut by that budget; and the count of thinking tokens in an answer;
* :class:`OutputParser`, which splits raw decoded text (special tokens kept) into the answer, the
  reasoning and OpenAI-shaped tool calls. It composes the parsers the way vLLM's OpenAI server
  does (``ParserManager.get_parser``), so each family gets exactly the server's behaviour,
  GPT-OSS's harmony channels included.

vLLM is imported inside functions only: the Dagster code location imports this module.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anex_pipeline.errors import RejectedError
from anex_pipeline.spec import JobOptions

if TYPE_CHECKING:
    from anex_pipeline.engine.base import EngineRequest

log = logging.getLogger(__name__)

# The line that closes a trace cut short by the thinking budget, before the model's end tag.
BUDGET_NOTICE = "Thinking budget exhausted; answering with what I have."
NOTICE_TEXT = f"\n{BUDGET_NOTICE}\n"

HARMONY_REASONING_PARSER = "openai_gptoss"


@dataclass(frozen=True)
class Family:
    """A model family: how to recognise it and the vLLM parsers its output needs."""

    reasoning: str | None
    tool: str | None
    names: tuple[str, ...] = ()  # fragments of the lower-cased model name or path
    model_types: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()


# Most specific first: a name fragment is tried on every family before any model_type, so
# "DeepSeek-R1" (a deepseek_v3 model that thinks) and "Qwen3-Coder" (no thinking, XML tool
# calls) are told apart from their base families.
FAMILIES: tuple[Family, ...] = (
    # GPT-OSS: harmony channels for both thinking and tool calls.
    Family(HARMONY_REASONING_PARSER, "openai", ("gpt-oss",), ("gpt_oss",), ("GptOssForCausalLM",)),
    Family("kimi_k2", "kimi_k2", ("kimi-k2",), ("kimi_k2", "kimi_k25")),
    # DeepSeek-R1 distilled into Qwen/Llama: R1's thinking, the base model's (absent) tool format.
    Family("deepseek_r1", None, ("deepseek-r1-distill",)),
    Family("deepseek_r1", "deepseek_v3", ("deepseek-r1",)),
    Family("glm47", "glm47", ("glm-4.7", "glm-5"), ("glm_moe_dsa",)),
    Family("glm45", "glm45", ("glm-4.5", "glm-4.6"), ("glm4_moe",), ("Glm4MoeForCausalLM",)),
    Family("minimax_m2", "minimax_m2", ("minimax-m2",), ("minimax_m2",), ("MiniMaxM2ForCausalLM",)),
    Family(None, "qwen3_coder", ("qwen3-coder",)),  # Qwen3-Coder does not think; XML tool calls
    Family(
        "qwen3",
        "hermes",
        ("qwen3",),
        ("qwen3", "qwen3_moe", "qwen3_next"),
        ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"),
    ),
)


class ParserChoiceError(RejectedError, ValueError):
    """A job names a parser vLLM does not have, or asks for parsing the model has no parser for."""


@dataclass(frozen=True)
class ParserNames:
    """The vLLM parser names in force for a model (None: the model has none of that kind)."""

    reasoning: str | None = None
    tool: str | None = None


def family_of(config: Mapping[str, Any], name: str) -> Family | None:
    """The family a model belongs to, from its name first, then its config."""
    lowered = name.lower()
    for family in FAMILIES:
        if any(fragment in lowered for fragment in family.names):
            return family
    model_type = config.get("model_type")
    architectures = set(config.get("architectures") or ())
    for family in FAMILIES:
        if model_type in family.model_types or architectures & set(family.architectures):
            return family
    return None


def read_model_config(model: str) -> dict[str, Any]:
    """The model's ``config.json`` from its folder or the local Hugging Face cache; never downloads.

    An empty dict when neither has it: the family is then told by the name alone.
    """
    path = Path(model).expanduser() / "config.json"
    if not path.is_file():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(model, "config.json")
        except ValueError:  # not a valid repo id either
            cached = None
        if not isinstance(cached, str):
            return {}
        path = Path(cached)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def registered_parsers() -> tuple[list[str], list[str]]:
    """The names vLLM's registries know: (reasoning parsers, tool parsers)."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    return ReasoningParserManager.list_registered(), ToolParserManager.list_registered()


def check_parser_names(reasoning: str | None, tool: str | None) -> None:
    """Raises :class:`ParserChoiceError` naming the valid choices when a name is not registered."""
    known_reasoning, known_tool = registered_parsers()
    problems = []
    if reasoning is not None and reasoning not in known_reasoning:
        problems.append(
            f"reasoning_parser {reasoning!r} is not one of vLLM's reasoning parsers: {', '.join(known_reasoning)}"
        )
    if tool is not None and tool not in known_tool:
        problems.append(f"tool_parser {tool!r} is not one of vLLM's tool parsers: {', '.join(known_tool)}")
    if problems:
        raise ParserChoiceError("; ".join(problems))


def choose_parsers(model: str, model_name: str, options: JobOptions) -> ParserNames:
    """The parsers for a job's model: the job's named ones, else the model family's.

    ``model`` is what vLLM loads (a folder or a hub id), ``model_name`` the name the job gave.
    Raises :class:`ParserChoiceError` for an unknown name, or when the job turns on
    ``parse_thinking`` / ``parse_tool_calls`` for a model that has no such parser.
    """
    family = family_of(read_model_config(model), f"{model_name} {model}")
    reasoning = options.reasoning_parser or (family.reasoning if family else None)
    tool = options.tool_parser or (family.tool if family else None)
    if reasoning is not None or tool is not None:
        check_parser_names(reasoning, tool)
    missing = [
        f"{flag} is on but model '{model_name}' has no known {kind} parser; name one with the {option} option"
        for flag, kind, option, name in (
            ("parse_thinking", "reasoning", "reasoning_parser", reasoning),
            ("parse_tool_calls", "tool-call", "tool_parser", tool),
        )
        if getattr(options, flag) and name is None
    ]
    if missing:
        raise ParserChoiceError("; ".join(missing))
    return ParserNames(reasoning, tool)


# -- thinking tags -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThinkingTags:
    """Where a model's thinking starts and ends."""

    start: str
    end: str
    resume: str = ""  # what follows the end tag before the answer (harmony opens its final channel)
    # Tokens that end a trace without its end tag because they open the answer (qwen3's reasoner
    # takes a <tool_call> in a trace as its end); vLLM's thinking budget knows only the end tag.
    implicit_ends: tuple[str, ...] = ()

    @property
    def closing(self) -> str:
        """What closes a trace for the budget: the end tag and whatever leads into the answer."""
        return self.end + self.resume


# Parsers that do not declare their tags (harmony parses channels from token ids instead).
_DECLARED_ELSEWHERE = {
    HARMONY_REASONING_PARSER: ThinkingTags(
        "<|channel|>analysis<|message|>", "<|end|>", "<|start|>assistant<|channel|>final<|message|>"
    ),
}


def thinking_tags(reasoning_parser: str, tokenizer: Any) -> ThinkingTags | None:
    """The thinking tags of the named reasoning parser, or None if it has none."""
    if reasoning_parser in _DECLARED_ELSEWHERE:
        return _DECLARED_ELSEWHERE[reasoning_parser]
    from vllm.reasoning import ReasoningParserManager

    parser = ReasoningParserManager.get_reasoning_parser(reasoning_parser)(tokenizer)
    start, end = parser.reasoning_start_str, parser.reasoning_end_str
    if not (start and end):
        return None
    ends = getattr(parser, "reasoning_end_token_ids", None) or ()  # the engine-based parsers' ends
    implicit = tuple(sorted(t for t in tokenizer.convert_ids_to_tokens(sorted(ends)) if t != end))
    return ThinkingTags(start, end, implicit_ends=implicit)


def _last_index(ids: Sequence[int], pattern: Sequence[int]) -> int:
    n = len(pattern)
    for i in range(len(ids) - n, -1, -1):
        if list(ids[i : i + n]) == list(pattern):
            return i
    return -1


def _opened_by_prompt(prompt_ids: Sequence[int], start_ids: Sequence[int], end_ids: Sequence[int]) -> bool:
    """Whether the prompt ends inside a trace (its generation prompt opened one)."""
    return _last_index(prompt_ids, start_ids) > _last_index(prompt_ids, end_ids)


def _first_index(ids: Sequence[int], pattern: Sequence[int], start: int = 0) -> int:
    n = len(pattern)
    for i in range(start, len(ids) - n + 1):
        if list(ids[i : i + n]) == list(pattern):
            return i
    return -1


def budget_cut(
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    start_ids: Sequence[int],
    end_ids: Sequence[int],
    budget: int,
) -> int | None:
    """Where the first trace of an answer was closed because it reached ``budget``: the index in
    ``output_ids`` of its end tag, or None when it ended sooner (or never ended, or never began).

    Counts as vLLM's budget does: thinking tokens of a trace the prompt opened count too.
    """
    if _opened_by_prompt(prompt_ids, start_ids, end_ids):
        thought = len(prompt_ids) - _last_index(prompt_ids, start_ids) - len(start_ids)
        begin = 0
    else:
        opened = _first_index(output_ids, start_ids)
        if opened < 0:
            return None
        thought, begin = 0, opened + len(start_ids)
    end = _first_index(output_ids, end_ids, begin)
    return end if end >= 0 and thought + end - begin >= budget else None


def implicit_end(
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    start_ids: Sequence[int],
    end_ids: Sequence[int],
    implicit_ids: Collection[int],
) -> int | None:
    """Where the first trace of an answer ended on a token that opens the answer (one of
    ``implicit_ids``) before its end tag: that token's index in ``output_ids``, or None."""
    if not implicit_ids:
        return None
    if _opened_by_prompt(prompt_ids, start_ids, end_ids):
        begin = 0
    else:
        opened = _first_index(output_ids, start_ids)
        if opened < 0:
            return None
        begin = opened + len(start_ids)
    end = _first_index(output_ids, end_ids, begin)
    for i in range(begin, len(output_ids) if end < 0 else end):
        if output_ids[i] in implicit_ids:
            return i
    return None


def count_thinking_tokens(
    prompt_ids: Sequence[int], output_ids: Sequence[int], start_ids: Sequence[int], end_ids: Sequence[int]
) -> int:
    """Output tokens inside thinking blocks, tags excluded (a notice forced into a trace counts).
    An answer whose prompt opened a block and left it open starts inside it."""
    inside = _opened_by_prompt(prompt_ids, start_ids, end_ids)
    count, i = 0, 0
    while i < len(output_ids):
        if start_ids and list(output_ids[i : i + len(start_ids)]) == list(start_ids):
            inside, i = True, i + len(start_ids)
        elif inside and list(output_ids[i : i + len(end_ids)]) == list(end_ids):
            inside, i = False, i + len(end_ids)
        else:
            count += int(inside)
            i += 1
    return count


# -- parsing -------------------------------------------------------------------------------------


@dataclass
class Parsed:
    """A chat answer split into its parts (OpenAI shapes)."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    forced: str | None = None  # "required" or "named" when the row forced a call (see forced_kind)


class OutputParser:
    """Splits one model's raw answers with vLLM's parsers, as vLLM's OpenAI server would."""

    def __init__(self, tokenizer: Any, names: ParserNames, *, harmony: bool = False):
        self.tokenizer = tokenizer
        self.names = names
        self.harmony = harmony
        self._classes: dict[tuple[str | None, str | None], Any] = {}
        if names.reasoning or names.tool:
            self._composed(names.reasoning, names.tool)  # fails now if the tokenizer lacks their tokens

    def _composed(self, reasoning: str | None, tool: str | None) -> Any:
        """vLLM's parser class for this pair (each half may be off), built once."""
        key = (reasoning, tool)
        if key not in self._classes:
            from vllm.parser.parser_manager import ParserManager

            composed = ParserManager.get_parser(
                tool_parser_name=tool,
                reasoning_parser_name=reasoning,
                enable_auto_tools=tool is not None,
                is_harmony=self.harmony,
                tokenizer=self.tokenizer,
            )
            # For harmony vLLM sets the pair on its one shared HarmonyParser class, so a later
            # combination would change an earlier one: pin each pair on a subclass of its own.
            pinned = {
                "reasoning_parser_cls": composed.reasoning_parser_cls,
                "tool_parser_cls": composed.tool_parser_cls,
            }
            self._classes[key] = type(composed.__name__, (composed,), pinned)
        return self._classes[key]

    def row_answer(self, req: EngineRequest, text: str, output_ids: Sequence[int], prompt_ids: Sequence[int]) -> Parsed:
        """A row's answer split as the row asks (completions keep the raw text). A parser that
        chokes on odd output does not cost the row its answer: the raw text is delivered."""
        if req.endpoint != "chat":
            return Parsed(content=text)
        try:
            return self.parse(
                text,
                output_ids,
                prompt_ids,
                req.body,
                req.chat_template_kwargs,
                thinking=req.parse_thinking,
                tools=req.parse_tool_calls,
            )
        except Exception:
            log.warning("row %s: the output parsers failed; delivering the raw text", req.key, exc_info=True)
            return Parsed(content=text)

    def parse(
        self,
        text: str,
        output_ids: Sequence[int],
        prompt_ids: Sequence[int],
        body: Mapping[str, Any],
        chat_template_kwargs: Mapping[str, Any],
        *,
        thinking: bool = True,
        tools: bool = True,
    ) -> Parsed:
        """Splits ``text`` (decoded with special tokens kept; ``output_ids`` are its tokens).

        ``thinking`` / ``tools`` turn each half on; tool calls are looked for only when the row
        offers ``tools``. With both off, or for a model without parsers, ``text`` comes back whole.
        """
        forced = forced_tool_schema(body) is not None
        reasoning = self.names.reasoning if thinking else None
        # A forced call is read by the tool parser whatever parse_tool_calls says, as it was made by it.
        by_parser = forced and self.names.tool is not None
        tool = self.names.tool if by_parser or (tools and body.get("tools") and not forced) else None
        if reasoning is None and tool is None:
            parsed = Parsed(content=text)
        else:
            request = _chat_request(body, chat_template_kwargs, tool is not None, forced=by_parser)
            parser = self._composed(reasoning, tool)(
                self.tokenizer, request.tools, chat_template_kwargs=dict(chat_template_kwargs)
            )
            parser.set_prompt_token_ids(list(prompt_ids))
            request = parser.adjust_request(request)
            found_reasoning, content, calls = parser.parse(
                text, request, enable_auto_tools=tool is not None, model_output_token_ids=list(output_ids)
            )
            parsed = Parsed(content, found_reasoning, [_openai_call(c) for c in calls or []])
        if forced and not by_parser:  # no tool parser: the answer is the forced call's JSON
            parsed.tool_calls, parsed.content = forced_calls(parsed.content, body), None
        if body.get("parallel_tool_calls") is False:  # as vLLM's server: the first call only
            parsed.tool_calls = parsed.tool_calls[:1]
        parsed.forced = forced_kind(body)
        return parsed

    def forced_constraint(self, body: Mapping[str, Any], chat_template_kwargs: Mapping[str, Any]) -> Any:
        """The ``StructuredOutputsParams`` that hold a row's forced tool call (None when the row
        forces none), as vLLM's server builds them: the model's own call format as an xgrammar
        structural tag where its tool parser has one (hermes' ``<tool_call>{...}</tool_call>``),
        else the JSON of :func:`forced_tool_schema`.

        The tag matters on a thinking model: a trace that writes the call's opening tag (an
        implicit end of thinking for qwen3's reasoner) hands that very token to the grammar,
        which the model's format accepts and a JSON grammar refuses, failing the row.
        """
        schema = forced_tool_schema(body)
        if schema is None:
            return None
        from vllm.sampling_params import StructuredOutputsParams

        if self.names.tool is None:
            return StructuredOutputsParams(json=schema)
        request = _chat_request(body, chat_template_kwargs, with_tools=True, forced=True)
        parser = self._composed(self.names.reasoning, self.names.tool)(
            self.tokenizer, request.tools, chat_template_kwargs=dict(chat_template_kwargs)
        )
        constraint = parser.adjust_request(request).structured_outputs
        return constraint if constraint is not None else StructuredOutputsParams(json=schema)


def forced_kind(body: Mapping[str, Any]) -> str | None:
    """How a chat row forces a tool call: ``"required"``, ``"named"`` or None (it does not)."""
    choice = body.get("tool_choice")
    if not body.get("tools"):
        return None
    return "required" if choice == "required" else "named" if isinstance(choice, dict) else None


def forced_tool_schema(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The JSON schema generation is held to when a chat row forces a tool call, built by vLLM's
    server code: the named function's parameters, or for ``"required"`` a list of calls to the
    row's functions (at most one when ``parallel_tool_calls`` is false). None when none is forced."""
    if forced_kind(body) is None:
        return None
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    request = _chat_request(body, {}, with_tools=True, forced=True)
    schema = get_json_schema_from_tools(request.tool_choice, request.tools, request.parallel_tool_calls)
    return schema if isinstance(schema, dict) else json.loads(schema)


def forced_calls(content: str | None, body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The calls in an answer generated under :func:`forced_tool_schema`, read as vLLM's parsers
    read them: a named function's arguments, or a list of ``{"name", "parameters"}`` objects."""
    from pydantic import TypeAdapter, ValidationError
    from vllm.entrypoints.generate.base.protocol import FunctionCall, FunctionDefinition

    text = (content or "").strip()
    choice = body["tool_choice"]
    if isinstance(choice, dict):
        return [_openai_call(FunctionCall(name=choice["function"]["name"], arguments=text))] if text else []
    try:
        defined = TypeAdapter(list[FunctionDefinition]).validate_json(text)
    except ValidationError:  # cut at the cap: no whole call
        return []
    return [_openai_call(FunctionCall(name=d.name, arguments=json.dumps(d.parameters or {}))) for d in defined]


def _chat_request(
    body: Mapping[str, Any], chat_template_kwargs: Mapping[str, Any], with_tools: bool, forced: bool = False
) -> Any:
    """The vLLM request object the parsers read (tools, tool_choice, template arguments); with
    ``forced``, the row's own tool_choice and parallel_tool_calls."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    fields: dict[str, Any] = {"model": "batch", "chat_template_kwargs": dict(chat_template_kwargs)}
    if with_tools:
        choice = body.get("tool_choice")
        if forced:
            fields.update(tools=body["tools"], tool_choice=choice, parallel_tool_calls=body.get("parallel_tool_calls"))
        else:  # the model's own tool format, read as with "auto"
            fields.update(tools=body["tools"], tool_choice="none" if choice == "none" else "auto")
    try:
        return ChatCompletionRequest(messages=body.get("messages") or [], **fields)
    except ValidationError:  # a message shape vLLM's protocol does not take: the parsers need no history
        return ChatCompletionRequest(messages=[], **fields)


def _openai_call(call: Any) -> dict[str, Any]:
    from vllm.renderers.chat_utils import make_tool_call_id

    arguments = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
    return {
        "id": call.id or make_tool_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }
