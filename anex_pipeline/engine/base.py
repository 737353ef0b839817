"""The engine interface, and how a stored row becomes a request for it.

An engine takes a list of :class:`EngineRequest` and returns one
:class:`~anex_pipeline.spec.RowOutcome` per request, whose body is already the OpenAI response
object. Everything after generation is therefore the same for every engine.
"""

from __future__ import annotations

import hashlib
import itertools
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from anex_pipeline.engine import prefix_order
from anex_pipeline.engine.adapters import row_adapter
from anex_pipeline.engine.prefix_order import PrefixCache
from anex_pipeline.errors import RowErrorType
from anex_pipeline.request_fields import AUDIO, CAP_FIELDS, NON_SAMPLING_FIELDS, POOLING, fields_of
from anex_pipeline.spec import Endpoint, InputRow, JobOptions, RowError, RowOutcome


@dataclass
class EngineRequest:
    """One row, resolved against the job's options and estimate, ready for an engine."""

    index: int
    key: str
    request_id: str
    endpoint: Endpoint
    body: dict[str, Any]
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    cap_field: str | None = None  # the body field that set max_tokens; None: the job's figure did
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_budget: int | None = None  # None: no cap
    # Split thinking / tool calls out of chat answers, where the model has a parser for them.
    parse_thinking: bool = True
    parse_tool_calls: bool = True
    # A /v1/responses row, run as chat: its request as written, from which its answer is built.
    respond: dict[str, Any] | None = None
    # The rendered prompt's tokens, when an engine made them ahead of sending (to order rows).
    prompt_ids: array[int] | None = None
    # Logprobs for every generated token, with this many alternatives each; None: no logprobs.
    logprobs: int | None = None
    choices: int = 1  # the row's n: answers generated for its prompt
    adapter: str | None = None  # the LoRA adapter the row runs on (its name); None: the base model
    # The job's labels option: the row is held to one of them and its answer carries its probability.
    labels: tuple[str, ...] | None = None
    labels_only_logprobs: bool = False  # the logprobs were asked for the label's probability alone

    @property
    def template_arguments(self) -> dict[str, Any]:
        """The chat template's arguments, as vLLM's server gives them: whether the prompt ends
        with a new assistant turn or continues the last message (vLLM's extras, default a new
        turn), then the row's own arguments and those its reasoning effort set."""
        continues = self.body.get("continue_final_message") is True
        return {
            "add_generation_prompt": self.body.get("add_generation_prompt", not continues),
            "continue_final_message": continues,
            **self.chat_template_kwargs,
        }

    @property
    def constraint_field(self) -> str | None:
        """The field whose constraint holds the row's generation, if any."""
        if self.body.get("structured_outputs") is not None:
            return "structured_outputs"
        return "response_format" if self.response_format is not None else None

    @property
    def constrained(self) -> bool:
        return self.constraint_field is not None


# Called by an engine's ``stream`` once per engine step (each scheduler step, each finished HTTP
# request, each group for an engine without steps); it raises to stop the stream, which then
# aborts the rows still in flight. It must be cheap: see anex_pipeline.stopping.StopCheck.
StopCheck = Callable[[], None]


class Engine(ABC):
    """What the pipeline needs from a model runtime: :meth:`run`, and the optional parts below,
    whose defaults fit an engine that offers nothing more (it runs rows in groups, has no prefix
    cache, holds nothing to release and never dies).

    An engine becomes usable by jobs with one line, ``register_engine(kind, factory)`` in
    :mod:`anex_pipeline.engine.loader`.
    """

    model_name: str
    # Whether the engine can no longer be used (vLLM's engine process died): the loader shuts it
    # down and loads a new one the next time it is asked for it.
    dead: bool = False
    # The engine's prefix cache, if it keeps computed prompt blocks: rows sharing a prompt prefix
    # are then sent to it together (anex_pipeline.engine.prefix_order), by their prompt_tokens.
    prefix_cache: PrefixCache | None = None
    # Whether everything the engine holds ends with this process (no process, file, lease or
    # server of its own outlives it): a process that is about to end then need not shut it down.
    ends_with_process: bool = False

    @abstractmethod
    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        """Generates (or embeds) every request; per-row problems come back as failed outcomes."""

    def stream(
        self, requests: Iterable[EngineRequest], group_rows: int, stop: StopCheck | None = None
    ) -> Iterator[list[RowOutcome]]:
        """Yields the requests' outcomes as they finish, calling ``stop`` once per engine step;
        closing the generator drops the rows still in flight. By default, :meth:`run` over
        ``group_rows`` requests at a time, with ``stop`` called before each group."""
        return in_groups(self.run, iter(requests), group_rows, stop)

    def prompt_tokens(self, request: EngineRequest) -> Sequence[int] | None:
        """The tokens of the request's rendered prompt, for ordering rows by prefix; None when they
        are not known (by default), which sends the row after the ordered ones."""
        return None

    def prompts_tokens(
        self, requests: Sequence[EngineRequest], stop: StopCheck | None = None
    ) -> list[Sequence[int] | None]:
        """:meth:`prompt_tokens` of each request in turn, ``stop`` checked every few hundred."""
        tokens = []
        for n, req in enumerate(requests):
            if stop is not None and n % prefix_order.STOP_CHECK_ROWS == 0:
                stop()
            tokens.append(self.prompt_tokens(req))
        return tokens

    def shutdown(self) -> None:
        """Releases what the engine holds (its model, its connections); by default nothing."""
        return None

    def wait_idle(self) -> None:
        """Returns once no stream or run of this process is using the engine, so that it can be
        shut down without failing their rows; by default at once."""
        return None

    def let_go(self) -> None:
        """Instead of :meth:`shutdown`, for an engine that ``ends_with_process`` in a process that
        is about to end: undoes whatever would shut it down at exit; by default nothing."""
        return None

    def report_section(self) -> dict[str, Any]:
        """The report's account of the engine (its ``engine`` section): by default its class and model."""
        return {"kind": type(self).__name__, "model": self.model_name}


def resolve_request(
    row: InputRow,
    job_id: str,
    endpoint: Endpoint,
    options: JobOptions,
    max_tokens: int | None,
    reasoning_budget: int | None,
) -> EngineRequest:
    """Applies the precedence rules: the row's own values win over the job's defaults.

    ``max_tokens`` and ``reasoning_budget`` are the job-level figures in force (the user's or
    the estimate's); a budget of 0 means no cap. A /v1/responses row runs as the chat row it means.
    """
    body = row.body
    if endpoint == "responses":
        endpoint = "chat"
    labels = tuple(options.labels) if options.labels and endpoint == "chat" else None
    asked_logprobs = body.get("logprobs") is True
    if labels is not None:  # held to the labels, with the logprobs their probability is read from
        body = {**body, "structured_outputs": {"choice": list(labels)}, "logprobs": True}
    sampling = options.sampling_defaults()
    sampling.update({k: v for k, v in body.items() if k not in NON_SAMPLING_FIELDS})
    if endpoint in AUDIO:  # a sound's request takes fewer sampling fields: the job's others do not apply
        sampling = {k: v for k, v in sampling.items() if k in fields_of(endpoint)}
    cap_field = next((name for name in CAP_FIELDS if body.get(name) is not None), None)
    row_cap = body[cap_field] if cap_field is not None else None
    if cap_field is not None and row.respond is not None:
        cap_field = "max_output_tokens"  # the row's own name for it
    # a sound's response_format names the answer's shape (json, text, verbose_json), not a constraint
    response_format = None if endpoint in AUDIO else body.get("response_format", options.response_format)
    if body.get("structured_outputs") is not None:  # the row's own constraint replaces the job's format
        response_format = None
    if response_format is not None and response_format.get("type") == "text":
        response_format = None
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if options.reasoning is not None:
        kwargs.setdefault("enable_thinking", options.reasoning)
    effort = body.get("reasoning_effort")
    if effort is not None:  # as vLLM's server renders it: the template's argument, thinking on unless "none"
        kwargs["reasoning_effort"] = effort
        kwargs.setdefault("enable_thinking", effort != "none")
    digest = hashlib.sha256(f"{job_id}\0{row.key}".encode()).hexdigest()[:24]
    return EngineRequest(
        index=row.index,
        key=row.key,
        request_id=digest,
        endpoint=endpoint,
        body=body,
        sampling=sampling,
        max_tokens=row_cap if row_cap is not None else max_tokens,
        cap_field=cap_field,
        response_format=response_format if endpoint not in POOLING else None,
        chat_template_kwargs=kwargs,
        reasoning_budget=body.get("thinking_token_budget", reasoning_budget) or None,  # the row's own wins
        parse_thinking=options.parse_thinking is not False,
        parse_tool_calls=options.parse_tool_calls is not False,
        respond=row.respond,
        logprobs=logprobs_asked(endpoint, body),
        choices=body.get("n") or 1,
        adapter=row_adapter(body, options.lora_modules, options.adapter),
        labels=labels,
        labels_only_logprobs=labels is not None and not asked_logprobs,
    )


def logprobs_asked(endpoint: Endpoint, body: dict[str, Any]) -> int | None:
    """How many alternatives each generated token's logprobs list, or None when the row asks for
    none: chat asks with ``logprobs: true`` and ``top_logprobs``, completions with ``logprobs: k``."""
    if endpoint == "chat":
        return (body.get("top_logprobs") or 0) if body.get("logprobs") is True else None
    if endpoint == "completions":
        wanted = body.get("logprobs")
        return wanted if type(wanted) is int else None
    return None


def collect(
    stream: Callable[[Iterable[EngineRequest], int], Iterator[list[RowOutcome]]], requests: Sequence[EngineRequest]
) -> list[RowOutcome]:
    """An engine's ``run`` on top of its ``stream``: every outcome, in the order of the requests."""
    outcomes = {o.index: o for group in stream(requests, max(1, len(requests))) for o in group}
    return [outcomes[r.index] for r in requests]


def in_groups(
    run: Callable[[list[EngineRequest]], list[RowOutcome]],
    requests: Iterator[EngineRequest],
    group_rows: int,
    stop: StopCheck | None,
) -> Iterator[list[RowOutcome]]:
    """``run`` over the requests ``group_rows`` at a time, checking for a stop before each group."""
    while True:
        if stop is not None:
            stop()
        group = list(itertools.islice(requests, group_rows))
        if not group:
            return
        yield run(group)


def rejected(request: EngineRequest, message: str, param: str | None = None, code: str | None = None) -> RowOutcome:
    """A row the model or the request layer refused: status 400, invalid_request_error."""
    return RowOutcome(
        index=request.index,
        key=request.key,
        status_code=400,
        error=RowError(message=message, type=RowErrorType.INVALID_REQUEST, code=code, param=param),
    )


def engine_failure(request: EngineRequest, message: str) -> RowOutcome:
    """A row lost to an engine fault rather than to anything in the row itself."""
    return RowOutcome(
        index=request.index,
        key=request.key,
        status_code=500,
        error=RowError(message=message, type=RowErrorType.ENGINE),
    )
