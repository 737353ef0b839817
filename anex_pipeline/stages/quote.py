"""A quote of a job before it runs: what it will take in tokens, engine time and cost, and
whether it fits its budgets, worked out without loading an engine.

- Rows and caps come from the same checks ``validate`` and submit make (a malformed file is
  refused with the same problems, and no figures); the caps' sum is the job's token budget's own
  count (:class:`~anex_pipeline.validate.answers.TokenBudget`).
- Prompt tokens are counted with the model's tokenizer and chat template as the in-process engine
  renders each row (:class:`~anex_pipeline.engine.vllm.prompts.TextPrompts`): exact for text. A
  row with media parts is left out of the count (its media tokens are the model processor's).
- Rows the run would not generate are found as the run finds them: by their answer fingerprint,
  in the work folder's answer store (their stored answers' lengths are known exactly) and among
  the job's own rows (copies of an identical deterministic row).
- The expected output of the other rows comes from the output lengths earlier jobs of the folder
  generated on the same model (:mod:`~anex_pipeline.workdir.quotes`), each row's cap applied: a
  row is expected to take the mean of ``min(length, its cap)`` over the earlier rows that ran
  under a cap at least as large (a length cut by a smaller cap says too little). The range is the
  spread between the earlier jobs (the figure each alone would give), widened by a 95% interval
  of the sum of that many rows. Without earlier jobs there is no expected figure, only the caps.
- Engine time is that output over the output tokens per second those jobs measured (the range
  from the slowest and fastest of them), or unknown.
- With ``sample`` rows asked for, the expectation comes from generating that many of the rows to
  generate instead (drawn at random with the job's ``estimate_seed``, rows with media left out),
  on the engine the job would run on: their lengths, each row's cap applied, and the output
  tokens per second the engine kept up on them (loading it not counted). This loads the engine.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from anex_pipeline.engine.base import EngineRequest, resolve_request
from anex_pipeline.engine.config import EngineConfig
from anex_pipeline.engine.loader import engine_for
from anex_pipeline.engine.models import local_model_path, resolve_model
from anex_pipeline.engine.rows import run_checked
from anex_pipeline.request_fields import POOLING
from anex_pipeline.responses import chat_row
from anex_pipeline.spec import Endpoint, InputRow, JobOptions, Quote
from anex_pipeline.stages.generate_answer_book import fingerprint
from anex_pipeline.stages.generate_answer_store import AnswerStore, engine_identity
from anex_pipeline.stages.submit import accepted_rows
from anex_pipeline.validate.answers import TokenBudget, several_prompts
from anex_pipeline.validate.media_refs import media_references
from anex_pipeline.validate.numbers import UNCAPPED_ROW_TOKENS
from anex_pipeline.workdir.manifest import JobManifest
from anex_pipeline.workdir.quotes import EarlierJob, earlier_jobs

Z95 = 1.96


def make_quote(
    path: Path,
    options: JobOptions,
    work_root: Path,
    engine: EngineConfig,
    *,
    local_model: bool = True,
    completion_window_s: int | None = None,
    answer_scope: str = "",
    sample: int = 0,
) -> Quote:
    """The quote of the job ``path`` and ``options`` would be; raises JobRejected with every
    problem of the input as ``validate`` does. ``engine``: the engine settings the job would run
    on (which answers of the store are its own); ``completion_window_s``: a batch's window, which
    the engine time is held against; ``answer_scope``: whose stored answers the job may share;
    ``sample``: rows to generate for the expectation instead of earlier jobs' (0: none)."""
    started = time.monotonic()
    kind, endpoint, rows = accepted_rows(path, options, local_model)
    model, model_name = resolve_model(options.model, endpoint)
    manifest = JobManifest(
        job_id="quote",
        input=str(path),
        input_sha256="",
        output="",
        report="",
        format=kind.name,
        endpoint=endpoint,
        model=model,
        model_name=model_name,
        options=options.model_dump(exclude_defaults=True),
        total_rows=0,
        shards=[],
        submitted_at=time.time(),
        answer_scope=answer_scope,
    )
    counter = _PromptCounter(model, model_name, endpoint) if local_model else None
    store = _store(work_root, engine, manifest, options)
    budget = TokenBudget(options)
    quote = Quote(rows=0, model=model_name, endpoint=endpoint, max_job_tokens=budget.limit)
    seen: set[str] = set()
    stored_tokens = 0
    generated_caps: list[int] = []  # the cap of each row the engine would generate
    drawn = _Draw(sample, options.estimate_seed)
    try:
        for row in _rows(rows, endpoint):
            quote.rows += 1
            req = resolve_request(row, manifest.job_id, endpoint, options, options.max_tokens, options.reasoning_budget)
            budget.add(row.body)
            if counter is not None:
                counter.add(req)
            key = fingerprint(req) if options.reuse_answers else None
            if key is not None and key in seen:
                quote.rows_reused_in_job += 1
                continue
            if key is not None:
                seen.add(key)
            known = store.get(key) if store is not None and key is not None else None
            if known is not None:
                quote.rows_from_answer_store += 1
                stored_tokens += known.usage.get("completion_tokens", 0)
            elif endpoint not in POOLING:
                generated_caps.append((req.max_tokens or UNCAPPED_ROW_TOKENS) * req.choices)
                drawn.offer(req)
    finally:
        if store is not None:
            store.close()
    quote.output_tokens_cap = budget.asked if endpoint not in POOLING else 0
    if counter is not None:
        quote.prompt_tokens, quote.rows_not_counted = counter.tokens, counter.not_counted
    if drawn.rows:
        measured = _generate_sample(engine, manifest, drawn.rows)
        _expect(quote, [measured], generated_caps, stored_tokens, sampled=True)
        quote.sampled_rows = len(drawn.rows)
    else:
        _expect(quote, earlier_jobs(work_root, model_name, endpoint), generated_caps, stored_tokens)
    _price(quote, options)
    if completion_window_s is not None:
        quote.completion_window_s = completion_window_s
        if quote.engine_seconds_range is not None:
            quote.fits_window = quote.engine_seconds_range[1] <= completion_window_s
    quote.seconds = round(time.monotonic() - started, 3)
    return quote


class _Draw:
    """A uniform draw of up to ``size`` of the requests offered (reservoir sampling), leaving out
    requests with media, whose fetching the sample does not do."""

    def __init__(self, size: int, seed: int):
        self.size = size
        self.offered = 0
        self.rows: list[EngineRequest] = []
        self._random = random.Random(seed)

    def offer(self, req: EngineRequest) -> None:
        if not self.size or media_references(req.body):
            return
        self.offered += 1
        if len(self.rows) < self.size:
            self.rows.append(req)
        elif (slot := self._random.randrange(self.offered)) < self.size:
            self.rows[slot] = req


def _generate_sample(config: EngineConfig, manifest: JobManifest, requests: list[EngineRequest]) -> EarlierJob:
    """The sample's lengths and caps, and the output tokens per second of its generation."""
    engine = engine_for(config, manifest)  # loaded before the clock starts
    started = time.monotonic()
    outcomes = run_checked(engine, requests)
    seconds = time.monotonic() - started
    sampled = EarlierJob("quote-sample")
    for req, outcome in zip(requests, outcomes, strict=True):
        if outcome.ok:
            sampled.lengths.append(outcome.usage.get("completion_tokens", 0))
            sampled.caps.append((req.max_tokens or UNCAPPED_ROW_TOKENS) * req.choices)
    if sampled.lengths and seconds > 0:
        sampled.tokens_per_s = sum(sampled.lengths) / seconds
    return sampled


def _rows(rows: Iterator[InputRow], endpoint: Endpoint) -> Iterator[InputRow]:
    """The rows as the engine gets them: a responses row as the chat row it means."""
    for row in rows:
        yield chat_row(row) if endpoint == "responses" else row


def _store(work_root: Path, engine: EngineConfig, manifest: JobManifest, options: JobOptions) -> AnswerStore | None:
    """The answer store as the job would see it, or None when the job keeps out of it."""
    if not (options.answer_store and options.reuse_answers):
        return None
    return AnswerStore(work_root, engine_identity(engine, manifest), "quote", scope=manifest.answer_scope)


class _PromptCounter:
    """Prompt tokens of rows, counted with the model's tokenizer (loaded at the first row)."""

    def __init__(self, model: str, model_name: str, endpoint: Endpoint):
        self.model, self.model_name, self.endpoint = model, model_name, endpoint
        self.tokens: int | None = 0
        self.not_counted = 0
        self._prompts: Any = None

    def add(self, req: EngineRequest) -> None:
        if self.tokens is None:
            return
        if self._prompts is None:
            self._prompts = self._load()
            if self._prompts is None:
                self.tokens = None
                return
        try:
            self.tokens += self._count(req)
        except Exception:  # a row the template refuses, or media parts: the engine counts those
            self.not_counted += 1

    def _load(self) -> Any:
        from anex_pipeline.engine.vllm.prompts import TextPrompts

        folder = local_model_path(self.model)
        try:
            if (Path(folder) / "tokenizer.json").is_file():
                # The fast tokenizer's class alone: AutoTokenizer imports torch, which took 3.7 s
                # of an 8 s quote of 2,048 rows (its counts are the same: the tests compare them).
                from transformers import PreTrainedTokenizerFast

                tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
            else:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(folder)
        except Exception:  # not on this machine (a model only a server has), or not a model folder
            return None
        return TextPrompts(tokenizer, self.model_name)

    def _count(self, req: EngineRequest) -> int:
        body = req.body
        if self.endpoint in ("score", "rerank"):
            raise ValueError("score and rerank prompts are paired by the engine")
        if self.endpoint in ("embeddings", "classify"):
            if "messages" in body:  # an embeddings row's one conversation
                return len(self._prompts.conversation_ids(req))
            inputs = body["input"]
            inputs = [inputs] if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)) else inputs
            encode = self._prompts.tokenizer.encode
            return sum(len(item) if isinstance(item, list) else len(encode(item)) for item in inputs)
        if req.endpoint == "completions" and several_prompts(body.get("prompt")):
            parts = (dataclasses.replace(req, body={**body, "prompt": p}) for p in body["prompt"])
            return sum(len(self._prompts.prompt_ids(part)) for part in parts)
        return len(self._prompts.prompt_ids(req))


def _expect(
    quote: Quote, earlier: list[EarlierJob], caps: list[int], stored_tokens: int, *, sampled: bool = False
) -> None:
    """The expected output and engine time of the rows to generate (``caps``: each one's cap);
    ``sampled``: ``earlier`` is the one sample this quote generated, not the folder's jobs."""
    measured = [e for e in earlier if e.lengths]
    if quote.endpoint in POOLING:
        quote.output_tokens_expected, quote.output_tokens_range = 0, (0, 0)
        quote.output_basis = f"{quote.endpoint} rows generate no output tokens"
        return
    if not caps:
        quote.output_tokens_expected = stored_tokens
        quote.output_tokens_range = (stored_tokens, stored_tokens)
        quote.output_basis = "every row is answered without generating"
        quote.engine_seconds, quote.engine_seconds_range, quote.time_basis = 0.0, (0.0, 0.0), "nothing to generate"
        return
    if not measured:
        quote.output_basis = (
            f"no earlier job of this work folder ran on {quote.model} ({quote.endpoint}): only the caps' sum is known"
        )
        quote.time_basis = "unknown: no earlier job of this work folder measured this model's speed"
        return
    pooled = _Lengths([(n, c) for e in measured for n, c in zip(e.lengths, e.caps, strict=True)])
    mean, variance = pooled.over(caps)
    each = [_Lengths(list(zip(e.lengths, e.caps, strict=True))).over(caps)[0] for e in measured]
    spread = Z95 * math.sqrt(variance)
    low = max(0.0, min(each) - spread)
    high = min(float(sum(caps)), max(each) + spread)
    quote.output_tokens_expected = round(mean) + stored_tokens
    quote.output_tokens_range = (math.floor(low) + stored_tokens, math.ceil(high) + stored_tokens)
    made_by = (
        "this quote generated as a sample"
        if sampled
        else f"{len(measured)} earlier job(s) of this work folder generated"
    )
    quote.output_basis = f"{len(pooled.sorted)} rows that {made_by} on {quote.model}, each row's cap applied" + (
        f"; {quote.rows_from_answer_store} rows' stored answers" if quote.rows_from_answer_store else ""
    )
    rates = [e.tokens_per_s for e in measured if e.tokens_per_s]
    if not rates:
        quote.time_basis = "unknown: the earlier jobs kept no generation time"
        return
    timed = [e for e in measured if e.tokens_per_s]
    rate = sum(sum(e.lengths) for e in timed) / sum(sum(e.lengths) / (e.tokens_per_s or 1) for e in timed)
    quote.engine_seconds = round(mean / rate, 1)
    quote.engine_seconds_range = (round(low / max(rates), 1), round(high / min(rates), 1))
    measured_by = "on the sample" if sampled else f"by {len(rates)} earlier job(s) here"
    quote.time_basis = f"{rate:.1f} output tok/s, measured {measured_by} ({min(rates):.1f} to {max(rates):.1f})"


class _Lengths:
    """Earlier rows' output lengths with the caps they ran under, for the mean and variance of
    ``min(length, cap)`` of a new row. A row with cap ``c`` is measured against the earlier rows
    whose cap was at least ``c``: their lengths cut at ``c`` are exactly what it would take (a
    length cut by a smaller cap is not); when there are none, against the rows of the largest caps."""

    def __init__(self, rows: list[tuple[int, int]]):
        self.rows = sorted(rows, key=lambda row: -row[1])  # largest caps first
        self.sorted = [n for n, _ in rows]
        self._by_cap: dict[int, tuple[float, float]] = {}

    def over(self, caps: list[int]) -> tuple[float, float]:
        """The expected sum of ``min(length, cap)`` over rows with these caps, and its variance."""
        mean = variance = 0.0
        for cap in caps:
            if cap not in self._by_cap:
                self._by_cap[cap] = self._one(cap)
            m, v = self._by_cap[cap]
            mean, variance = mean + m, variance + v
        return mean, variance

    def _one(self, cap: int) -> tuple[float, float]:
        eligible = [min(n, cap) for n, c in self.rows if c >= cap]
        if not eligible:
            largest = self.rows[0][1]
            eligible = [min(n, cap) for n, c in self.rows if c == largest]
        m = sum(eligible) / len(eligible)
        m2 = sum(n * n for n in eligible) / len(eligible)
        return m, max(0.0, m2 - m * m)


def _price(quote: Quote, options: JobOptions) -> None:
    prices = options.prices
    if prices is None or quote.prompt_tokens is None:
        return
    quote.cost_cap = prices.cost(quote.prompt_tokens, quote.output_tokens_cap)
    if quote.output_tokens_expected is not None and quote.output_tokens_range is not None:
        quote.cost = prices.cost(quote.prompt_tokens, quote.output_tokens_expected)
        low, high = quote.output_tokens_range
        quote.cost_range = (prices.cost(quote.prompt_tokens, low), prices.cost(quote.prompt_tokens, high))


def quote_lines(quote: Quote) -> list[str]:
    """The quote as a few aligned lines for a terminal."""

    def n(value: float | None) -> str:
        return "unknown" if value is None else f"{value:,.0f}"

    prompt = n(quote.prompt_tokens) + (
        f" ({quote.rows_not_counted} rows not counted: media or a template refusal)" if quote.rows_not_counted else ""
    )
    if quote.prompt_tokens is None:
        prompt = "unknown: the model's tokenizer is not on this machine"
    expected = f"{n(quote.output_tokens_expected)} tokens expected"
    if quote.output_tokens_range is not None:
        expected += f" ({n(quote.output_tokens_range[0])} to {n(quote.output_tokens_range[1])})"
    elif quote.output_tokens_expected is None:
        expected = "expected: unknown"
    lines = [
        ("rows", f"{quote.rows:,} ({quote.model}, {quote.endpoint})"),
        ("prompt", f"{prompt} tokens"),
        ("output", f"{expected}, at most {n(quote.output_tokens_cap)} tokens (the caps' sum)"),
        ("  from", quote.output_basis),
        (
            "reused",
            f"{quote.rows_from_answer_store:,} rows from the answer store, "
            f"{quote.rows_reused_in_job:,} copies of identical rows",
        ),
    ]
    if quote.engine_seconds is not None and quote.engine_seconds_range is not None:
        low, high = quote.engine_seconds_range
        lines.append(
            ("time", f"{_duration(quote.engine_seconds)} of generation ({_duration(low)} to {_duration(high)})")
        )
        lines.append(("  from", quote.time_basis))
    else:
        lines.append(("time", quote.time_basis))
    if quote.cost_cap is not None:
        cost = "unknown" if quote.cost is None else f"{quote.cost:.4f}"
        if quote.cost_range is not None:
            cost += f" ({quote.cost_range[0]:.4f} to {quote.cost_range[1]:.4f})"
        lines.append(("cost", f"{cost}, at most {quote.cost_cap:.4f} at the caps"))
    lines.append(
        ("budget", f"the caps' sum fits max_job_tokens ({quote.output_tokens_cap:,} of {quote.max_job_tokens:,})")
    )
    if quote.completion_window_s is not None:
        verdict = {True: "ends within", False: "may not end within", None: "unknown against"}[quote.fits_window]
        lines.append(("window", f"the expected time {verdict} the completion window ({quote.completion_window_s} s)"))
    width = max(len(name) for name, _ in lines)
    return [f"{name:<{width}}  {text}" for name, text in lines]


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
