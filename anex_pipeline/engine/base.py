"""The engine interface, and how a stored row becomes a request for it.

An engine takes a list of :class:`EngineRequest` and returns one
:class:`~anex_pipeline.spec.RowOutcome` per request, whose body is already the OpenAI response
object. Everything after generation is therefore the same for every engine.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from anex_pipeline.engine.structured import mark_completion
from anex_pipeline.formats import InputRow
from anex_pipeline.request_fields import NON_SAMPLING_FIELDS
from anex_pipeline.spec import Endpoint, JobOptions, RowError, RowOutcome


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
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_budget: int | None = None  # None: no cap
    # Split thinking / tool calls out of chat answers, where the model has a parser for them.
    parse_thinking: bool = True
    parse_tool_calls: bool = True

    @property
    def constrained(self) -> bool:
        return self.response_format is not None


class Engine(Protocol):
    """What the pipeline needs from a model runtime."""

    model_name: str

    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        """Generates (or embeds) every request; per-row problems come back as failed outcomes."""
        ...


# Called by an engine's ``stream`` once per engine step (each scheduler step, each finished HTTP
# request, each group for an engine without steps); it raises to stop the stream, which then
# aborts the rows still in flight. It must be cheap: see anex_pipeline.stopping.StopCheck.
StopCheck = Callable[[], None]


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
    the estimate's); a budget of 0 means no cap.
    """
    body = row.body
    sampling = options.sampling_defaults()
    sampling.update({k: v for k, v in body.items() if k not in NON_SAMPLING_FIELDS})
    row_cap = body.get("max_completion_tokens", body.get("max_tokens"))
    response_format = body.get("response_format", options.response_format)
    if response_format is not None and response_format.get("type") == "text":
        response_format = None
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if options.reasoning is not None:
        kwargs.setdefault("enable_thinking", options.reasoning)
    digest = hashlib.sha256(f"{job_id}\0{row.key}".encode()).hexdigest()[:24]
    return EngineRequest(
        index=row.index,
        key=row.key,
        request_id=digest,
        endpoint=endpoint,
        body=body,
        sampling=sampling,
        max_tokens=row_cap if row_cap is not None else max_tokens,
        response_format=response_format if endpoint != "embeddings" else None,
        chat_template_kwargs=kwargs,
        reasoning_budget=body.get("thinking_token_budget", reasoning_budget) or None,  # the row's own wins
        parse_thinking=options.parse_thinking is not False,
        parse_tool_calls=options.parse_tool_calls is not False,
    )


def run_checked(engine: Engine, requests: Sequence[EngineRequest], stop: StopCheck | None = None) -> list[RowOutcome]:
    """Runs the requests and applies the after-generation checks (cap reached, format) to each;
    ``stop`` is checked per engine step when the engine streams, else before it starts."""
    stream = getattr(engine, "stream", None)
    if stop is not None and stream is not None:
        outcomes = collect(lambda reqs, rows: stream(reqs, rows, stop), requests)
    else:
        if stop is not None:
            stop()
        outcomes = engine.run(requests)
    return [mark_completion(o, r.response_format, r.endpoint) for o, r in zip(outcomes, requests, strict=True)]


def stream_checked(
    engine_for: Callable[[], Engine],
    requests: Iterable[EngineRequest],
    group_rows: int,
    stop: StopCheck | None = None,
) -> Iterator[list[RowOutcome]]:
    """Runs the requests and yields their checked outcomes as they finish.

    An engine with a ``stream`` method is kept busy (it pulls requests as it has room, about
    ``group_rows`` of them at a time, so the batch never drains) and hands back the rows that
    each of its steps finished; any other engine runs ``group_rows`` rows at a time. ``stop`` is
    checked per engine step. Closing the generator early, or a stop, lets the engine drop the rows
    still in flight. The engine is asked for only once there is a request for it.
    """
    asked: dict[int, EngineRequest] = {}
    pending = iter(requests)
    first = next(pending, None)
    if first is None:
        return

    def recorded() -> Iterator[EngineRequest]:
        for req in itertools.chain([first], pending):
            asked[req.index] = req
            yield req

    engine = engine_for()
    if stop is not None:
        stop()  # a stop that came while the engine loaded
    stream = getattr(engine, "stream", None)
    if stream is not None:
        groups = stream(recorded(), group_rows, stop)
    else:
        groups = in_groups(engine.run, recorded(), group_rows, stop)
    try:
        for group in groups:
            checked = []
            for o in group:
                req = asked.pop(o.index)
                checked.append(mark_completion(o, req.response_format, req.endpoint))
            yield checked
    finally:
        groups.close()


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
        error=RowError(message=message, type="invalid_request_error", code=code, param=param),
    )


def engine_failure(request: EngineRequest, message: str) -> RowOutcome:
    """A row lost to an engine fault rather than to anything in the row itself."""
    return RowOutcome(
        index=request.index,
        key=request.key,
        status_code=500,
        error=RowError(message=message, type="engine_error"),
    )
