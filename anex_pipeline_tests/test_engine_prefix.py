"""On the real engine, rows that share a long document are served from vLLM's prefix cache, and
the report says how many prompt tokens came from it.

24 documents of about 550 tokens, each asked two questions, question by question: the shared
blocks (24 x 4 blocks of 128 tokens) fill more than half of the 1 GiB CPU cache (23,296 tokens for
the embedded model), so the rows are sent document by document.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from anex_pipeline.runner import JobRunner
from anex_pipeline_tests.harness.jobs import chat_row, read_jsonl, run_job, write_jsonl

pytestmark = pytest.mark.engine

DOCS, WORDS, BLOCK = 24, 260, 128
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "do", "gu", "he", "ji", "fo", "wy"]


def _document(rng: random.Random) -> str:
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(WORDS))


def test_rows_sharing_a_document_report_cached_prompt_tokens(tmp_path: Path, real_runner: JobRunner) -> None:
    rng = random.Random(0)
    documents = [_document(rng) for _ in range(DOCS)]
    rows = [
        chat_row(f"d{d}-q{q}", f"Document:\n{doc}\n\nQuestion: {question}", max_tokens=1, temperature=0)
        for q, question in enumerate(["What is it about?", "Give it a title."])
        for d, doc in enumerate(documents)
    ]
    src, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"

    report = run_job(real_runner, src, out)

    assert report.status == "completed"
    lines = read_jsonl(out)
    assert [line["custom_id"] for line in lines] == [row["custom_id"] for row in rows]
    usage = {line["custom_id"]: line["response"]["body"]["usage"] for line in lines}
    cached = {key: u["prompt_tokens_details"]["cached_tokens"] for key, u in usage.items()}
    # Whichever question of a document ran second found the document's whole blocks in the cache.
    assert all(cached[f"d{d}-q0"] + cached[f"d{d}-q1"] >= 4 * BLOCK for d in range(DOCS)), cached
    assert report.usage.cached_prompt_tokens == sum(cached.values())
    assert report.usage.cached_prompt_tokens >= DOCS * 4 * BLOCK
    saved = json.loads((tmp_path / "out.report.json").read_text())
    assert saved["usage"]["cached_prompt_tokens"] == report.usage.cached_prompt_tokens
