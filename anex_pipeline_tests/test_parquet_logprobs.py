"""Parquet jobs that ask for logprobs: the job options ``logprobs`` and ``top_logprobs`` reach
both engines as a JSONL row's fields do, the result gets a ``logprobs`` column (one entry per
generated token, null on a failed row), answer reuse never crosses between rows with and without
them, and where they cannot apply (embeddings, a Responses job, JSONL, a clashing column) the job
is refused at submit, as is ``n``, which a Parquet result cannot hold. On the fake engine; the
real engine's test is in ``test_engine_request_fields.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anex_pipeline.cli import main
from anex_pipeline.engine.base import resolve_request
from anex_pipeline.engine.config import HttpSettings
from anex_pipeline.engine.http.engine import OpenAIHttpEngine, request_body
from anex_pipeline.engine.models import DEFAULT_CHAT_MODEL
from anex_pipeline.engine.parsing import OutputParser, ParserNames
from anex_pipeline.engine.vllm.sampling import Sampler
from anex_pipeline.formats import arrow_checkpoint, token_logprobs_of
from anex_pipeline.formats.parquet import ParquetFormat
from anex_pipeline.options import job_options
from anex_pipeline.orchestration.resources import StorageResource
from anex_pipeline.request_fields import PROMPT_FIELDS
from anex_pipeline.runner import JobRunner
from anex_pipeline.spec import JobOptions, JobRejected, RowOutcome
from anex_pipeline.stages.generate_answer_book import fingerprint
from anex_pipeline.testing import fake_engine, shared_fake_engine
from anex_pipeline_tests.harness.jobs import chat_row, write_jsonl
from anex_pipeline_tests.harness.openai_server import FakeServer

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The result column, spelled out: a list per row of {token, logprob, top_logprobs: [{token, logprob}]}.
ALTERNATIVE = pa.struct([("token", pa.string()), ("logprob", pa.float64())])
LOGPROBS_TYPE = pa.list_(
    pa.struct([("token", pa.string()), ("logprob", pa.float64()), ("top_logprobs", pa.list_(ALTERNATIVE))])
)


def parquet(path: Path, **columns: list[Any]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def submit_and_run(runner: JobRunner, src: Path, out: Path, options: dict[str, Any]) -> Any:
    return runner.run(runner.submit(str(src), str(out), options))


def shard_rows(src: Path, options: dict[str, Any]) -> list[Any]:
    """The rows of a Parquet input with their request bodies, as its shards hand them to the engine."""
    fmt, opts = ParquetFormat(), job_options(options)
    endpoint = fmt.job_endpoint(src, opts)
    chunks = [c for c in fmt.read_chunks(src, endpoint, frozenset({MODEL}), opts) if isinstance(c, pa.RecordBatch)]
    return [(endpoint, row) for chunk in chunks for row in fmt.chunk_rows(chunk, endpoint, opts)]


# -- the column --------------------------------------------------------------------------------


def test_a_chat_job_gets_one_entry_per_generated_token_and_null_on_a_failed_row(
    tmp_path: Path, fake_runner: JobRunner
) -> None:
    prompts = [f"tell me about {i}" for i in range(12)]
    prompts[5] = "long " * 400  # over the fake engine's context: the row fails
    src = parquet(tmp_path / "in.parquet", prompt=prompts)
    out = tmp_path / "out.parquet"
    options = {"logprobs": True, "top_logprobs": 2, "temperature": 0, "max_tokens": 4, "shards": 3}
    report = submit_and_run(fake_runner, src, out, options)
    assert report.status == "completed" and report.request_counts.failed == 1

    table = pq.read_table(out)
    assert table.column_names[-1] == "logprobs"
    assert table.schema.field("logprobs").type == LOGPROBS_TYPE
    rows = table.to_pylist()
    assert rows[5]["logprobs"] is None and rows[5]["error_type"] == "context_length_exceeded"
    for row in rows[:5] + rows[6:]:
        tokens = row["logprobs"]
        assert len(tokens) == row["completion_tokens"] == 4
        assert "".join(t["token"] for t in tokens) == row["output"]
        for t in tokens:
            assert len(t["top_logprobs"]) == 2 and t["top_logprobs"][0] == {
                "token": t["token"],
                "logprob": t["logprob"],
            }


def test_a_completions_job_has_the_same_column_best_alternative_first(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = parquet(tmp_path / "in.parquet", prompt=["Once upon", "In a land"])
    base = {"endpoint": "completions", "temperature": 0, "max_tokens": 3}
    out = tmp_path / "k3.parquet"
    submit_and_run(fake_runner, src, out, {**base, "logprobs": True, "top_logprobs": 3})
    for row in pq.read_table(out).to_pylist():
        assert len(row["logprobs"]) == row["completion_tokens"]
        for t in row["logprobs"]:
            logprobs = [a["logprob"] for a in t["top_logprobs"]]
            assert len(logprobs) == 3 and logprobs == sorted(logprobs, reverse=True)
            assert t["top_logprobs"][0]["token"] == t["token"]
    # without top_logprobs a completions row asks for logprobs: 0, the sampled token alone
    bare = tmp_path / "k0.parquet"
    submit_and_run(fake_runner, src, bare, {**base, "logprobs": True})
    entries = [t for row in pq.read_table(bare).column("logprobs").to_pylist() for t in row]
    assert entries and all(t["top_logprobs"] == [{"token": t["token"], "logprob": t["logprob"]}] for t in entries)


def test_without_the_option_there_is_no_column_and_no_row_asks_for_logprobs(
    tmp_path: Path, fake_runner: JobRunner
) -> None:
    src = parquet(tmp_path / "in.parquet", prompt=["a question", "another"])
    for options in ({}, {"logprobs": False}):
        out = tmp_path / f"out{len(options)}.parquet"
        submit_and_run(fake_runner, src, out, {"max_tokens": 3, **options})
        assert "logprobs" not in pq.read_table(out).column_names
        assert all("logprobs" not in row.body for _, row in shard_rows(src, options))


def test_a_column_named_logprobs_stays_the_inputs_without_the_option(tmp_path: Path, fake_runner: JobRunner) -> None:
    src = parquet(tmp_path / "in.parquet", prompt=["a", "b"], logprobs=["mine", "too"])
    out = tmp_path / "out.parquet"
    submit_and_run(fake_runner, src, out, {"max_tokens": 3})
    assert pq.read_table(out).column("logprobs").to_pylist() == ["mine", "too"]


def test_both_endpoints_shapes_become_the_columns_entries_a_forced_token_without_alternatives() -> None:
    chat = {
        "content": [
            {"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": [{"token": "Hi", "logprob": -0.1}]},
            {"token": "</think>", "logprob": -9999.0, "bytes": [60], "top_logprobs": []},  # forced: vLLM's floor
        ]
    }
    completions = {
        "tokens": [" a", " b"],
        "token_logprobs": [-0.5, None],  # the second was forced
        "top_logprobs": [{" c": -2.0, " a": -0.5}, None],
        "text_offset": [0, 2],
    }
    assert token_logprobs_of("chat", {"choices": [{"logprobs": chat}]}) == [
        {"token": "Hi", "logprob": -0.1, "top_logprobs": [{"token": "Hi", "logprob": -0.1}]},
        {"token": "</think>", "logprob": -9999.0, "top_logprobs": []},
    ]
    assert token_logprobs_of("completions", {"choices": [{"logprobs": completions}]}) == [
        {
            "token": " a",
            "logprob": -0.5,
            "top_logprobs": [{"token": " a", "logprob": -0.5}, {"token": " c", "logprob": -2.0}],
        },
        {"token": " b", "logprob": None, "top_logprobs": []},
    ]
    assert token_logprobs_of("chat", {"choices": [{"logprobs": None}]}) is None
    assert token_logprobs_of("embeddings", {"data": []}) is None


def test_a_checkpoint_from_before_the_logprobs_column_is_upgraded(tmp_path: Path) -> None:
    """A shard checkpointed by an earlier version resumes: its rows read with null logprobs, and
    a row appended after them keeps its own."""
    path = tmp_path / "results.arrow"
    current = arrow_checkpoint.schema("chat")
    older = pa.schema([f for f in current if f.name != "logprobs"])
    body = {"choices": [{"message": {"content": "Hi"}, "logprobs": {"content": [{"token": "Hi", "logprob": -1.0}]}}]}
    rows = arrow_checkpoint._batch([RowOutcome(0, "0", 200, body=body)], "chat")
    old_batch = pa.RecordBatch.from_arrays([rows.column(n) for n in older.names], schema=older)
    path.write_bytes(older.serialize().to_pybytes() + old_batch.serialize().to_pybytes())
    arrow_checkpoint.append(path, [RowOutcome(1, "1", 200, body=body)], "chat")
    [table] = arrow_checkpoint.latest(path, "chat")
    assert table.schema.field("logprobs").type == LOGPROBS_TYPE
    assert table.column("logprobs").to_pylist() == [None, [{"token": "Hi", "logprob": -1.0, "top_logprobs": []}]]


# -- the options reach both engines ------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "sent"),
    [("chat", {"logprobs": True, "top_logprobs": 2}), ("completions", {"logprobs": 2})],
)
def test_the_options_reach_both_engines_as_a_jsonl_rows_fields(
    endpoint: str, sent: dict[str, Any], tmp_path: Path
) -> None:
    src = parquet(tmp_path / "in.parquet", prompt=["hello"])
    options = {"endpoint": endpoint, "logprobs": True, "top_logprobs": 2, "temperature": 0}
    [(kind, row)] = shard_rows(src, options)
    assert row.body == {**row.body, **sent} and set(row.body) == {PROMPT_FIELDS[kind], *sent}
    req = resolve_request(row, "job", kind, job_options(options), 8, None)
    # the in-process engine: vLLM's sampling parameters
    sampler = Sampler(
        max_model_len=2048,
        defaults={},
        keep_special_tokens=False,
        thinking=None,
        parser=OutputParser(None, ParserNames()),
    )
    assert sampler.params(req, prompt_len=5).logprobs == 2
    # the HTTP engine: what a model server on loopback was sent
    server = FakeServer()
    try:
        engine = OpenAIHttpEngine(HttpSettings(base_url=server.url, model_name=DEFAULT_CHAT_MODEL, retries=0))
        [outcome] = engine.run([req])
        assert outcome.ok
        [(_, received)] = server.received.values()
        assert {k: received[k] for k in sent} == sent
        assert {k: request_body(req, "m")[k] for k in sent} == sent
    finally:
        server.close()


# -- answer reuse ------------------------------------------------------------------------------


def test_the_answer_key_tells_rows_with_logprobs_from_rows_without(tmp_path: Path) -> None:
    src = parquet(tmp_path / "in.parquet", prompt=["same prompt"])
    keys = set()
    for extra in ({}, {"logprobs": True}, {"logprobs": True, "top_logprobs": 1}, {"logprobs": True, "top_logprobs": 2}):
        options = {"temperature": 0, **extra}
        [(kind, row)] = shard_rows(src, options)
        keys.add(fingerprint(resolve_request(row, "j", kind, job_options(options), 8, None)))
    assert None not in keys and len(keys) == 4


def test_the_answer_store_never_hands_a_logprobs_row_an_answer_made_without_them(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    storage = StorageResource(work_root=str(tmp_path / "work"))
    runner = JobRunner(instance, storage, fake_engine())
    src = parquet(tmp_path / "in.parquet", prompt=[f"question {i}" for i in range(6)])
    engine = shared_fake_engine(MODEL)  # the embedded model's name: the job's default
    base = {"temperature": 0, "max_tokens": 4, "shards": 2}

    def generated(out: str, options: dict[str, Any]) -> int:
        before = len(engine.seen)
        assert submit_and_run(runner, src, tmp_path / out, {**base, **options}).status == "completed"
        return len(engine.seen) - before

    assert generated("plain.parquet", {}) == 6
    assert generated("asks.parquet", {"logprobs": True, "top_logprobs": 2}) == 6  # none from the store
    asked = pq.read_table(tmp_path / "asks.parquet").column("logprobs").to_pylist()
    assert all(len(tokens) == 4 for tokens in asked)
    # the same ask again (another job: another checkpoint size) is answered from the store, logprobs and all
    assert generated("again.parquet", {"logprobs": True, "top_logprobs": 2, "checkpoint_rows": 5}) == 0
    assert pq.read_table(tmp_path / "again.parquet").column("logprobs").to_pylist() == asked
    assert generated("plain-again.parquet", {"checkpoint_rows": 5}) == 0
    assert "logprobs" not in pq.read_table(tmp_path / "plain-again.parquet").column_names
    runner.close()


# -- refusals ----------------------------------------------------------------------------------


REFUSED = [
    pytest.param(
        "in.parquet", {"prompt": ["a"]}, {"n": 2, "temperature": 0.7}, "n", ("JSONL", "one answer per row"), id="n"
    ),
    pytest.param("in.parquet", {"prompt": ["a"]}, {"n": 500}, "n", ("JSONL",), id="n-out-of-range"),
    pytest.param(
        "in.parquet", {"prompt": ["a"]}, {"top_logprobs": 2}, "top_logprobs", ("needs logprobs",), id="top-alone"
    ),
    pytest.param(
        "in.parquet",
        {"prompt": ["a"]},
        {"logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        ("0 to 20",),
        id="top-21",
    ),
    pytest.param("in.parquet", {"prompt": ["a"]}, {"logprobs": 1}, "logprobs", ("true or false",), id="not-a-boolean"),
    pytest.param(
        "in.parquet", {"input": ["a"]}, {"logprobs": True}, "logprobs", ("embeddings", "no tokens"), id="embeddings"
    ),
    pytest.param(
        "in.parquet",
        {"prompt": ["a"]},
        {"logprobs": True, "endpoint": "responses"},
        "logprobs",
        ("endpoint chat",),
        id="responses",
    ),
    pytest.param(
        "in.parquet",
        {"prompt": ["a"], "logprobs": ["x"]},
        {"logprobs": True},
        "logprobs",
        ("rename it", "set the option logprobs to false"),
        id="column-clash",
    ),
    pytest.param("in.jsonl", None, {"logprobs": True}, "logprobs", ("Parquet job's option", "own body"), id="jsonl"),
]


@pytest.mark.parametrize(("name", "columns", "options", "field", "says"), REFUSED)
def test_the_command_line_refuses_them_in_one_line_with_exit_code_2(
    name: str,
    columns: dict[str, list[Any]] | None,
    options: dict[str, Any],
    field: str,
    says: tuple[str, ...],
    tmp_path: Path,
    refusing_cli: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = tmp_path / name
    if columns is None:
        write_jsonl(src, [chat_row("r1", "hi", max_tokens=4)])
    else:
        parquet(src, **columns)
    (tmp_path / "job.json").write_text(json.dumps(options))
    out = tmp_path / f"out{src.suffix}"
    code = main(["run", str(src), "-o", str(out), "--options", str(tmp_path / "job.json")])
    _, err = capsys.readouterr()
    assert code == 2, err
    assert "Traceback" not in err
    problems = [line for line in err.splitlines() if f"field '{field}'" in line]
    assert len(problems) == 1, err
    for words in says:
        assert words.lower() in problems[0].lower(), err
    assert not list(tmp_path.glob("out*")), "a refused job left output files behind"


def test_a_refusal_names_the_option_for_the_batch_api_as_well() -> None:
    """Options are read by one parser for every source: a wrong one is a JobRejected naming it."""
    with pytest.raises(JobRejected) as refused:
        job_options({"n": 3})
    assert [p.field for p in refused.value.problems] == ["n"]
    assert JobOptions().logprobs is None and job_options({"logprobs": True, "top_logprobs": 0}).top_logprobs == 0


def test_the_command_line_asks_for_the_column_with_flags(tmp_path: Path) -> None:
    from anex_pipeline.cli.parser import build_parser, collect_options

    src = parquet(tmp_path / "in.parquet", prompt=["a"])
    argv = ["run", str(src), "-o", str(tmp_path / "o.parquet"), "--logprobs", "--top-logprobs", "3"]
    options = collect_options(build_parser().parse_args(argv))
    assert (options["logprobs"], options["top_logprobs"]) == (True, 3)
    assert job_options(options).logprobs is True
    assert "logprobs" not in collect_options(build_parser().parse_args(argv[:4]))
