"""`validate --quote`: exact prompt tokens with the model's tokenizer, the caps' sum, the cost at
the job's prices, the rows the answer store would serve, and expectations from the work folder's
earlier jobs; a malformed file gets validate's problems and no figures."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from anex_pipeline import cli
from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL, local_model_path
from anex_pipeline.workdir.manifest import read_report
from anex_pipeline_tests.harness.cli_jobs import anex
from anex_pipeline_tests.harness.jobs import read_jsonl
from bench.vs_run_batch import make_input

PRICES = {"input_per_1k": 0.5, "output_per_1k": 1.5}


def _quote(capsys: pytest.CaptureFixture[str], src: Path, *more: str) -> dict:
    code, out, err = anex(capsys, "validate", str(src), "--quote", "--json", *more)
    assert code == 0, err
    return json.loads(out)


def test_a_quote_of_the_benchmark_input_counts_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANEX_WORK_DIR", str(tmp_path / "work"))
    src = tmp_path / "bench.jsonl"
    make_input(src, 2048, seed=1, unique=True)
    started = time.monotonic()
    quote = _quote(capsys, src, "--set", f"prices={json.dumps(PRICES)}")
    took = time.monotonic() - started
    tokenizer = AutoTokenizer.from_pretrained(local_model_path(DEFAULT_CHAT_MODEL))
    rows = read_jsonl(src)
    render = tokenizer.apply_chat_template
    expected_prompt = sum(
        len(
            tokenizer.encode(
                render(r["body"]["messages"], add_generation_prompt=True, tokenize=False), add_special_tokens=False
            )
        )
        for r in rows
    )
    caps = sum(r["body"]["max_tokens"] for r in rows)
    assert quote["rows"] == 2048
    assert quote["prompt_tokens"] == expected_prompt and quote["rows_not_counted"] == 0
    assert quote["output_tokens_cap"] == caps
    assert quote["cost_cap"] == pytest.approx(expected_prompt / 1000 * 0.5 + caps / 1000 * 1.5, abs=1e-6)
    assert quote["output_tokens_expected"] is None and quote["engine_seconds"] is None  # nothing ran here yet
    assert took <= 10, f"the quote took {took:.1f} s"


def test_a_quote_of_a_malformed_file_lists_validates_problems_and_no_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANEX_WORK_DIR", str(tmp_path / "work"))
    src = tmp_path / "bad.jsonl"
    good = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}
    src.write_text(
        json.dumps(good) + "\n{not json\n" + json.dumps({**good, "custom_id": "b", "body": {"mesages": 1}}) + "\n"
    )
    plain = cli.main(["validate", str(src)])
    listed = capsys.readouterr().err
    code, out, err = anex(capsys, "validate", str(src), "--quote")
    assert plain == code == 2
    assert err == listed and "line 2" in err and "line 3" in err
    assert out == ""  # no figures


@pytest.mark.slow
def test_after_a_run_the_quote_of_a_file_of_the_same_shape_expects_what_it_produced(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the fake engine: one run of a file, then a quote of another file of the same shape
    expects the output the run produced within 25%; the same file quoted again is served whole by
    the answer store; and the run that follows a quote reports the quote beside what happened."""
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    make_input(first, 300, seed=1, unique=True)
    make_input(second, 300, seed=2, unique=True)
    quoted_first = _quote(capsys, first)
    code, _, err = anex(capsys, "run", str(first), "-o", str(tmp_path / "a.results.jsonl"), "--quiet")
    assert code == 0, err
    report = read_report(tmp_path / "a.results.report.json")
    assert report is not None and report.quote is not None
    assert report.quote.quoted.prompt_tokens == quoted_first["prompt_tokens"]
    assert report.quote.output_tokens == report.usage.completion_tokens > 0

    quote = _quote(capsys, second)
    produced = report.usage.completion_tokens
    assert abs(quote["output_tokens_expected"] - produced) <= 0.25 * produced
    low, high = quote["output_tokens_range"]
    assert low <= quote["output_tokens_expected"] <= high <= quote["output_tokens_cap"]
    assert quote["engine_seconds"] is not None and "measured by 1 earlier job" in quote["time_basis"]
    again = _quote(capsys, first)
    assert again["rows_from_answer_store"] == 300
    assert again["output_tokens_expected"] == produced and again["engine_seconds"] == 0


@pytest.mark.slow
def test_a_quote_with_a_sample_expects_what_the_run_then_produces(
    tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the fake engine, in a work folder with no earlier job: --quote-sample generates 40 of
    the 300 rows, and the quote's expected output comes within 25% of what the run produces."""
    src = tmp_path / "a.jsonl"
    make_input(src, 300, seed=3, unique=True)
    quote = _quote(capsys, src, "--quote-sample", "40")
    assert quote["sampled_rows"] == 40 and "generated as a sample" in quote["output_basis"]
    assert quote["engine_seconds"] is not None and "measured on the sample" in quote["time_basis"]
    code, _, err = anex(capsys, "run", str(src), "-o", str(tmp_path / "a.results.jsonl"), "--quiet")
    assert code == 0, err
    report = read_report(tmp_path / "a.results.report.json")
    assert report is not None
    produced = report.usage.completion_tokens
    assert abs(quote["output_tokens_expected"] - produced) <= 0.25 * produced
    code, out, err = anex(capsys, "validate", str(src), "--quote-sample", "-3")
    assert code == 2 and out == "" and err.strip().endswith("--quote-sample takes a number of rows (0 or more), got -3")
