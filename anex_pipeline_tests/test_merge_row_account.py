"""The proof that a result file holds every input row once, in input order
(anex_pipeline.stages.merge_row_account), on real result files and a job of known rows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from anex_pipeline.stages.merge_row_account import RowAccount, account_rows
from anex_pipeline_tests.harness.jobs import write_jsonl


@dataclass
class Row:
    key: str
    index: int


@dataclass
class Manifest:
    shards: list[Any]
    total_rows: int
    format: str = "jsonl"


class Job:
    """What account_rows reads of a job folder: its manifest and each shard's rows."""

    def __init__(self, *shards: list[str]):
        keys = [k for shard in shards for k in shard]
        self.shards = [[Row(k, keys.index(k)) for k in shard] for shard in shards]
        self._manifest = Manifest(list(shards), len(keys))

    def manifest(self) -> Manifest:
        return self._manifest

    def read_requests(self, shard: int) -> list[Row]:
        return self.shards[shard]


def result(tmp_path: Path, *keys: str) -> Path:
    return write_jsonl(tmp_path / "out.jsonl", [{"custom_id": k, "response": None, "error": None} for k in keys])


def account(tmp_path: Path, delivered: list[str]) -> RowAccount:
    return account_rows(Job(["a", "b"], ["c", "d"]), result(tmp_path, *delivered))  # type: ignore[arg-type]


def test_every_row_once_in_order(tmp_path: Path) -> None:
    found = account(tmp_path, ["a", "b", "c", "d"])
    assert found.ok and found.missing == 0
    assert found.summary() == "all 4 rows delivered once each, in order"
    assert found.as_metadata() == {
        "expected": 4,
        "delivered": 4,
        "missing": 0,
        "duplicates": 0,
        "unknown": 0,
        "out_of_order": 0,
    }


def test_rows_not_finished_yet_are_counted_not_refused(tmp_path: Path) -> None:
    found = account(tmp_path, ["a", "c"])  # b failed to finish; the rest still in order
    assert found.ok and found.missing == 2
    assert found.summary() == "2 of 4 rows delivered once each, in order; 2 not finished"


@pytest.mark.parametrize(
    ("delivered", "bad"),
    [
        (["a", "b", "b", "c", "d"], {"duplicates": ["b"]}),
        (["a", "x", "b", "c", "d"], {"unknown": ["x"]}),
        (["a", "c", "b", "d"], {"out_of_order": ["b"]}),
    ],
)
def test_a_duplicate_an_unknown_or_an_out_of_order_row_fails_the_proof(
    tmp_path: Path, delivered: list[str], bad: dict[str, list[str]]
) -> None:
    found = account(tmp_path, delivered)
    assert not found.ok
    for name in ("duplicates", "unknown", "out_of_order"):
        assert getattr(found, name) == bad.get(name, [])
    assert "(first: " in found.summary() and str(next(iter(bad.values()))) in found.summary()


def test_more_rows_than_the_input_fails_even_without_a_named_culprit() -> None:
    assert not RowAccount(expected=1, delivered=2).ok
