"""Rows sharing a prompt prefix reach the engine together; the result keeps input order.

The pure ordering is tested on token lists; the pipeline on a fake engine with a prefix cache of
4-token blocks whose tokens are the words of the conversation.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anex_pipeline import testing
from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL
from anex_pipeline.engine.prefix_order import PrefixCache, ordered, prefix_order, shared_blocks, shared_bytes
from anex_pipeline_tests.harness.jobs import read_jsonl, run_job, write_jsonl

SMALL = PrefixCache(block_tokens=4, capacity_tokens=8)
DOCS, QUESTIONS = 6, 3


def test_shared_bytes_bounds_what_texts_share_from_above() -> None:
    texts = [b"abcdefgh-1", b"abcdefgh-2", b"abcdXY", b"zzz"]
    # "abcd" once, "efgh-" once more for the two that share it; "zzz" shares nothing
    assert shared_bytes(texts) == 4 + 5
    assert shared_bytes([b"same", b"same", b"same"]) == 4
    assert shared_bytes([]) == shared_bytes([b"alone"]) == 0
    for a, b in [([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 0]), ([5] * 40, [5] * 39 + [4])]:
        assert shared_bytes([bytes(a), bytes(b)]) >= shared_blocks(a, b, 4)


def test_shared_blocks_counts_whole_blocks_only() -> None:
    assert shared_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 0], 4) == 8
    assert shared_blocks([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7], 4) == 4  # the last block is partial
    assert shared_blocks([1, 2, 3], [1, 2, 3], 4) == 0
    assert shared_blocks([9, 2, 3, 4], [1, 2, 3, 4], 4) == 0


def test_rows_are_grouped_by_token_prefix_longest_first() -> None:
    short_a, long_b = [1, 1, 1, 1], [2] * 12
    prompts = [
        [*short_a, 10, 11, 12, 13],  # 0: shares one block with 3
        [*long_b, 20],  # 1: shares three blocks with 4
        [7, 7, 7],  # 2: shares nothing
        [*short_a, 30, 31, 32, 33],  # 3
        [*long_b, 21],  # 4
        [8, 8, 8, 8, 8],  # 5: shares nothing
    ]
    assert prefix_order(prompts, SMALL) == [1, 4, 0, 3, 2, 5]


def test_a_common_start_shorter_than_a_block_does_not_group() -> None:
    prompts = [[1, 2, 3, 5 + i, 9, 9, 9, 9] for i in range(4)]
    assert prefix_order(prompts, SMALL) is None


def test_file_order_is_kept_while_the_shared_prefixes_fit_in_half_the_cache() -> None:
    prompts = [[d] * 8 + [q] for q in range(3) for d in range(4)]  # 4 prefixes of 8 tokens: 32 shared
    assert prefix_order(prompts, PrefixCache(block_tokens=4, capacity_tokens=64)) is None
    order = prefix_order(prompts, PrefixCache(block_tokens=4, capacity_tokens=63))
    assert order is not None
    assert [prompts[i][0] for i in order] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]


def test_a_prompt_that_cannot_be_rendered_goes_last() -> None:
    prompts: list[list[int] | None] = [None, [3] * 8 + [1], [4], [3] * 8 + [2]]
    assert prefix_order(prompts, SMALL) == [1, 3, 2, 0]


def test_rows_are_ordered_window_by_window_and_stops_are_checked() -> None:
    class Tokens(testing.FakeEngine):
        prefix_cache = SMALL

        def prompt_tokens(self, row: list[int]) -> list[int]:  # type: ignore[override]
            return row

    rows = [[d] * 8 + [q] for q in range(2) for d in range(2)] * 2  # two windows of 4 rows each
    checks = []
    ordered_rows = list(ordered(rows, Tokens(), lambda: checks.append(1), window=4))
    assert [r[0] for r in ordered_rows] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert len(checks) == 2  # once per window (every 256 rows)


class PrefixFakeEngine(testing.FakeEngine):
    """The fake engine with a prefix cache: a token is a word of the row's conversation."""

    prefix_cache = SMALL

    def __init__(self) -> None:
        super().__init__(DEFAULT_CHAT_MODEL)
        self.vocabulary: dict[str, int] = {}

    def prompt_tokens(self, req: EngineRequest) -> list[int]:
        words = " ".join(m["content"] for m in req.body["messages"]).split()
        return [self.vocabulary.setdefault(w, len(self.vocabulary)) for w in words]


def _question_major_rows() -> list[dict]:
    """Each document asked each question, all documents' first question first."""
    rows = []
    for q in range(QUESTIONS):
        for d in range(DOCS):
            document = " ".join(f"doc{d}-word{k}" for k in range(10))
            rows.append(
                {
                    "custom_id": f"d{d}-q{q}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "messages": [
                            {"role": "system", "content": "Answer from the document."},
                            {"role": "user", "content": f"{document} Question {q}: what does it say?"},
                        ],
                        "max_tokens": 8,
                    },
                }
            )
    return rows


@pytest.mark.parametrize("keep_file_order", [False, True])
def test_engine_sees_rows_grouped_by_document_and_result_keeps_input_order(
    fake_runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep_file_order: bool
) -> None:
    engine = PrefixFakeEngine()
    monkeypatch.setitem(testing._fake, DEFAULT_CHAT_MODEL, engine)
    rows = _question_major_rows()
    src, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"

    report = run_job(fake_runner, src, out, {"prefix_order": False} if keep_file_order else None)

    file_order = [r["custom_id"] for r in rows]
    if keep_file_order:
        assert engine.seen == file_order
    else:
        documents = [key.split("-")[0] for key in engine.seen]
        assert documents == [f"d{d}" for d in range(DOCS) for _ in range(QUESTIONS)]
        assert sorted(engine.seen) == sorted(file_order)
    result = read_jsonl(out)
    assert [r["custom_id"] for r in result] == file_order
    for line in result:  # each row's own answer (the fake names the row), whatever order it ran in
        answer = line["response"]["body"]["choices"][0]["message"]["content"]
        assert answer.startswith(f"answer to {line['custom_id']}:")
    assert report.request_counts.completed == len(rows)


def test_a_parquet_job_in_prefix_order_keeps_input_order(
    fake_runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = PrefixFakeEngine()
    monkeypatch.setitem(testing._fake, DEFAULT_CHAT_MODEL, engine)
    rows = _question_major_rows()
    prompts = [row["body"]["messages"][1]["content"] for row in rows]
    pq.write_table(pa.table({"prompt": prompts}), tmp_path / "in.parquet")

    report = run_job(fake_runner, tmp_path / "in.parquet", tmp_path / "out.parquet", {"max_tokens": 8})

    assert engine.seen != [str(i) for i in range(len(rows))]  # not file order
    result = pq.read_table(tmp_path / "out.parquet")
    assert result.column("prompt").to_pylist() == prompts
    assert result.column("row_index").to_pylist() == list(range(len(rows)))
    for i, answer in enumerate(result.column("output").to_pylist()):
        assert answer.startswith(f"answer to {i}:")
    assert report.request_counts.completed == len(rows)
