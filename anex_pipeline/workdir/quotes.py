"""What the work folder knows that a quote uses, and the quotes themselves.

Earlier jobs of the folder say what a new job is likely to take: the output lengths of the rows
they generated (each row's ``completion_tokens`` in their checkpoints, with the cap it ran under;
copies of other rows' answers left out) and the output tokens per second their engine kept up (their generated tokens
over their estimate and generation seconds). Only merged jobs count (their report is in), on the
same model and endpoint, newest first.

A quote is kept under the id of the job it quoted (``<work root>/quotes/<job id>.json``): the run
of that job shows it beside what happened, so users see how good quotes are.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anex_pipeline.spec import Quote
from anex_pipeline.validate.numbers import UNCAPPED_ROW_TOKENS
from anex_pipeline.workdir import layout
from anex_pipeline.workdir.manifest import JOB_ID, JobDir, atomic_write_text
from anex_pipeline.workdir.outputs import read_estimate

HISTORY_JOBS = 20  # earlier jobs read, newest first
HISTORY_ROWS = 50_000  # generated rows read from them, at most


@dataclass
class EarlierJob:
    """One earlier job's generated rows' output lengths and its engine's measured speed."""

    job_id: str
    lengths: list[int] = field(default_factory=list)
    caps: list[int] = field(default_factory=list)  # each row's cap (n x max_tokens), beside its length
    tokens_per_s: float | None = None  # None: it generated nothing, or its seconds were not kept


def earlier_jobs(work_root: Path, model_name: str, endpoint: str) -> list[EarlierJob]:
    """The merged jobs of the work folder on ``model_name`` and ``endpoint``, newest first (at most
    HISTORY_JOBS of them, HISTORY_ROWS rows in all); a folder that cannot be read is passed over."""
    found: list[EarlierJob] = []
    rows = 0
    for job in _jobs_newest_first(work_root):
        if len(found) == HISTORY_JOBS or rows >= HISTORY_ROWS:
            break
        try:
            report = job.report()
            if report is None or report.model != model_name or report.endpoint != endpoint:
                continue
            earlier = EarlierJob(job.job_id)
            manifest = job.manifest()
            options = manifest.job_options()
            job_cap = options.max_tokens or read_estimate(job).max_tokens or UNCAPPED_ROW_TOKENS
            for shard in range(len(manifest.shards)):
                caps = {row.index: _cap(row.body, job_cap) for row in job.read_requests(shard)}
                for o in job.outcomes(shard):
                    if o.error is None and not o.reused and o.i in caps:
                        earlier.lengths.append(o.usage.completion_tokens)
                        earlier.caps.append(caps[o.i])
        except (OSError, ValueError):
            continue
        busy = report.timings.get("generate", 0.0) + report.timings.get("estimate", 0.0)
        if earlier.lengths and busy > 0:
            earlier.tokens_per_s = sum(earlier.lengths) / busy
        rows += len(earlier.lengths)
        found.append(earlier)
    return found


def _cap(body: dict[str, Any], job_cap: int) -> int:
    """A row's cap on its output: its own (or the job's) max_tokens, times its choices."""
    cap = next((body[name] for name in ("max_tokens", "max_completion_tokens") if type(body.get(name)) is int), job_cap)
    n = body.get("n")
    return cap * (n if type(n) is int else 1)


def _jobs_newest_first(work_root: Path) -> list[JobDir]:
    jobs = []
    with contextlib.suppress(OSError):
        for folder in Path(work_root).expanduser().iterdir():
            if folder.name in layout.WORK_ROOT_FOLDERS or not JOB_ID.fullmatch(folder.name):
                continue
            report = folder / layout.REPORT
            with contextlib.suppress(OSError):
                jobs.append((report.stat().st_mtime, JobDir(work_root, folder.name)))
    return [job for _, job in sorted(jobs, key=lambda pair: -pair[0])]


def quote_path(work_root: Path, job_id: str) -> Path:
    return Path(work_root).expanduser() / layout.QUOTES_DIR / f"{job_id}.json"


def save_quote(work_root: Path, job_id: str, quote: Quote) -> None:
    """Keeps the quote of the job ``job_id`` would be, for that job's report."""
    atomic_write_text(quote_path(work_root, job_id), quote.model_dump_json(indent=2))


def read_quote(job: JobDir) -> Quote | None:
    """The quote kept for the job, if any (one that cannot be read counts as none)."""
    try:
        return Quote.model_validate_json(quote_path(job.root.parent, job.job_id).read_text())
    except (OSError, ValueError):
        return None
