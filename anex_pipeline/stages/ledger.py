"""Proof that a result file accounts for every input row exactly once, in input order."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from anex_pipeline.workdir.manifest import JobDir


@dataclass
class RowAccount:
    expected: int
    delivered: int = 0
    duplicates: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    out_of_order: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.unknown or self.out_of_order) and self.delivered <= self.expected

    @property
    def missing(self) -> int:
        return self.expected - self.delivered

    def summary(self) -> str:
        if not self.ok:
            return (
                f"{len(self.duplicates)} duplicated, {len(self.unknown)} unknown and "
                f"{len(self.out_of_order)} out-of-order rows (first: "
                f"{(self.duplicates + self.unknown + self.out_of_order)[:3]})"
            )
        if self.missing:
            return (
                f"{self.delivered} of {self.expected} rows delivered once each, in order; {self.missing} not finished"
            )
        return f"all {self.expected} rows delivered once each, in order"

    def as_metadata(self) -> dict[str, int]:
        return {
            "expected": self.expected,
            "delivered": self.delivered,
            "missing": self.missing,
            "duplicates": len(self.duplicates),
            "unknown": len(self.unknown),
            "out_of_order": len(self.out_of_order),
        }


def result_keys(path: Path, fmt: str) -> Iterator[str]:
    """The row identities of a result file, in file order."""
    if fmt == "jsonl":
        with path.open(encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["custom_id"]
        return
    pf = pq.ParquetFile(path, pre_buffer=False)
    column = "id" if "id" in pf.schema_arrow.names else "row_index"
    for batch in pf.iter_batches(columns=[column]):
        yield from (str(v) for v in batch.column(0).to_pylist())


def account_rows(job: JobDir, result: Path) -> RowAccount:
    manifest = job.manifest()
    position = {row.key: row.index for shard in range(len(manifest.shards)) for row in job.read_requests(shard)}
    account = RowAccount(expected=manifest.total_rows)
    seen: set[str] = set()
    last = -1
    for key in result_keys(result, manifest.format):
        account.delivered += 1
        if key in seen:
            account.duplicates.append(key)
            continue
        seen.add(key)
        if key not in position:
            account.unknown.append(key)
            continue
        if position[key] < last:
            account.out_of_order.append(key)
        last = position[key]
    return account
