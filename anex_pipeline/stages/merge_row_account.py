"""Proof that a result file accounts for every input row exactly once, in input order."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from anex_pipeline.formats.registry import FORMATS
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


def account_rows(job: JobDir, result: Path) -> RowAccount:
    manifest = job.manifest()
    position = {row.key: row.index for shard in range(len(manifest.shards)) for row in job.read_requests(shard)}
    account = RowAccount(expected=manifest.total_rows)
    seen: set[str] = set()
    last = -1
    for key in FORMATS[manifest.format].result_keys(result):
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
