"""Driving rows through an engine: split into single-prompt requests, run or stream them, and give
each finished row the checks every engine's rows get before anything stores it.

The engine interface (:mod:`anex_pipeline.engine.base`) knows nothing of this; the stages call
these functions with whichever engine the job runs on.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

from anex_pipeline.engine import prefix_order
from anex_pipeline.engine.base import Engine, EngineRequest, StopCheck, collect
from anex_pipeline.engine.labels import labelled
from anex_pipeline.engine.prompt_parts import PromptParts
from anex_pipeline.engine.structured import mark_completion
from anex_pipeline.responses import as_response
from anex_pipeline.spec import RowOutcome


def run_checked(engine: Engine, requests: Sequence[EngineRequest], stop: StopCheck | None = None) -> list[RowOutcome]:
    """Runs the requests and applies the after-generation checks (cap reached, format) to each;
    ``stop`` is checked per engine step (before and after the run for an engine that keeps the
    default :meth:`Engine.stream`)."""
    prompts = PromptParts()
    parts = list(prompts.split(requests))
    if stop is not None:
        outcomes = collect(lambda reqs, rows: engine.stream(reqs, rows, stop), parts)
    else:
        outcomes = engine.run(parts)
    joined = {o.index: o for o in prompts.join(outcomes)}
    return [checked(joined[r.index], r) for r in requests]


def stream_checked(
    engine_for: Callable[[], Engine],
    requests: Iterable[EngineRequest],
    group_rows: int,
    stop: StopCheck | None = None,
    order: bool = False,
) -> Iterator[list[RowOutcome]]:
    """Runs the requests and yields their checked outcomes as they finish.

    An engine with a ``stream`` of its own is kept busy (it pulls requests as it has room, about
    ``group_rows`` of them at a time, so the batch never drains) and hands back the rows that
    each of its steps finished; any other engine runs ``group_rows`` rows at a time. ``stop`` is
    checked per engine step. Closing the generator early, or a stop, lets the engine drop the rows
    still in flight. The engine is asked for only once there is a request for it. With
    ``order``, an engine that has a prefix cache gets rows sharing a prompt prefix together
    (:mod:`anex_pipeline.engine.prefix_order`).
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
    prompts = PromptParts()  # a completions row of several prompts goes to the engine as one per prompt
    feed = prompts.split(recorded())
    if order and engine.prefix_cache is not None:
        feed = prefix_order.ordered(feed, engine, stop)
    groups = engine.stream(feed, group_rows, stop)
    try:
        for group in groups:
            if rows := prompts.join(group):
                yield [checked(o, asked.pop(o.index)) for o in rows]
    finally:
        groups.close()


def checked(outcome: RowOutcome, request: EngineRequest) -> RowOutcome:
    """A finished row after the checks every engine's rows get (cap reached, format), in the shape
    its endpoint answers in (a /v1/responses row's chat answer becomes a Responses object)."""
    outcome = mark_completion(outcome, request.response_format, request.endpoint)
    if request.labels is not None:
        outcome = labelled(outcome, request.labels, request.labels_only_logprobs)
    return outcome if request.respond is None else as_response(outcome, request.respond)
