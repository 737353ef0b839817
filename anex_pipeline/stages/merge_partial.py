"""The rows a job has finished so far, written in the job's result format while its shards may
still be generating: the merge's own reading and ordering, run on a copy of each shard's
checkpoint.

Each copy is taken between two appends, under the lock every append takes
(:func:`~anex_pipeline.workdir.shard_owner.copy_checkpoint`), so it holds whole appends that are
on disk already: a row read here is never torn, never read twice (the merge keeps the latest
outcome of each row, as for the final result), and never taken back later (an append that fails
is cut back before its writer lets the lock go). A later read holds every row of an earlier one,
a failed row perhaps answered since. An attempt that another has taken over (a frozen Ray node)
can no longer append, so its rows cannot come and go either.

Rows that have not run are left out, or, with ``pending``, written in their place: a JSONL line
without a response and with an error of type ``pending`` (as the Batch API writes a row its
batch never ran), a Parquet row whose ``error_type`` is ``pending``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from anex_pipeline.errors import RowErrorType
from anex_pipeline.formats.envelope import unanswered_line
from anex_pipeline.formats.registry import FORMATS
from anex_pipeline.spec import InputRow, RowError, RowOutcome
from anex_pipeline.stages.merge import merge_input
from anex_pipeline.workdir.manifest import JobDir
from anex_pipeline.workdir.shard_owner import copy_checkpoint
from anex_pipeline.workdir.tally import RowTally

PENDING = RowError(message="the row has not run yet", type=RowErrorType.PENDING)


@dataclass
class FinishedSoFar:
    """What a read of a job's finished rows wrote."""

    total: int  # the job's rows
    completed: int = 0
    failed: int = 0
    pending: int = 0  # rows that have not run (marked, or left out)

    @property
    def written(self) -> int:
        """Rows in the file: the finished ones, and the pending ones when they were marked."""
        return self.completed + self.failed

    def line(self, out: object, marked: bool) -> str:
        rest = f"{self.pending} not run yet" + (" (marked pending)" if marked else " (left out)")
        done = f"{self.completed} completed, {self.failed} failed"
        return f"{self.written} of {self.total} rows finished ({done}), {rest}: {out}"


def write_finished_rows(job: JobDir, out: Path, *, pending: bool = False) -> FinishedSoFar:
    """Writes the job's finished rows to ``out`` (renamed into place: a reader never sees half of
    it), in input order and in the job's format; ``pending`` writes the rows that have not run
    too, marked (see the module)."""
    manifest = job.manifest()
    kind = FORMATS[manifest.format]
    counts = FinishedSoFar(total=manifest.total_rows)
    partial = out.with_name(f".{out.name}.partial")
    with tempfile.TemporaryDirectory(dir=job.root, prefix=".finished-") as folder:
        copies = [Path(folder) / f"{n}.{kind.checkpoint_file}" for n in range(len(manifest.shards))]
        for n, copy in enumerate(copies):
            copy_checkpoint(job.shard_dir(n), n, job.checkpoint_path(n, manifest), copy)
        answered = [
            {o.i for o in kind.checkpoint_outcomes(copy, rng.start, rng.stop, manifest.endpoint)}
            for copy, rng in zip(copies, manifest.shards, strict=True)
        ]
        counts.pending = manifest.total_rows - sum(len(rows) for rows in answered)
        marked_here = pending and manifest.format != "jsonl"
        if marked_here:  # a Parquet job: the pending rows go into the copies, and the merge writes them
            for n, copy in enumerate(copies):
                unrun = [_pending(row) for row in job.read_requests(n) if row.index not in answered[n]]
                if unrun:
                    kind.append_checkpoint(copy, unrun, manifest.endpoint)
        tally = RowTally()
        try:
            kind.merge(merge_input(job, manifest, copies), partial, tally)
            if pending and not marked_here:
                _mark_pending_lines(job, partial, answered)
            partial.replace(out)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    counts.completed = tally.completed
    counts.failed = tally.failed - (counts.pending if marked_here else 0)
    return counts


def _pending(row: InputRow) -> RowOutcome:
    return RowOutcome(index=row.index, key=row.key, status_code=None, error=PENDING)


def _mark_pending_lines(job: JobDir, result: Path, answered: list[set[int]]) -> None:
    """Rewrites a JSONL result with a pending line in the place of each row that has not run."""
    woven = result.with_name(result.name + ".pending")
    try:
        with result.open("rb") as src, woven.open("wb") as dst:
            rows = ((answered[n], job.read_requests(n)) for n in range(len(answered)))
            for line, _ in with_unrun_lines(src, rows, PENDING.as_dict()):
                dst.write(line)
        woven.replace(result)
    finally:
        woven.unlink(missing_ok=True)


def with_unrun_lines(
    result: BinaryIO, shards: Iterable[tuple[set[int], Iterable[InputRow]]], error: dict[str, Any]
) -> Iterator[tuple[bytes, bool]]:
    """A JSONL result's lines, each with whether it is an error, and in the place of each row that
    has no line (one not in its shard's ``answered`` rows) a line without a response, with
    ``error``. ``shards``: each shard's answered rows and its requests, in shard order."""
    for answered, requests in shards:
        for row in requests:
            if row.index in answered:
                line = next(result)
                yield line, msgspec.json.decode(line)["error"] is not None
            else:
                yield unanswered_line(row.key, error), True
