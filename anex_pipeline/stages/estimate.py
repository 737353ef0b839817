"""Output-length estimation: a seeded sample of the job's rows is generated under
the same settings as the real run with a generous cap, and the cap in force becomes an upper 95%
confidence bound on the 95th percentile of the sample's lengths. For a model that thinks, the
thinking budget is bounded the same way from the sample's thinking-token counts.

Each length is one answer's, as the cap bounds each answer: a row asking for several (``n``
choices, or a list of prompts on completions) is sampled for its first alone. Sample answers of
single-answer rows that finished under the chosen cap are exactly what the real run would
produce, so the shards reuse them instead of generating those rows again.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable, Iterator

from anex_pipeline.engine.base import Engine, resolve_request
from anex_pipeline.engine.parsing import choose_parsers
from anex_pipeline.engine.rows import run_checked
from anex_pipeline.errors import RowErrorType
from anex_pipeline.formats.jsonl_checkpoint import append_outcomes
from anex_pipeline.media.attach import attach_media
from anex_pipeline.request_fields import AUDIO, POOLING
from anex_pipeline.spec import EstimateReport, InputRow
from anex_pipeline.stages.estimate_length_bound import upper_bound
from anex_pipeline.stopping import StopCheck
from anex_pipeline.validate.answers import answers_asked, several_prompts
from anex_pipeline.validate.numbers import UNCAPPED_ROW_TOKENS
from anex_pipeline.workdir.manifest import JobDir, JobManifest, atomic_write_text
from anex_pipeline.workdir.outputs import read_estimate

GENEROUS_CAP = UNCAPPED_ROW_TOKENS  # what an uncapped row counts for in the job's token budget


def estimate_lengths(
    job: JobDir, engine_for: Callable[[], Engine], *, cap: int = GENEROUS_CAP
) -> tuple[EstimateReport, dict[str, float]]:
    """Makes (or reuses) the job's estimate; returns it with sample statistics for metadata.

    A sample is generated when ``max_tokens`` is unset, or when ``reasoning_budget`` is unset
    for a model that thinks. ``engine_for`` is called only when a sample really has to be made.
    """
    known = estimate_without_sample(job)
    if known is not None:
        return known, {}
    options = job.manifest().job_options()
    need_cap = options.max_tokens is None
    report, stats = _sample_and_bound(job, engine_for, cap if need_cap else None, _needs_budget(job.manifest()))
    atomic_write_text(job.estimate_path, report.model_dump_json(indent=2))
    return report, stats


def estimate_without_sample(job: JobDir) -> EstimateReport | None:
    """The job's estimate when it takes no sample, written to the job's folder: the one made
    before, or one the settings decide (embeddings, scores; caps and budget set by the user; every row
    setting its own ``max_tokens``). None when a sample has to be generated. The submit step
    records such an estimate itself, so that no step of the job's is run only to write it."""
    if job.estimate_path.exists():
        return read_estimate(job)
    manifest = job.manifest()
    options = manifest.job_options()
    if manifest.endpoint in POOLING:
        report = EstimateReport(method=f"not needed: {manifest.endpoint} rows have no output length")
    elif manifest.endpoint in AUDIO:  # vLLM caps a sound's text at the model's context, as its server does
        report = EstimateReport(method=f"not needed: {manifest.endpoint} rows are capped by the model's context")
    elif options.max_tokens is not None and not _needs_budget(manifest):
        report = EstimateReport(method="set by user")
    elif options.max_tokens is None and all(_sets_own_cap(row) for row in _rows(job)):
        report = EstimateReport(method="not needed: every row sets its own max_tokens")
    else:
        return None
    atomic_write_text(job.estimate_path, report.model_dump_json(indent=2))
    return report


def _rows(job: JobDir) -> Iterator[InputRow]:
    for shard in range(len(job.manifest().shards)):
        yield from job.read_requests(shard)


def _sets_own_cap(row: InputRow) -> bool:
    return "max_tokens" in row.body or "max_completion_tokens" in row.body


def _needs_budget(manifest: JobManifest) -> bool:
    """Whether a thinking budget is to be bounded from the sample: the model thinks and the job
    sets no budget."""
    return manifest.job_options().reasoning_budget is None and model_thinks(manifest)


def model_thinks(manifest: JobManifest) -> bool:
    """Whether the job's model has a reasoning parser, i.e. thinking that a budget can cap."""
    return choose_parsers(manifest.model, manifest.model_name, manifest.job_options()).reasoning is not None


def _sample_and_bound(
    job: JobDir, engine_for: Callable[[], Engine], cap: int | None, need_budget: bool
) -> tuple[EstimateReport, dict[str, float]]:
    """Generates the sample and bounds what is unset: ``max_tokens`` when ``cap`` is given (the
    sample's generous cap), the thinking budget when ``need_budget``. Whatever the user set is
    used for the sample as it is, so the sample runs under the real run's settings."""
    manifest = job.manifest()
    options = manifest.job_options()
    candidates = [row for row in _rows(job) if cap is None or not _sets_own_cap(row)]
    sample: list[InputRow] = random.Random(options.estimate_seed).sample(
        candidates, min(options.estimate_sample_size, len(candidates))
    )
    sample.sort(key=lambda r: r.index)
    sample, _ = attach_media(sample, options.media)  # rows whose media fail stay out of the sample
    sample_cap = cap if cap is not None else options.max_tokens
    # A row of several answers (n, or a list of prompts) is sampled for one, its first: the cap
    # bounds each answer, and the row's usage would count them all. That answer is not the row's.
    several = {r.index for r in sample if answers_asked(r.body) > 1}
    requests = [
        resolve_request(
            _one_answer(r) if r.index in several else r,
            manifest.job_id,
            manifest.endpoint,
            options,
            sample_cap,
            options.reasoning_budget,
        )
        for r in sample
    ]
    started = time.monotonic()
    stop = StopCheck(job)
    stop()  # before the engine loads
    outcomes = run_checked(engine_for(), requests, stop)
    seconds = time.monotonic() - started
    append_outcomes(job.sample_path, [o for o in outcomes if o.index not in several])  # the ones shards may reuse
    done = [o for o in outcomes if o.ok]
    stats: dict[str, float] = {"sample_rows": len(sample), "sample_seconds": round(seconds, 3)}
    report = EstimateReport(sample_size=len(sample))
    methods = []
    if cap is None:
        methods.append("max_tokens: set by user")
    else:
        lengths = [o.usage.get("completion_tokens", 0) for o in done]
        cut = sum(1 for o in done if o.completion_flag == RowErrorType.LENGTH)
        report.max_tokens, method = _bound(lengths, cut, cap, "sample rows succeeded; no cap beyond the context")
        methods.append(f"max_tokens: {method} (the cap of every row that sets none)")
        if lengths:
            stats.update({"sample_max": max(lengths), "sample_median": sorted(lengths)[len(lengths) // 2]})
            stats["sample_lengths"] = json.dumps(sorted(lengths))  # type: ignore[assignment]
    if options.reasoning_budget is not None:
        methods.append("reasoning_budget: set by user")
    elif need_budget:
        # A trace cut at the cap has counted nearly the whole cap already: no censoring to undo.
        thinking = [n for o in done if (n := o.usage.get("reasoning_tokens", 0)) > 0]
        report.reasoning_budget, method = _bound(thinking, 0, sample_cap, "sample rows thought; no thinking budget")
        methods.append(f"reasoning_budget: {method}")
        if thinking:
            stats.update({"sample_thinking_max": max(thinking), "sample_thinking_rows": len(thinking)})
    report.method = "; ".join(methods)
    return report, stats


def _one_answer(row: InputRow) -> InputRow:
    """The row asking for its first answer alone: one choice (choice 0 is sampled with the row's
    own seed) of its first prompt."""
    body = {**row.body, "n": 1}
    if several_prompts(body.get("prompt")):
        body["prompt"] = body["prompt"][0]
    return dataclasses.replace(row, body=body)


def _bound(lengths: list[int], cut: int, cap: int | None, too_few: str) -> tuple[int | None, str]:
    """The upper 95% confidence bound on the 95th percentile of ``lengths`` and how it was found.

    ``cut`` answers stopped at the sample's cap, so their true lengths are unknown: then the cap
    itself is used. With fewer than two lengths there is no bound; ``too_few`` says what that means.
    """
    if len(lengths) < 2:
        return None, f"only {len(lengths)} {too_few}"
    if cut and cap is not None:
        return cap, f"{cut} sample answers reached the sample's cap of {cap}; using the cap"
    bound = upper_bound(lengths)
    value = bound.value if cap is None else min(bound.value, cap)
    return value, f"upper 95% confidence bound on the 95th percentile: {bound.method}"


HISTOGRAM_BINS = 12
HISTOGRAM_WIDTH = 30  # characters of the longest bar


def length_histogram(lengths: list[int], cap: int | None) -> str:
    """The sample's output lengths as a Markdown table with a bar per bin, for the asset's page;
    the bin that holds the cap chosen from them is marked."""
    low, high = min(lengths), max(lengths)
    width = max(1, -(-(high - low + 1) // HISTOGRAM_BINS))  # ceiling: every length in some bin
    counts: dict[int, int] = {}
    for n in lengths:
        counts[(n - low) // width] = counts.get((n - low) // width, 0) + 1
    most = max(counts.values())
    rows = ["| output tokens | rows | |", "|---|---:|---|"]
    for b in range((high - low) // width + 1):
        start = low + b * width
        span = f"{start}" if width == 1 else f"{start}-{start + width - 1}"
        mark = " (max_tokens)" if cap is not None and start <= cap < start + width else ""
        bar = "█" * round(HISTOGRAM_WIDTH * counts.get(b, 0) / most)
        rows.append(f"| {span}{mark} | {counts.get(b, 0)} | {bar} |")
    if cap is not None and cap > high:
        rows.append(f"| max_tokens: {cap} | | |")
    return "\n".join(rows)
