"""Counting a job's finished rows and their tokens, as the merge streams past its checkpoints and
as a shard's step sums up its own rows."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from anex_pipeline.formats import StoredOutcome
from anex_pipeline.spec import RequestCounts, Usage


class RowTally:
    """Counts rows and tokens as the merge streams past them (plain attributes: this is a hot loop)."""

    def __init__(self) -> None:
        self.completed = self.failed = self.format_error_rows = self.reused = 0
        self.prompt_tokens = self.completion_tokens = self.reasoning_tokens = self.cached_prompt_tokens = 0
        self.errors: Counter[str] = Counter()
        self.lengths: Counter[int] = Counter()  # completion tokens -> rows: bounded by the cap

    def add(self, o: StoredOutcome) -> StoredOutcome:
        usage = o.usage
        if o.error is not None:
            self.failed += 1
            self.errors[o.error_type] += 1
        else:
            self.completed += 1
            self.lengths[usage.completion_tokens] += 1
            self.format_error_rows += o.format_error
        if o.flag:
            self.errors[o.flag] += 1
        self.reused += o.reused
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.reasoning_tokens += usage.reasoning_tokens
        self.cached_prompt_tokens += usage.cached_prompt_tokens
        return o

    def add_answers(self, table: pa.Table) -> pa.Table:
        """Counts a checkpoint table of answers in columns (:func:`arrow_checkpoint.latest`) column-wise."""
        failed = pc.is_valid(table.column("error"))
        succeeded = pc.invert(failed)
        failures = _int(pc.sum(failed))
        self.failed += failures
        self.completed += table.num_rows - failures
        self.format_error_rows += _int(pc.sum(pc.and_(table.column("format_error"), succeeded)))
        self.reused += _int(pc.sum(table.column("reused")))
        for kinds in (pc.filter(table.column("error_type"), failed), table.column("flag")):
            self.errors.update(_value_counts(kinds))
        self.lengths.update(_value_counts(pc.filter(table.column("completion_tokens"), succeeded)))
        self.prompt_tokens += _int(pc.sum(table.column("prompt_tokens")))
        self.completion_tokens += _int(pc.sum(table.column("completion_tokens")))
        self.reasoning_tokens += _int(pc.sum(table.column("reasoning_tokens")))
        self.cached_prompt_tokens += _int(pc.sum(table.column("cached_prompt_tokens")))
        return table

    def absorb(self, other: RowTally) -> None:
        """Adds the counts of another part of the same job."""
        for name, value in vars(other).items():
            if isinstance(value, Counter):
                getattr(self, name).update(value)
            else:
                setattr(self, name, getattr(self, name) + value)

    @property
    def counts(self) -> RequestCounts:
        return RequestCounts(completed=self.completed, failed=self.failed, format_error_rows=self.format_error_rows)

    @property
    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            reasoning_tokens=self.reasoning_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
        )

    def length_percentiles(self) -> dict[str, int]:
        total = sum(self.lengths.values())
        if not total:
            return {}
        wanted = {"p50": 0.5, "p90": 0.9, "p95": 0.95, "p99": 0.99}
        found: dict[str, int] = {}
        seen = 0
        for length in sorted(self.lengths):
            seen += self.lengths[length]
            for name, q in wanted.items():
                if name not in found and seen >= q * total:
                    found[name] = length
        found["max"] = max(self.lengths)
        return found


def _int(scalar: pa.Scalar) -> int:
    return scalar.as_py() or 0  # the sum of nothing is null


def _value_counts(values: pa.ChunkedArray) -> dict[Any, int]:
    counted = pc.value_counts(values.drop_null())
    return dict(zip(counted.field("values").to_pylist(), counted.field("counts").to_pylist(), strict=True))
