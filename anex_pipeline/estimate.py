"""Output-length estimation (SPEC section 8): a seeded sample of the job's rows is generated under
the same settings as the real run with a generous cap, and the cap in force becomes an upper 95%
confidence bound on the 95th percentile of the sample's lengths.

Sample answers that finished under the chosen cap are exactly what the real run would produce,
so the shards reuse them instead of generating those rows again.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable

from anex_pipeline.engine.base import Engine, resolve_request, run_checked
from anex_pipeline.formats import InputRow
from anex_pipeline.jobs import JobDir, append_outcomes, atomic_write_text, read_outcomes
from anex_pipeline.length_bound import upper_bound
from anex_pipeline.spec import EstimateReport, RowOutcome

GENEROUS_CAP = 1024


def read_estimate(job: JobDir) -> EstimateReport:
    if not job.estimate_path.exists():
        return EstimateReport(method="no estimate was made")
    return EstimateReport.model_validate_json(job.estimate_path.read_text())


def estimate_lengths(
    job: JobDir, engine_for: Callable[[], Engine], *, cap: int = GENEROUS_CAP
) -> tuple[EstimateReport, dict[str, float]]:
    """Makes (or reuses) the job's estimate; returns it with sample statistics for metadata.

    ``engine_for`` is called only when a sample really has to be generated.
    """
    manifest = job.manifest()
    options = manifest.job_options()
    stats: dict[str, float] = {}
    if job.estimate_path.exists():
        return read_estimate(job), stats
    if manifest.endpoint == "embeddings":
        report = EstimateReport(method="not needed: embeddings have no output length")
    elif options.max_tokens is not None:
        report = EstimateReport(max_tokens=None, reasoning_budget=options.reasoning_budget, method="set by user")
    else:
        report, stats = _sample_and_bound(job, engine_for, cap)
    atomic_write_text(job.estimate_path, report.model_dump_json(indent=2))
    return report, stats


def _sample_and_bound(
    job: JobDir, engine_for: Callable[[], Engine], cap: int
) -> tuple[EstimateReport, dict[str, float]]:
    manifest = job.manifest()
    options = manifest.job_options()
    candidates = [
        row
        for shard in range(len(manifest.shards))
        for row in job.read_requests(shard)
        if "max_tokens" not in row.body and "max_completion_tokens" not in row.body
    ]
    if not candidates:
        return EstimateReport(method="not needed: every row sets its own max_tokens"), {}
    sample: list[InputRow] = random.Random(options.estimate_seed).sample(
        candidates, min(options.estimate_sample_size, len(candidates))
    )
    sample.sort(key=lambda r: r.index)
    requests = [
        resolve_request(r, manifest.job_id, manifest.endpoint, options, cap, options.reasoning_budget) for r in sample
    ]
    started = time.monotonic()
    outcomes = run_checked(engine_for(), requests)
    seconds = time.monotonic() - started
    append_outcomes(job.sample_path, outcomes)
    lengths = [o.usage.get("completion_tokens", 0) for o in outcomes if o.ok]
    stats = {"sample_rows": len(sample), "sample_seconds": round(seconds, 3)}
    if len(lengths) < 2:
        return (
            EstimateReport(sample_size=len(sample), method="too few sample rows succeeded; no cap beyond the context"),
            stats,
        )
    bound = upper_bound(lengths)
    hit_cap = sum(1 for o in outcomes if o.completion_flag == "length")
    value, method = min(bound.value, cap), bound.method
    if hit_cap:
        value, method = cap, f"{hit_cap} sample answers reached the estimation cap of {cap}; using the cap"
    stats.update({"sample_max": max(lengths), "sample_median": sorted(lengths)[len(lengths) // 2]})
    stats["sample_lengths"] = json.dumps(sorted(lengths))  # type: ignore[assignment]
    return (
        EstimateReport(
            max_tokens=value,
            reasoning_budget=options.reasoning_budget,
            sample_size=len(sample),
            method=f"upper 95% confidence bound on the 95th percentile: {method}",
        ),
        stats,
    )


def reusable_samples(job: JobDir, estimate: EstimateReport, start: int, stop: int) -> dict[int, RowOutcome]:
    """Sample answers in rows [start, stop) that finished under the cap now in force."""
    if estimate.max_tokens is None or not job.sample_path.exists():
        return {}
    return {
        i: o
        for i, o in read_outcomes(job.sample_path).items()
        if start <= i < stop
        and o.ok
        and o.completion_flag != "length"
        and o.usage.get("completion_tokens", 0) <= estimate.max_tokens
    }
