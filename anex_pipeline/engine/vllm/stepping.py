"""The in-process engine's stepping loop: rows go into vLLM's engine (``LLMEngine.add_request``)
as it has room and come back after each ``step``, so the batch never drains; each row vLLM
refuses fails alone, and a row whose thinking trace the budget cut is continued after the notice
(see :mod:`.sampling`). A row asking for several choices (``n``) is not continued: vLLM's budget
closes each trace with the end tag alone."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from anex_pipeline.engine.adapters import AdapterRequests
from anex_pipeline.engine.base import EngineRequest, StopCheck, rejected
from anex_pipeline.engine.sharing import Lane, Lanes
from anex_pipeline.engine.thinking import ThinkingIds
from anex_pipeline.engine.vllm.outputs import Answer, Flight, OutputShaper
from anex_pipeline.engine.vllm.prompts import PromptRenderer, RequestProblem
from anex_pipeline.engine.vllm.sampling import Sampler
from anex_pipeline.engine.vllm.watchdog import EngineWatch, engine_gone
from anex_pipeline.spec import RowOutcome

log = logging.getLogger(__name__)


@dataclass
class Stepper:
    """Streams rows through one loaded ``vllm.LLM``; the streams of several threads share it
    (:mod:`anex_pipeline.engine.sharing`)."""

    llm: Any
    prompts: PromptRenderer
    sampler: Sampler
    outputs: OutputShaper
    watch: EngineWatch
    lanes: Lanes  # the streams running at once on this engine
    adapters: AdapterRequests  # the LoRA adapters rows may run on
    _request_ids: Iterator[int] = field(default_factory=itertools.count)

    @property
    def thinking(self) -> ThinkingIds | None:
        return self.sampler.thinking

    @property
    def tokenizer(self) -> Any:
        return self.prompts.tokenizer

    def stream(self, requests: Iterable[EngineRequest], stop: StopCheck | None = None) -> Iterator[list[RowOutcome]]:
        """Generates the rows with the engine kept full: requests are pulled from ``requests`` as
        the engine has room, and the rows each engine step finished come back after that step. A
        row vLLM refuses fails alone. ``stop`` is called before every step; when it raises, or the
        generator is closed early, the rows still in flight are aborted. Streams running at once
        in several threads share the engine (:mod:`anex_pipeline.engine.sharing`): their rows are
        batched together."""
        source = iter(requests)
        engine = self.llm.llm_engine
        # Twice what the engine runs at once keeps it full; more would only wait in vLLM's queue,
        # first come first served, where a stream that starts later would wait behind it.
        room = 2 * engine.vllm_config.scheduler_config.max_num_seqs
        lane = self.lanes.join()
        done: list[RowOutcome] = []
        more = True
        try:
            with self.watch.call(self.llm):
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
                if lane.flights and not self.watch.dead:
                    engine.abort_request(list(lane.flights))
                self.lanes.leave(lane)

    def _start(self, req: EngineRequest, lane: Lane, done: list[RowOutcome]) -> None:
        """Hands one row to the engine, or records why it cannot run."""
        try:
            prompt, ids = self.prompts.prompt(req)
            params = self.sampler.params(req, len(ids))
            self._send(Flight(req, ids, params), prompt, params, lane)
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

    def _send(self, flight: Flight, prompt: Any, params: Any, lane: Lane) -> None:
        """Adds one generation to the engine. If vLLM fails to take it, nothing of it stays in the
        engine (vLLM registers a request before it hands it to its engine process) and the error
        is raised; a constraint vLLM refuses on its own is blamed on the field that set it."""
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per row, when it finishes
        request_id = f"anex-{next(self._request_ids)}"
        engine = self.llm.llm_engine
        priority = self._priority(flight.req)
        with self.lanes.lock:
            try:
                engine.add_request(
                    request_id,
                    prompt,
                    params,
                    lora_request=self.adapters.get(flight.req.adapter),
                    priority=priority,
                )
            except Exception as exc:
                if engine_gone(self.llm):
                    raise
                engine.abort_request([request_id])
                field = flight.req.constraint_field
                if field and getattr(exc, "parameter", None) is None and not self._constraint_usable(params):
                    raise RequestProblem(f"{field} cannot be used: {one_line(exc)}", field) from None
                raise
            self.lanes.own(lane, request_id, flight)

    def _priority(self, req: EngineRequest) -> int:
        """The row's place in the scheduler's order (vLLM's ``priority``, lower first), which only
        a priority-scheduled engine keeps: elsewhere any value but 0 is refused."""
        priority = req.body.get("priority") or 0
        if priority and self.llm.llm_engine.vllm_config.scheduler_config.policy != "priority":
            raise RequestProblem(
                "priority needs an engine that schedules by priority; start it with "
                "--engine-arg scheduling_policy=priority, or remove priority",
                "priority",
            )
        return priority

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

    def _land(self, flight: Flight, res: Any, lane: Lane, done: list[RowOutcome]) -> None:
        """A finished generation: the row's outcome, or the continuation of a trace the budget cut."""
        if flight.head is None:
            flight.cached_tokens = res.num_cached_tokens or 0
            flight.prompt_logprobs = res.prompt_logprobs
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
        done.append(self.outputs.completion_outcome(flight, answers))

    def _continue_after_notice(self, flight: Flight, answer: Answer, lane: Lane) -> bool:
        """A row whose trace the budget cut: the notice goes before the end tag and the answer is
        generated again after it, within what is left of the row's max_tokens. Returns whether
        the row is still in flight."""
        t, params = self.thinking, flight.params
        budget = params.thinking_token_budget if t is not None else None
        found = None
        if t is not None and budget:
            failed = answer.finish_reason == "error"
            found = t.continuation(flight.prompt_ids, answer.token_ids, budget, params.max_tokens, failed=failed)
        if found is None:
            return False
        cut, head = found
        flight.head = head
        flight.head_text = self.tokenizer.decode(head, skip_special_tokens=params.skip_special_tokens)
        if answer.logprobs is not None:  # the forced notice and end tag were never sampled
            flight.head_logprobs = (answer.logprobs[:cut] + [None] * len(head))[: len(head)]
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
        prompt, _ = self.prompts.prompt(flight.req)
        self._send(flight, {**prompt, "prompt_token_ids": flight.prompt_ids + head}, follow, lane)
        return True


def one_line(exc: BaseException) -> str:
    """An error's text on one line (vLLM's grammar errors point at the fault over several)."""
    return " ".join(str(exc).split())
